"""The floor under the due heads (outbox_heads_floor). A claim reads outbox_heads_ready_idx from the floor up, so
the dead index entries a held snapshot keeps alive below it are never read again; and the floor
never passes a head that is, or will be, due: one written by a transaction still open (it
announced itself), one given back by a claim that rolled back, one the commit-order guard holds."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from helpers import claim, claim_ids, complete, connect, entries_read, fail, insert, requeue

Conn = psycopg.Connection[Any]


def floor_us(conn: Conn) -> int:
    row = conn.execute("SELECT coalesce(pg_sequence_last_value('outbox_heads_floor_us'), 0)").fetchone()
    assert row is not None
    return int(row[0])


def ready_index_reads_of_one_claim(conn: Conn) -> tuple[int, list[int]]:
    """Index entries of outbox_heads_ready_idx one claim reads, and the ids it hands out; rolled
    back afterwards."""
    conn.execute("BEGIN")
    try:
        return entries_read(conn, "outbox_heads_ready_idx", lambda: claim_ids(conn, 10))
    finally:
        conn.execute("ROLLBACK")


def cycle(conn: Conn, n: int, prefix: str) -> None:
    """n events of n aggregates, claimed and completed: each leaves dead versions of its head."""
    for i in range(n):
        insert(conn, "order", f"{prefix}-{i}")
    rows = claim(conn, n)
    assert len(rows) == n
    assert complete(conn, [r["id"] for r in rows], rows[0]["lease_token"]) == n


def test_a_held_snapshot_leaves_the_claim_reading_few_index_entries(dsn: str, conn: Conn) -> None:
    with connect(dsn, autocommit=False) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox").fetchone()     # the snapshot is taken
        for round_ in range(60):
            cycle(conn, 20, f"r{round_}")
        time.sleep(0.05)                                               # the floor may be raised again
        assert claim_ids(conn) == []                                   # and is: the dead entries fall below it
        insert(conn, "order", "last")
        reads, ids = ready_index_reads_of_one_claim(conn)
        holder.rollback()
    assert len(ids) == 1
    # 1,200 heads came and went, each leaving dead entries in the index that the snapshot keeps
    # alive; this claim read 1 of them (seen), and 1,201 with the floor at -infinity
    # (outbox_heads_floor() replaced).
    assert reads < 50, reads


def test_a_head_an_open_transaction_writes_is_not_passed(dsn: str, conn: Conn) -> None:
    """A requeue in a transaction still open makes a head due (its old version was held by a dead
    letter, in no index range): claims meanwhile raise the floor, but no higher than the time the
    requeue announced."""
    i = insert(conn, "order", "dead-one")
    (row,) = claim(conn, 1)
    assert fail(conn, i, row["lease_token"], "boom", permanent=True) == "dead"
    time.sleep(0.05)                                         # the requeue announces a later time than any floor so far
    with connect(dsn, autocommit=False) as operator:
        assert requeue(operator, [i]) == 1                   # open: the head's new ready_at is not visible
        time.sleep(0.05)
        before = floor_us(conn)
        assert claim_ids(conn) == []                         # raises the floor
        assert floor_us(conn) > before
        operator.commit()
    assert claim_ids(conn) == [i]


def test_a_head_announced_by_nobody_would_be_passed(dsn: str, conn: Conn) -> None:
    """The test above can fail: with the announcement made a no-op, the same steps lose the head
    below the floor (it stays pending, unclaimed)."""
    conn.execute("CREATE OR REPLACE FUNCTION outbox_heads_writing() RETURNS void LANGUAGE sql AS 'SELECT'")
    i = insert(conn, "order", "dead-one")
    (row,) = claim(conn, 1)
    assert fail(conn, i, row["lease_token"], "boom", permanent=True) == "dead"
    with connect(dsn, autocommit=False) as operator:
        assert requeue(operator, [i]) == 1
        time.sleep(0.05)
        assert claim_ids(conn) == []
        operator.commit()
    assert claim_ids(conn) == []
    assert conn.execute("SELECT state::text FROM outbox WHERE id = %s", (i,)).fetchone() == ("pending",)


def test_a_claim_that_rolls_back_gives_its_heads_back_above_the_floor(dsn: str, conn: Conn,
                                                                     fast_retries: None) -> None:
    """The head's committed ready_at (a retry's time) is older than the other claim's
    announcement: only the read of the heads as committed keeps the floor below it."""
    i = insert(conn, "order", "a")
    (row,) = claim(conn, 1)
    assert fail(conn, i, row["lease_token"], "boom") == "pending"     # the head: ready at the retry
    (ready,) = conn.execute("SELECT (extract(epoch FROM ready_at) * 1e6)::bigint FROM outbox_heads").fetchone()  # type: ignore[misc]
    time.sleep(0.3)                                                   # past the retry's time
    with connect(dsn, autocommit=False) as other:
        assert claim_ids(other) == [i]                      # the head moves to the lease's end, uncommitted
        time.sleep(0.05)
        assert claim_ids(conn) == []                         # skips the locked head, raises the floor
        assert floor_us(conn) <= ready
        other.rollback()
    assert claim_ids(conn) == [i]


def test_a_head_the_commit_guard_holds_back_keeps_the_floor_below_it(dsn: str, conn: Conn) -> None:
    with connect(dsn, autocommit=False) as producer:
        insert(producer, "order", "held")                    # open: holds aggregate 'held' back
        later = insert(conn, "order", "held")                # committed, behind it
        other = insert(conn, "order", "free")
        assert claim_ids(conn) == [other]
        time.sleep(0.05)
        assert claim_ids(conn) == []                         # 'held' is due but held: the floor stays below
        producer.commit()
    ids = claim_ids(conn)
    assert later in ids and len(ids) == 2


def set_floor_us(conn: Conn, us: int) -> None:
    conn.execute("SELECT setval('outbox_heads_floor_us', %s)", (us,))


def test_a_floor_just_under_the_first_head_stays_where_it_is(conn: Conn) -> None:
    """Behind a first head that lies less than 20 ms above the floor (a backlog's oldest head,
    which stays first for as long as it is leased), the claims leave the floor as it is, and
    with it the read of pg_locks that a raise needs; 20 ms or more above it, they raise it."""
    i = insert(conn, "order", "a")
    assert claim_ids(conn) == [i]                            # leased: the head keeps its ready_at
    (ready,) = conn.execute("SELECT (extract(epoch FROM ready_at) * 1e6)::bigint FROM outbox_heads").fetchone()  # type: ignore[misc]
    set_floor_us(conn, ready - 10_000)
    time.sleep(0.05)                                         # the floor is more than 20 ms old
    assert claim_ids(conn) == []
    assert floor_us(conn) == ready - 10_000
    set_floor_us(conn, ready - 30_000)
    assert claim_ids(conn) == []
    assert floor_us(conn) == ready


def test_a_floor_ahead_of_the_clock_is_reset(conn: Conn) -> None:
    """The clock went back (or the sequence was set by hand): the claim starts again from nothing."""
    i = insert(conn, "order", "a")
    conn.execute("SELECT setval('outbox_heads_floor_us', (extract(epoch FROM now() + interval '1 hour') * 1e6)::bigint)")
    assert claim_ids(conn) == [i]
    assert floor_us(conn) < time.time() * 1e6


def test_the_floor_only_rises_under_read_committed(dsn: str, conn: Conn) -> None:
    insert(conn, "order", "a")
    time.sleep(0.05)
    before = floor_us(conn)
    with connect(dsn, autocommit=False) as rr:
        rr.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        assert len(claim(rr, 10)) == 1
        rr.rollback()
    assert floor_us(conn) == before


def test_a_report_reads_its_heads_by_key_whatever_analyze_counted(dsn: str, conn: Conn) -> None:
    """Under a held snapshot, outbox_heads_pkey fills with dead entries while ANALYZE counts few
    live heads; a report then joined by key let the planner read the whole index, on every
    report. A report looks up each of its heads by key, then works on them by ctid."""
    with connect(dsn, autocommit=False) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox").fetchone()
        for round_ in range(20):
            conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                         "SELECT 'order', 'a' || g, 'e', '{}' FROM generate_series(1, 200) g")
            rows = claim(conn, 200)
            assert complete(conn, [r["id"] for r in rows], rows[0]["lease_token"]) == 200, round_
        conn.execute("ANALYZE outbox_heads")
        a, b = insert(conn, "order", "a1"), insert(conn, "order", "a2")
        rows = claim(conn, 10)
        assert sorted(r["id"] for r in rows) == [a, b]
        conn.execute("BEGIN")
        reads, done = entries_read(conn, "outbox_heads_pkey", lambda: complete(conn, [a, b], rows[0]["lease_token"]))
        conn.execute("COMMIT")
        holder.rollback()
    assert done == 2
    # Two heads' own dead entries and their lookups (seen: 84); the index holds some 12,000.
    # A report that joins its heads by key read 32,016: the whole index, on every report.
    assert reads < 1000, reads
