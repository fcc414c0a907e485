"""The intake row under a held snapshot. outbox_intake is one row, and every claim that moves the
cursor writes a version of it, which a held snapshot keeps alive: read by a scan, the row costs
every claim a look at every version (a page per hundred-odd claims). A claim reads it by the
ctid the last intake wrote instead (remembered in the sequence outbox_intake_tid), and scans only
when that version is gone (a claim that rolled back after writing it, a write by hand)."""

from __future__ import annotations

from typing import Any

import psycopg
from helpers import claim, complete, connect, insert

Conn = psycopg.Connection[Any]


def intake_blocks_of_one_claim(conn: Conn) -> tuple[int, list[dict[str, Any]]]:
    """Heap blocks of outbox_intake one claim reads, and what it hands out (rolled back)."""
    count = "SELECT pg_stat_get_xact_blocks_fetched('outbox_intake'::regclass)"
    conn.execute("BEGIN")
    try:
        (before,) = conn.execute(count).fetchone()  # type: ignore[misc]
        rows = claim(conn, 10)
        (after,) = conn.execute(count).fetchone()  # type: ignore[misc]
    finally:
        conn.execute("ROLLBACK")
    return int(after) - int(before), rows


def versions_under_a_held_snapshot(conn: Conn, n: int) -> None:
    """n versions of the intake row, written by hand (as any writer would leave them)."""
    for _ in range(n):
        conn.execute("UPDATE outbox_intake SET last_claim_at = clock_timestamp()")


def test_under_a_held_snapshot_a_claim_reads_the_intake_row_without_its_old_versions(dsn: str, conn: Conn) -> None:
    with connect(dsn, autocommit=False) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox").fetchone()     # the snapshot is taken
        versions_under_a_held_snapshot(conn, 3000)
        # The first claim after the writes by hand finds the row by a scan, and moves the cursor.
        insert(conn, "order", "first")
        rows = claim(conn, 10)
        assert len(rows) == 1
        assert complete(conn, [r["id"] for r in rows], rows[0]["lease_token"]) == 1
        # The next one reads the version that claim wrote, and no other.
        insert(conn, "order", "second")
        blocks, rows = intake_blocks_of_one_claim(conn)
        holder.rollback()
    assert [r["aggregate_id"] for r in rows] == ["second"]
    # The version locked, the one the update writes and the free-space map's look for its page:
    # 5 with 3,000 versions and with 6,000. A scan reads every page the versions lie on: 27.
    assert blocks <= 6, blocks


def test_a_remembered_version_that_is_gone_sends_the_claim_to_the_row_itself(conn: Conn) -> None:
    insert(conn, "order", "a")
    rows = claim(conn, 10)
    assert complete(conn, [r["id"] for r in rows], rows[0]["lease_token"]) == 1
    # A claim that wrote a version and rolled back leaves the sequence naming it; a write by hand
    # leaves it naming an old one. Either way the next claims find the row and take new events in.
    conn.execute("BEGIN")
    insert(conn, "order", "b")
    assert [r["aggregate_id"] for r in claim(conn, 10)] == ["b"]
    conn.execute("ROLLBACK")
    conn.execute("UPDATE outbox_intake SET last_claim_at = clock_timestamp()")
    insert(conn, "order", "c")
    assert [r["aggregate_id"] for r in claim(conn, 10)] == ["c"]
    insert(conn, "order", "d")
    assert [r["aggregate_id"] for r in claim(conn, 10)] == ["d"]
    # A place past the table's end (a restore of a dump, a VACUUM FULL): the same.
    conn.execute("SELECT setval('outbox_intake_tid', 999 * 65536 + 1)")
    insert(conn, "order", "e")
    assert [r["aggregate_id"] for r in claim(conn, 10)] == ["e"]
    (cursor,) = conn.execute("SELECT intake_id FROM outbox_intake").fetchone()  # type: ignore[misc]
    (top,) = conn.execute("SELECT max(id) FROM outbox").fetchone()  # type: ignore[misc]
    assert cursor == top


def test_a_claim_finding_the_remembered_version_locked_takes_nothing_in(dsn: str, conn: Conn) -> None:
    insert(conn, "order", "a")
    assert [r["aggregate_id"] for r in claim(conn, 10)] == ["a"]
    with connect(dsn, autocommit=False) as other:
        other.execute("SELECT 1 FROM outbox_intake FOR UPDATE")      # an intake in progress
        insert(conn, "order", "b")
        # Held: nothing taken in (the head of "b" is not made), the claim comes back empty after
        # its wait for the holder (at most a second: outbox_intake_wait).
        assert claim(conn, 10) == []
        other.rollback()
    assert [r["aggregate_id"] for r in claim(conn, 10)] == ["b"]
