"""Shards: outbox_claim(..., shard => 'I/N') hands out the aggregates of shard I only (64 buckets
by a hash of the aggregate's key, shard I of N a range of them); the N shards together hand out
everything, each aggregate in id order; a shard's claim reads its own buckets' heads, not the
other shards' backlog; without a shard, the claim is the one it always was."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import complete, entries_read, insert, set_settings

Conn = psycopg.Connection[Any]


def shard_claim(conn: Conn, n: int, shard: str | None) -> list[tuple[int, str, Any, int]]:
    """(id, aggregate_id, lease_token, bucket) of what one claim of ``shard`` hands out."""
    return conn.execute("SELECT id, aggregate_id, lease_token, outbox_aggregate_bucket(aggregate_type, aggregate_id) "
                        "FROM outbox_claim(%s, shard => %s)", (n, shard)).fetchall()


def buckets_of(conn: Conn, shard: str) -> set[int]:
    row = conn.execute("SELECT outbox_shard_buckets(%s)", (shard,)).fetchone()
    assert row is not None
    return set(row[0])


def aggregates_in(conn: Conn, count: int, buckets: set[int], prefix: str) -> list[str]:
    """``count`` aggregate ids of type 'order' whose bucket is in ``buckets``."""
    rows = conn.execute("SELECT a FROM (SELECT %s || g AS a FROM generate_series(1, %s) g) s "
                        "WHERE outbox_aggregate_bucket('order', a) = ANY (%s) LIMIT %s",
                        (prefix, 64 * count, sorted(buckets), count)).fetchall()
    assert len(rows) == count
    return [r[0] for r in rows]


def test_the_shards_split_the_buckets_and_cover_each_once(conn: Conn) -> None:
    for n in (1, 2, 3, 5, 8, 64):
        seen: list[int] = []
        for i in range(n):
            b = sorted(buckets_of(conn, f"{i}/{n}"))
            assert b == list(range(b[0], b[-1] + 1))           # a contiguous range
            assert len(b) in (64 // n, -(-64 // n))             # of about 64/N buckets
            seen += b
        assert seen == list(range(64))


def test_a_shard_claims_only_its_own_aggregates_and_the_shards_together_everything(conn: Conn) -> None:
    assert conn.execute("SELECT outbox_shards_enable()").fetchone() == (True,)
    assert conn.execute("SELECT outbox_shards_enable()").fetchone() == (False,)   # once
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', 'o' || (g % 300), 'e', '{}' FROM generate_series(1, 3000) g")
    shards = [f"{i}/3" for i in range(3)]
    mine = {s: buckets_of(conn, s) for s in shards}
    got: dict[str, list[int]] = {}                            # aggregate -> ids in the order handed out
    for _ in range(100):
        handed = 0
        for s in shards:
            rows = shard_claim(conn, 200, s)
            assert {r[3] for r in rows} <= mine[s], s              # never another shard's aggregate
            for i, agg, _token, _bucket in rows:
                got.setdefault(agg, []).append(i)
            if rows:
                assert complete(conn, [r[0] for r in rows], rows[0][2]) == len(rows)
            handed += len(rows)
        if handed == 0:
            break
    ids = [i for agg in got.values() for i in agg]
    assert len(ids) == len(set(ids)) == 3000                     # each event once
    assert all(agg == sorted(agg) for agg in got.values())       # each aggregate in id order
    assert conn.execute("SELECT count(*) FROM outbox_claim(100)").fetchone() == (0,)


def test_a_shards_claim_reads_its_own_front_whatever_another_shards_backlog(dsn: str, conn: Conn) -> None:
    """30,000 due heads in shard 1/2, older than shard 0/2's ten: shard 0's claim reads its probes
    (one per bucket), the front of its buckets and its ten heads; the claim without a shard
    reads from the front of the whole queue, through shard 1's heads."""
    conn.execute("SELECT outbox_shards_enable()")
    other = aggregates_in(conn, 30000, buckets_of(conn, "1/2"), "busy-")
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', a, 'e', '{}' FROM unnest(%s::text[]) a", (other,))
    while conn.execute("SELECT count(*) FROM outbox_claim(1, shard => '0/2')").fetchone() == (0,) \
            and conn.execute("SELECT intake_id < (SELECT max(id) FROM outbox) FROM outbox_intake").fetchone() == (True,):
        pass                                                     # the intake gives shard 1's aggregates heads
    assert conn.execute("SELECT count(*) FROM outbox_heads WHERE ready_at IS NOT NULL").fetchone() == (30000,)
    own = aggregates_in(conn, 10, buckets_of(conn, "0/2"), "quiet-")
    for agg in own:
        insert(conn, "order", agg)
    with psycopg.connect(dsn, autocommit=False) as c:
        reads, rows = entries_read(c, "outbox_heads_bucket_idx", lambda: shard_claim(c, 100, "0/2"))
        c.rollback()
    assert sorted(r[1] for r in rows) == sorted(own)
    # 32 probes, the front read (16 at most) and the claim's own heads: what it hands out and
    # its buckets, not the 30,000 heads before them (measured: about 60).
    assert reads <= 32 + 16 + 2 * 10 + 10, reads
    with psycopg.connect(dsn, autocommit=False) as c:
        reads, rows = entries_read(c, "outbox_heads_ready_idx", lambda: shard_claim(c, 10, None))
        c.rollback()
    assert len(rows) == 10 and reads >= 10
    assert {r[1] for r in rows}.isdisjoint(own)                  # shard 1's older heads first


def test_a_shard_needs_the_index_and_a_well_formed_shard(conn: Conn) -> None:
    insert(conn, "order", "a")
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match=r"outbox_shards_enable\(\)"):
        shard_claim(conn, 10, "0/2")
    assert len(shard_claim(conn, 10, "0/1")) == 1                # every bucket: the plain claim
    conn.execute("SELECT outbox_shards_enable()")
    for bad in ("2/2", "0/0", "0/65", "-1/2", "1", "a/b", ""):
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="shard must be I/N"):
            shard_claim(conn, 10, bad)
    assert conn.execute("SELECT outbox_shards_disable(), outbox_shards_disable()").fetchone() == (True, False)


def test_an_expired_run_goes_back_to_its_shard(conn: Conn) -> None:
    """A shard's worker that died: its runs' leases expire and a claim of the same shard takes
    them again, the first event one attempt more, the old token fenced."""
    conn.execute("SELECT outbox_shards_enable()")
    set_settings(conn, backoff_base="1 millisecond", backoff_cap="1 millisecond")
    (agg,) = aggregates_in(conn, 1, buckets_of(conn, "1/2"), "x-")
    first = insert(conn, "order", agg)
    insert(conn, "order", agg)
    rows = conn.execute("SELECT id, lease_token FROM outbox_claim(10, '1 millisecond', shard => '1/2')").fetchall()
    assert [r[0] for r in rows] == [first, first + 1]
    conn.execute("SELECT pg_sleep(0.01)")
    assert shard_claim(conn, 10, "0/2") == []                    # not the other shard's
    again: list[tuple[int, str, Any, int]] = []
    for _ in range(50):                                          # reclaimed, then due after its 1 ms backoff
        if again := shard_claim(conn, 10, "1/2"):
            break
        conn.execute("SELECT pg_sleep(0.01)")
    assert [r[0] for r in again] == [first, first + 1]
    assert conn.execute("SELECT attempts FROM outbox WHERE id = %s", (first,)).fetchone() == (2,)
    assert complete(conn, [first, first + 1], rows[0][1]) == 0   # the dead worker's token: fenced
    assert complete(conn, [first, first + 1], again[0][2]) == 2
