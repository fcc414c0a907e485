"""Commit order: an event is never handed out while an open transaction may still commit an
earlier event (migrations/0013_outbox_commit_order.sql)."""

from __future__ import annotations

import asyncio
import time

import psycopg

from outboxpg import enqueue, enqueue_many, Event
from outboxpg.events import OutboxEvent
from outboxpg.publishers import FunctionPublisher
from test_worker import start, wait_until


def claim_ids(conn: psycopg.Connection) -> list[int]:
    return [r[0] for r in conn.execute("SELECT id FROM outbox_claim(100)").fetchall()]


def test_lower_id_committing_last_is_still_delivered_first(dsn, conn):
    with psycopg.connect(dsn) as slow:                       # a long business transaction
        first = enqueue(slow, "order", "7", "created", {})   # id 1, not committed yet
        second = enqueue(conn, "order", "7", "paid", {})     # id 2, committed (autocommit)
        other = enqueue(conn, "order", "8", "created", {})   # another aggregate, committed
        assert first < second < other
        # Nothing above the open transaction's horizon is handed out, of any aggregate.
        assert claim_ids(conn) == []
        slow.commit()
    assert claim_ids(conn) == [first, other]                 # second waits behind first
    conn.execute("SELECT outbox_complete(ARRAY[%s, %s]::bigint[], lease_token) FROM outbox WHERE id = %s",
                 (first, other, first))
    assert claim_ids(conn) == [second]


def test_rolled_back_transaction_releases_the_horizon(dsn, conn):
    with psycopg.connect(dsn) as slow:
        enqueue(slow, "order", "7", "created", {})
        later = enqueue(conn, "order", "7", "paid", {})
        assert claim_ids(conn) == []
        slow.rollback()
    assert claim_ids(conn) == [later]


def test_horizon_is_read_from_the_statement_start_of_each_insert(dsn, conn):
    """Each statement marks the sequence value it started from; a later statement of the same
    transaction does not move the transaction's horizon forward."""
    with psycopg.connect(dsn) as slow:
        enqueue(slow, "order", "slow", "a", {})
        enqueue_many(conn, [Event("order", str(i), "x", {}) for i in range(5)])   # ids 2..6
        enqueue(slow, "order", "slow", "b", {})                                    # id 7
        horizon = conn.execute("SELECT outbox_commit_horizon()").fetchone()[0]
        assert horizon == 0  # the slow transaction's first statement started at last_value 0
        slow.commit()
    # No producer open: the horizon is the last id assigned.
    assert conn.execute("SELECT outbox_commit_horizon()").fetchone()[0] == 7
    assert len(claim_ids(conn)) == 6  # one per aggregate: slow/a and the five others


def test_producer_starting_after_the_horizon_is_read_cannot_precede_what_is_handed_out(dsn, conn):
    """The race the order of outbox_commit_horizon's steps closes: a producer that starts
    inserting after the horizon was read takes ids above it."""
    visible = enqueue(conn, "order", "7", "created", {})
    horizon = conn.execute("SELECT outbox_commit_horizon()").fetchone()[0]
    assert horizon == visible
    with psycopg.connect(dsn) as late:
        later = enqueue(late, "order", "7", "paid", {})
        assert later > horizon
        # A claim now sees only `visible` below its horizon; `later` is above any horizon while
        # its transaction is open.
        assert conn.execute("SELECT outbox_commit_horizon()").fetchone()[0] < later
        late.commit()


def test_guard_can_be_switched_off(dsn, conn):
    conn.execute("UPDATE outbox_settings SET commit_order_guard = false")
    with psycopg.connect(dsn) as slow:
        enqueue(slow, "order", "7", "created", {})
        later = enqueue(conn, "order", "7", "paid", {})
        assert claim_ids(conn) == [later]   # no guard: id order among what is visible only
        slow.rollback()


async def test_worker_delivers_in_commit_safe_order_when_the_lower_id_commits_last(dsn, conn):
    seen: list[int] = []

    async def publish(event: OutboxEvent) -> None:
        seen.append(event.id)

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    slow = await psycopg.AsyncConnection.connect(dsn)
    first = await enqueue(slow, "order", "7", "created", {})
    second = enqueue(conn, "order", "7", "paid", {})
    await asyncio.sleep(0.5)
    assert seen == []                       # held back: the open transaction may precede it
    t0 = time.monotonic()
    await slow.commit()
    await slow.close()

    async def both() -> bool:
        return len(seen) == 2
    await wait_until(both, 3, "both events delivered after the commit")
    await running.stop()
    assert seen == [first, second]
    assert time.monotonic() - t0 < 3
