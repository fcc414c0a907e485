"""Under a held snapshot (a REPEATABLE READ transaction left open, a session idle in a
transaction) no row version made since it began can be removed, and every lookup of a key walks
the index entries of all of them. So the heads' updates stay HOT and add no index entry: a claim
leases a head by leased_until and a report moves head_id, both in no index; a busy head keeps its
place in the queue for a turn of 250 ms rather than moving in outbox_heads_ready_idx at every
run; and a report finds its heads from the newest entry of their key down, where the live version
usually is."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from helpers import claim, claim_ids, complete, connect, entries_read, heads_updates, insert

Conn = psycopg.Connection[Any]


def test_a_claim_leases_its_heads_with_hot_updates(conn: Conn) -> None:
    for i in range(20):
        insert(conn, "order", f"a{i}")
    assert claim_ids(conn, 1) != []                    # takes the 20 events in (and leases one)
    conn.execute("BEGIN")
    before = heads_updates(conn)
    taken = claim(conn, 100)
    after = heads_updates(conn)
    conn.execute("COMMIT")
    assert len(taken) == 19
    updated, hot = after[0] - before[0], after[1] - before[1]
    # A lease that moved ready_at (in the ready index) would make 19 updates, none of them HOT.
    assert (updated, hot) == (19, 19)
    leased = conn.execute("SELECT count(*) FROM outbox_heads WHERE leased_until > clock_timestamp()").fetchone()
    assert leased == (20,)


def test_under_a_held_snapshot_an_aggregate_reads_one_dead_key_entry_per_event(dsn: str, conn: Conn) -> None:
    """Each event of an aggregate (intake, claim, report) leaves one entry of its key in
    outbox_heads_pkey (the intake's insert), not two; the next event's claim and report read
    them all while a snapshot holds them."""
    with connect(dsn, autocommit=False) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox").fetchone()     # the snapshot is taken
        for _ in range(40):
            i = insert(conn, "order", "busy")
            (row,) = claim(conn, 10)
            assert complete(conn, [i], row["lease_token"]) == 1
        i = insert(conn, "order", "busy")

        def cycle() -> int:
            (row,) = claim(conn, 10)
            return complete(conn, [i], row["lease_token"])

        reads, done = entries_read(conn, "outbox_heads_pkey", cycle)
        holder.rollback()
    assert done == 1
    # 41 events: the intake's insert and the report's lock each walk the key's entries (81 seen);
    # a claim that moved the head in its index would walk them too (162).
    assert reads < 120, reads


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
    # Not (1, 0): ready_at and head_id stay out of outbox_heads_ready_idx's way.
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
    # 41 runs of one aggregate, each claimed and reported: 1 entry read (a report that moved the
    # head in the index at every run would leave one each, and the next run's lookups walk them: 41).
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
    assert head(conn, "a") == (a[1], a_ready)           # not moved behind b: within its turn
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


def key_entries(conn: Conn, aggregate_id: str) -> int:
    """Entries of the key in outbox_heads_pkey (an equality scan reads them all). The scan is
    forced: once analysed, a table of one head is read sequentially, which reads no entry."""
    def scan() -> None:
        conn.execute("SET LOCAL enable_seqscan = off")
        conn.execute("SELECT 1 FROM outbox_heads WHERE aggregate_type = 'order' AND aggregate_id = %s",
                     (aggregate_id,)).fetchall()
    reads, _ = entries_read(conn, "outbox_heads_pkey", scan)
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
    conn.execute("ANALYZE outbox_heads")               # as autovacuum may have done meanwhile
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
    # Not every entry of the key (reads == entries), as a lookup from the oldest would read.
    assert reads <= 2, (reads, entries)
    # The head moved on to the event that waits.
    (waiting,) = conn.execute("SELECT max(id) FROM outbox WHERE state = 'pending'").fetchone()
    assert conn.execute("SELECT head_id FROM outbox_heads").fetchall() == [(waiting,)]
