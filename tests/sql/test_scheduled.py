"""Scheduled delivery (deliver_at) and outbox_cancel (migrations/0021_outbox_deliver_at.sql), from
plain SQL and from the Python helpers, against a real PostgreSQL (and a real worker)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from helpers import claim_ids
from roles import denied
from workers import start, wait_until

from outboxpg import Event, enqueue, enqueue_many
from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import FunctionPublisher


def insert(conn: psycopg.Connection[Any], agg: str, deliver_at: str | None = None) -> int:
    row = conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, deliver_at) "
                       "VALUES ('order', %s, 'created', '{}', now() + %s::interval) RETURNING id",
                       (agg, deliver_at)).fetchone()
    assert row is not None
    return int(row[0])


def claim_until(conn: psycopg.Connection[Any], want: int, timeout: float) -> tuple[list[int], float]:
    """Claim every 20 ms until a claim hands out something; (its ids, seconds waited)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = claim_ids(conn)
        if got:
            return got, time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"nothing claimable within {timeout}s (wanted {want} events)")


def test_a_scheduled_event_waits_for_its_time_and_its_aggregate_waits_behind_it(conn):
    scheduled = insert(conn, "7", "1.5 seconds")
    behind = insert(conn, "7")                    # due now, but order beats time
    other = insert(conn, "8")
    assert claim_ids(conn) == [other]
    assert claim_ids(conn) == []
    # the claim that saw it made its head ready at deliver_at: an idle worker sleeps until then
    wake, deliver_at = conn.execute(
        "SELECT outbox_next_wakeup(), deliver_at FROM outbox WHERE id = %s", (scheduled,)).fetchone()
    assert wake == deliver_at
    got, waited = claim_until(conn, 2, 5)
    assert got == [scheduled, behind]             # one run, in id order
    assert waited > 1.0


def test_deliver_at_in_the_past_or_null_is_due_at_once(conn):
    past = insert(conn, "1", "-1 hour")
    now = insert(conn, "2", None)
    assert claim_ids(conn) == [past, now]
    assert conn.execute("SELECT deliver_at IS NULL FROM outbox WHERE id = %s", (now,)).fetchone() == (True,)


def test_a_scheduled_event_in_the_middle_of_a_line_ends_the_run_before_it(conn):
    first = insert(conn, "7")
    insert(conn, "7", "1 hour")
    insert(conn, "7")
    assert claim_ids(conn) == [first]


def test_python_helpers_take_deliver_at_and_refuse_a_naive_datetime(conn):
    later = datetime.now(UTC) + timedelta(hours=1)
    a = enqueue(conn, "order", "1", "created", {}, deliver_at=later)
    enqueue_many(conn, [Event("order", "2", "created", {}, deliver_at=later), Event("order", "3", "created", {})])
    rows = conn.execute("SELECT aggregate_id, deliver_at, next_attempt_at FROM outbox ORDER BY id").fetchall()
    assert rows[0][0] == "1" and rows[0][1] == later and rows[0][2] == later
    assert rows[1][1] == later and rows[2][1] is None
    assert [r[0] for r in conn.execute("SELECT id FROM outbox_claim(10)").fetchall()] == [a + 2]
    with pytest.raises(TypeError, match="timezone-aware"):
        enqueue(conn, "order", "4", "created", {}, deliver_at=datetime.now())   # noqa: DTZ005 (the point)
    with pytest.raises(TypeError, match="timezone-aware"):
        enqueue_many(conn, [Event("order", "4", "created", {}, deliver_at="tomorrow")])  # type: ignore[arg-type]


def test_a_scheduled_event_in_an_old_partition_survives_maintenance(conn):
    """Partitions go by created_at: an event scheduled past retention keeps its partition, which
    outbox_maintain never drops while the event is unfinished."""
    conn.execute("UPDATE outbox_settings SET retention = '0 seconds'")
    conn.execute("SELECT outbox_maintain()")
    scheduled = insert(conn, "7", "1.2 seconds")
    partition = conn.execute("SELECT tableoid::regclass::text FROM outbox WHERE id = %s", (scheduled,)).fetchone()[0]
    conn.execute("SELECT outbox_maintain()")
    conn.execute("SELECT outbox_maintain(true)")
    assert conn.execute("SELECT to_regclass(%s) IS NOT NULL", (partition,)).fetchone() == (True,)
    got, _ = claim_until(conn, 1, 5)
    assert got == [scheduled]


def test_cancel_takes_pending_and_scheduled_events_out_and_releases_the_aggregate(conn):
    scheduled = insert(conn, "7", "1 hour")
    behind = insert(conn, "7")
    assert claim_ids(conn) == []
    assert conn.execute("SELECT outbox_cancel(ARRAY[%s, 999999]::bigint[])", (scheduled,)).fetchone() == (1,)
    assert conn.execute("SELECT state::text, discard_reason FROM outbox WHERE id = %s",
                        (scheduled,)).fetchone() == ("discarded", "cancelled")
    assert claim_ids(conn) == [behind]            # the next event of its aggregate, at once
    assert conn.execute("SELECT outbox_cancel('{}'::bigint[])").fetchone() == (0,)
    with pytest.raises(psycopg.errors.NullValueNotAllowed, match="ids must not be NULL"):
        conn.execute("SELECT outbox_cancel(NULL)")


def test_cancel_leaves_a_claimed_event_alone_and_its_report_stands(conn):
    i = insert(conn, "7")
    token = conn.execute("SELECT lease_token FROM outbox_claim(10)").fetchone()[0]
    assert conn.execute("SELECT outbox_cancel(ARRAY[%s]::bigint[])", (i,)).fetchone() == (0,)
    assert conn.execute("SELECT outbox_complete(ARRAY[%s]::bigint[], %s)", (i, token)).fetchone() == (1,)


def test_cancel_racing_claims_each_event_is_either_claimed_or_cancelled(dsn, conn):
    """A claim and a cancel of one event are ordered by its row lock: never both."""
    ids = [insert(conn, str(i % 50)) for i in range(400)]
    claimed: list[int] = []
    cancelled = 0

    def claimer() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            for _ in range(40):
                for i, token in c.execute("SELECT id, lease_token FROM outbox_claim(20)").fetchall():
                    claimed.append(i)
                    assert c.execute("SELECT outbox_complete(ARRAY[%s]::bigint[], %s)", (i, token)).fetchone() == (1,)

    def canceller() -> None:
        nonlocal cancelled
        with psycopg.connect(dsn, autocommit=True) as c:
            for chunk in range(0, len(ids), 10):
                cancelled += c.execute("SELECT outbox_cancel(%s::bigint[])", (ids[chunk:chunk + 10],)).fetchone()[0]

    threads = [threading.Thread(target=claimer), threading.Thread(target=claimer), threading.Thread(target=canceller)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    states = dict(conn.execute("SELECT state::text, count(*) FROM outbox GROUP BY 1").fetchall())
    assert states.get("discarded", 0) == cancelled
    assert set(claimed).isdisjoint(
        r[0] for r in conn.execute("SELECT id FROM outbox WHERE state = 'discarded'").fetchall())
    assert states.get("published", 0) == len(claimed) == len(set(claimed))
    assert cancelled + len(claimed) + states.get("pending", 0) == len(ids)


def test_producers_schedule_and_cancel_workers_may_not_cancel(logins):
    with logins["producer"].connect() as p:
        (i,) = p.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, deliver_at) "
                         "VALUES ('order', '1', 'created', '{}', now() + interval '1 hour') RETURNING id").fetchone()
        p.commit()
        assert p.execute("SELECT outbox_cancel(ARRAY[%s]::bigint[])", (i,)).fetchone() == (1,)
        p.commit()
    with logins["worker"].connect() as w:
        denied(w, f"SELECT outbox_cancel(ARRAY[{i}]::bigint[])")
    with logins["operator"].connect() as o:
        assert o.execute("SELECT deliver_at IS NOT NULL FROM outbox WHERE id = %s", (i,)).fetchone() == (True,)


async def test_an_idle_worker_publishes_a_scheduled_event_at_its_time_without_polling(dsn, conn):
    published: dict[str, float] = {}

    async def publish(event: OutboxEvent) -> None:
        published[event.aggregate_id] = time.monotonic()

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    t0 = time.monotonic()
    enqueue(conn, "order", "later", "created", {}, deliver_at=datetime.now(UTC) + timedelta(seconds=1.5))
    enqueue(conn, "order", "now", "created", {})

    async def both() -> bool:
        return len(published) == 2

    await wait_until(both, 10, "both events published")
    await running.stop()
    assert published["now"] - t0 < 1.0
    assert 1.4 <= published["later"] - t0 < 4.0     # at its time, not at the 120 s poll
