"""0028: a claim leases a head by setting leased_until, a column in no index, so the update is HOT
and adds no entry to outbox_heads_pkey or outbox_heads_ready_idx. Up to 0027 it moved ready_at to
the lease's end: two new index entries per run, which a held snapshot keeps alive and which every
later lookup of the aggregate's key reads."""

from __future__ import annotations

from typing import Any

import psycopg
from helpers import claim, claim_ids, complete, connect, entries_read, heads_updates, insert

from outboxpg import schema

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
    # Seen before 0028: 19 updates, 0 of them HOT.
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
    # 41 events: the intake's insert, the claim's update (before 0028) and the report's lock each
    # walk the key's entries. Seen: 81 with 0028, 162 with 0027.
    assert reads < 120, reads


def test_rolling_0028_back_keeps_a_run_in_flight_held(empty_dsn: str) -> None:
    """Its rollback gives a leased head its lease's end as ready_at (how 0027 holds a run), so a
    run in flight during the rollback is not handed out again; migrating again works."""
    schema.migrate(empty_dsn)
    with connect(empty_dsn) as conn:
        first = insert(conn, "order", "o-1")
        (row,) = claim(conn, 10, lease="10 minutes")
        assert row["id"] == first
        second = insert(conn, "order", "o-1")
        other = insert(conn, "order", "o-2")
    ids = schema.step_ids()
    since = ids[ids.index("0028_outbox_heads_lease"):]     # 0028 and the steps after it
    assert schema.rollback(empty_dsn, count=len(since)) == since[::-1]
    with connect(empty_dsn) as conn:
        held = conn.execute("SELECT ready_at = %s FROM outbox_heads WHERE aggregate_id = 'o-1'",
                            (row["locked_until"],)).fetchone()
        assert held == (True,)
        assert claim_ids(conn) == [other]             # not o-1's next event: its run is out
    assert schema.migrate(empty_dsn) == since
    with connect(empty_dsn) as conn:
        assert complete(conn, [first], row["lease_token"]) == 1
        assert claim_ids(conn) == [second]
