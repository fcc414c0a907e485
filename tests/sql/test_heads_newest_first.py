"""0030: a report locks its aggregates' heads by key from the newest entry of outbox_heads_pkey
down and stops at the version it sees. Up to 0029 it read every entry of the key from the
oldest: under a held snapshot a busy aggregate's key gains one each time its head's page fills
and each time the head is dropped and made again, and every report of the aggregate walked them
all. The live version is the newest entry's in both cases."""

from __future__ import annotations

from typing import Any

import psycopg
from helpers import claim, complete, connect, entries_read, insert

from outboxpg import schema

Conn = psycopg.Connection[Any]


def key_entries(conn: Conn, aggregate_id: str) -> int:
    """Entries of the key in outbox_heads_pkey (an equality scan reads them all)."""
    reads, _ = entries_read(conn, "outbox_heads_pkey", lambda: conn.execute(
        "SELECT 1 FROM outbox_heads WHERE aggregate_type = 'order' AND aggregate_id = %s",
        (aggregate_id,)).fetchall())
    return reads


def busy_head_under_held_snapshot(conn: Conn, holder: Conn) -> int:
    """300 runs of one aggregate whose head stays (one event always waits) while ``holder``
    holds a snapshot; returns the entries its key then has in outbox_heads_pkey."""
    insert(conn, "order", "busy")
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM outbox").fetchone()     # the snapshot is taken
    # Each run writes the head twice (the claim's lease, the report), and the held snapshot keeps
    # every version: HOT while the head's page has room, and each time the page is full the
    # next version goes to another page and adds an entry of its key.
    for _ in range(300):
        insert(conn, "order", "busy")
        (row,) = claim(conn, 1)
        assert complete(conn, [row["id"]], row["lease_token"]) == 1
    return key_entries(conn, "busy")


def test_under_a_held_snapshot_a_report_finds_a_busy_head_without_walking_its_old_entries(
        dsn: str, conn: Conn) -> None:
    with connect(dsn, autocommit=False) as holder:
        entries = busy_head_under_held_snapshot(conn, holder)
        assert entries >= 5, entries                    # the case this is about (7 seen)
        insert(conn, "order", "busy")
        (row,) = claim(conn, 1)
        reads, done = entries_read(conn, "outbox_heads_pkey", lambda: complete(conn, [row["id"]], row["lease_token"]))
        holder.rollback()
    assert done == 1
    # Seen with 0029: every entry of the key (reads == entries).
    assert reads <= 2, (reads, entries)
    # The head moved on to the event that waits.
    (waiting,) = conn.execute("SELECT max(id) FROM outbox WHERE state = 'pending'").fetchone()
    assert conn.execute("SELECT head_id FROM outbox_heads").fetchall() == [(waiting,)]


def test_rolling_0030_back_restores_the_lookup_from_the_oldest_entry(empty_dsn: str) -> None:
    schema.migrate(empty_dsn)
    ids = schema.step_ids()
    step = "0030_outbox_heads_newest_first"
    since = ids[ids.index(step):]
    assert schema.rollback(empty_dsn, count=len(since)) == since[::-1]
    with connect(empty_dsn) as conn:
        body = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'outbox_refresh_heads'").fetchone()[0]
        assert "ORDER BY h.aggregate_type DESC" not in body
        assert "h.aggregate_type = s.t AND h.aggregate_id = s.i" in body
        first, second = insert(conn, "order", "o-1"), insert(conn, "order", "o-1")
        (row,) = claim(conn, 1)
        assert complete(conn, [first], row["lease_token"]) == 1      # 0029's report, as it was
    assert schema.migrate(empty_dsn) == since
    with connect(empty_dsn) as conn:
        body = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'outbox_refresh_heads'").fetchone()[0]
        assert "ORDER BY h.aggregate_type DESC" in body
        (row,) = claim(conn, 1)
        assert row["id"] == second
        assert complete(conn, [second], row["lease_token"]) == 1
