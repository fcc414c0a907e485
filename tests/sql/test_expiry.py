"""Events that expire (migrations/0024_outbox_expires_at.sql): discarded with reason 'expired'
instead of being handed out late, from plain SQL and the Python helpers."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from workers import start, wait_until

from outboxpg import Event, enqueue, enqueue_many
from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import FunctionPublisher


def insert(conn: psycopg.Connection[Any], agg: str, expires: str | None = None, deliver: str | None = None) -> int:
    row = conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, expires_at, deliver_at) "
                       "VALUES ('order', %s, 'created', '{}', now() + %s::interval, now() + %s::interval) RETURNING id",
                       (agg, expires, deliver)).fetchone()
    return int(row[0])


def claim(conn: psycopg.Connection[Any], n: int = 100) -> list[tuple[int, Any]]:
    return conn.execute("SELECT id, lease_token FROM outbox_claim(%s)", (n,)).fetchall()


def state(conn: psycopg.Connection[Any], i: int) -> tuple[str, str | None]:
    return conn.execute("SELECT state::text, discard_reason FROM outbox WHERE id = %s", (i,)).fetchone()


def test_an_expired_head_is_discarded_and_the_next_event_goes_in_the_same_claim(conn):
    gone = insert(conn, "7", "-1 second")
    after = insert(conn, "7")
    fresh = insert(conn, "8", "1 hour")
    assert [i for i, _ in claim(conn)] == [after, fresh]
    assert state(conn, gone) == ("discarded", "expired")


def test_a_run_stops_before_an_expired_event_which_goes_when_it_is_the_head(conn):
    first = insert(conn, "7")
    lapsed = insert(conn, "7", "-1 second")
    last = insert(conn, "7")
    rows = claim(conn)
    assert [i for i, _ in rows] == [first]
    conn.execute("SELECT outbox_complete(ARRAY[%s]::bigint[], %s)", (first, rows[0][1]))
    assert [i for i, _ in claim(conn)] == [last]
    assert state(conn, lapsed) == ("discarded", "expired")


def test_a_retrying_event_that_expires_is_not_tried_again(conn):
    conn.execute("UPDATE outbox_settings SET backoff_base = '300 milliseconds', backoff_cap = '300 milliseconds'")
    i = insert(conn, "7", "200 milliseconds")
    (_, token), = claim(conn)
    conn.execute("SELECT outbox_fail(%s, %s, 'broker down')", (i, token))
    time.sleep(0.5)                                        # due again, and past its expiry
    assert claim(conn) == []
    assert state(conn, i) == ("discarded", "expired")


def test_a_scheduled_event_that_expires_before_its_time_is_never_handed_out(conn):
    i = insert(conn, "7", expires="200 milliseconds", deliver="400 milliseconds")
    assert claim(conn) == []
    time.sleep(0.5)
    assert claim(conn) == []
    assert state(conn, i) == ("discarded", "expired")


def test_an_event_handed_out_before_its_expiry_is_left_alone(conn):
    i = insert(conn, "7", "300 milliseconds")
    (_, token), = claim(conn)
    time.sleep(0.4)
    assert conn.execute("SELECT outbox_complete(ARRAY[%s]::bigint[], %s)", (i, token)).fetchone() == (1,)
    assert state(conn, i) == ("published", None)


def test_python_helpers_take_expires_at(conn):
    past = datetime.now(UTC) - timedelta(seconds=1)
    a = enqueue(conn, "order", "1", "created", {}, expires_at=past)
    enqueue_many(conn, [Event("order", "2", "created", {}, expires_at=past), Event("order", "3", "created", {})])
    assert [i for i, _ in claim(conn)] == [a + 2]
    assert state(conn, a) == ("discarded", "expired")
    with pytest.raises(TypeError, match="expires_at must be a timezone-aware datetime"):
        enqueue(conn, "order", "4", "created", {}, expires_at=datetime.now())  # noqa: DTZ005 (the point)


def test_a_producer_login_may_set_expires_at(logins):
    with logins["producer"].connect() as p:
        p.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, expires_at) "
                  "VALUES ('order', '1', 'created', '{}', now() + interval '1 hour')")
    with logins["operator"].connect() as o:
        assert o.execute("SELECT count(*) FROM outbox WHERE expires_at IS NOT NULL").fetchone() == (1,)


async def test_the_worker_never_publishes_an_event_past_its_expiry(dsn, conn):
    published: list[str] = []

    async def publish(event: OutboxEvent) -> None:
        published.append(event.aggregate_id)

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    soon = datetime.now(UTC)
    enqueue(conn, "order", "late", "created", {}, deliver_at=soon + timedelta(seconds=1.0),
            expires_at=soon + timedelta(seconds=0.5))
    enqueue(conn, "order", "late", "paid", {}, deliver_at=soon + timedelta(seconds=1.0))
    enqueue(conn, "order", "ok", "created", {}, expires_at=soon + timedelta(seconds=30))

    async def done() -> bool:
        return len(published) == 2

    await wait_until(done, 10, "the two live events published")
    await running.stop()
    assert sorted(published) == ["late", "ok"]
    assert conn.execute("SELECT event_type, state::text, discard_reason FROM outbox WHERE aggregate_id = 'late' "
                        "ORDER BY id").fetchall() == [("created", "discarded", "expired"), ("paid", "published", None)]
