"""outbox_complete with the events' created_at range reads only the partitions that can hold them
(created_at is the partition key); without one it reads every partition, and a range that
leaves an event out leaves it leased."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from helpers import claim, complete, insert_series

Conn = psycopg.Connection[Any]


def in_flow_index_of_other_partitions(conn: Conn, created_at: Any) -> list[str]:
    """outbox_in_flow_idx's index on every partition but the one ``created_at`` falls in."""
    rows = conn.execute(
        "SELECT i.inhrelid::regclass::text FROM pg_inherits i "
        "JOIN pg_index x ON x.indexrelid = i.inhrelid "
        "WHERE i.inhparent = 'outbox_in_flow_idx'::regclass "
        "AND x.indrelid <> (SELECT o.tableoid FROM outbox o WHERE o.created_at = %s LIMIT 1)",
        (created_at,)).fetchall()
    return [r[0] for r in rows]


def scans(conn: Conn, indexes: list[str]) -> int:
    """Scans of ``indexes`` by this backend's current transaction so far."""
    row = conn.execute("SELECT sum(pg_stat_get_xact_numscans(x::regclass)) FROM unnest(%s::text[]) x",
                       (indexes,)).fetchone()
    assert row is not None
    return int(row[0] or 0)


def claimed(conn: Conn, n: int) -> tuple[list[int], Any, Any, Any]:
    """n events of n aggregates claimed: (ids, token, least created_at, greatest created_at)."""
    insert_series(conn, [f"a{i}" for i in range(n)])
    rows = claim(conn, n)
    assert len(rows) == n
    created = [r["created_at"] for r in rows]
    return [r["id"] for r in rows], rows[0]["lease_token"], min(created), max(created)


def test_a_report_with_the_events_range_reads_only_their_partition(conn: Conn) -> None:
    ids, token, lo, hi = claimed(conn, 3)
    others = in_flow_index_of_other_partitions(conn, lo)
    assert len(others) >= 4                     # today's partition is one of 5 on a new install
    with conn.transaction():
        before = scans(conn, others)
        done = complete(conn, ids, token, lo, hi)
        after = scans(conn, others)
    assert done == 3
    assert after - before == 0, after - before


def test_a_report_without_a_range_reads_every_partition(conn: Conn) -> None:
    ids, token, lo, _ = claimed(conn, 3)
    others = in_flow_index_of_other_partitions(conn, lo)
    with conn.transaction():
        before = scans(conn, others)
        done = complete(conn, ids, token)
        after = scans(conn, others)
    assert done == 3
    assert after - before >= len(others)


def test_a_range_that_leaves_an_event_out_leaves_it_leased(conn: Conn) -> None:
    ids, token, lo, hi = claimed(conn, 2)
    assert complete(conn, ids, token, lo - timedelta(days=2), lo - timedelta(days=1)) == 0
    states = conn.execute("SELECT state, count(*) FROM outbox GROUP BY state").fetchall()
    assert states == [("processing", 2)]
    assert complete(conn, ids, token, lo, hi) == 2
    assert conn.execute("SELECT state, count(*) FROM outbox GROUP BY state").fetchall() == [("published", 2)]


def test_a_range_cut_to_milliseconds_leaves_no_event_out(conn: Conn) -> None:
    # A client whose time type keeps milliseconds (JavaScript's Date) hands back created_at cut.
    ids, token, lo, hi = claimed(conn, 2)
    conn.execute("UPDATE outbox SET created_at = date_trunc('millisecond', created_at) + interval '999 microseconds'")
    lo = lo.replace(microsecond=lo.microsecond // 1000 * 1000)
    (cut,) = conn.execute("SELECT date_trunc('millisecond', max(created_at)) FROM outbox").fetchone()  # type: ignore[misc]
    assert complete(conn, ids, token, lo, cut) == 2
