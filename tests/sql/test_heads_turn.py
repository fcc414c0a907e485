"""0029: a report that leaves its aggregate's head due keeps the head's place in the queue for up
to 250 ms (its turn) and moves head_id, which no index holds any more, so the update is HOT. Up to
0028 every report of a busy aggregate moved its head in outbox_heads_ready_idx: one more entry of
its key in outbox_heads_pkey per run, which a held snapshot keeps alive and which the next
intake, claim and report of the aggregate each read."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from helpers import claim, complete, connect, entries_read, heads_updates, insert

Conn = psycopg.Connection[Any]


def head(conn: Conn, aggregate_id: str) -> tuple[Any, ...]:
    row = conn.execute("SELECT head_id, ready_at FROM outbox_heads WHERE aggregate_id = %s",
                       (aggregate_id,)).fetchone()
    assert row is not None
    return tuple(row)


def test_a_report_that_leaves_its_head_due_is_a_hot_update(conn: Conn) -> None:
    first, second = insert(conn, "order", "busy"), insert(conn, "order", "busy")
    (row,) = claim(conn, 1)
    assert row["id"] == first
    _, ready = head(conn, "busy")
    conn.execute("BEGIN")
    before = heads_updates(conn)
    assert complete(conn, [first], row["lease_token"]) == 1
    after = heads_updates(conn)
    conn.execute("COMMIT")
    # Seen with 0028: (1, 0): ready_at and head_id moved in outbox_heads_ready_idx.
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert head(conn, "busy") == (second, ready)        # the next event, in the same place


def test_under_a_held_snapshot_a_busy_aggregate_reads_few_entries_of_its_key(dsn: str, conn: Conn) -> None:
    ids = [insert(conn, "order", "busy") for _ in range(42)]
    with connect(dsn, autocommit=False) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox").fetchone()     # the snapshot is taken

        def cycle() -> int:
            (row,) = claim(conn, 1)
            return complete(conn, [row["id"]], row["lease_token"])

        for _ in range(40):
            assert cycle() == 1
        reads, done = entries_read(conn, "outbox_heads_pkey", cycle)
        holder.rollback()
    assert done == 1
    assert conn.execute("SELECT head_id FROM outbox_heads").fetchall() == [(ids[-1],)]
    # 41 runs of one aggregate, each claimed and reported. Seen with 0028: 41 entries read (each
    # report left one, and the next run's lookups walk them); with 0029, 1.
    assert reads < 20, reads


def test_a_busy_head_keeps_its_turn_for_250_ms_then_goes_behind(conn: Conn) -> None:
    a = [insert(conn, "order", "a") for _ in range(4)]
    (ra,) = claim(conn, 1)
    assert ra["id"] == a[0]
    b = [insert(conn, "order", "b") for _ in range(2)]
    (rb,) = claim(conn, 1)                              # a's run is out: b's head, made later
    assert rb["id"] == b[0]
    a_ready, b_ready = head(conn, "a")[1], head(conn, "b")[1]
    assert a_ready < b_ready
    assert complete(conn, [a[0]], ra["lease_token"]) == 1
    assert complete(conn, [b[0]], rb["lease_token"]) == 1
    assert head(conn, "a") == (a[1], a_ready)           # seen with 0028: moved behind b
    (ra,) = claim(conn, 1)
    assert ra["id"] == a[1]
    assert complete(conn, [a[1]], ra["lease_token"]) == 1
    time.sleep(0.3)                                     # past its turn
    (ra,) = claim(conn, 1)
    assert ra["id"] == a[2]                             # still first: its place was kept
    assert complete(conn, [a[2]], ra["lease_token"]) == 1
    head_id, ready = head(conn, "a")
    assert head_id == a[3] and ready > b_ready          # the report put it behind b
    (rb,) = claim(conn, 1)
    assert rb["id"] == b[1]
