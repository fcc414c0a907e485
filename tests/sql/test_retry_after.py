"""outbox_fail's retry_after: a destination's "come back in N seconds" (HTTP Retry-After) is
waited for when it is longer than the backoff, up to backoff_cap; from SQL and from a worker
whose publisher fails with a ``retry_after`` attribute."""

from __future__ import annotations

from typing import Any

import psycopg
from workers import count_in, equals, start, wait_until

from outboxpg import enqueue
from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import FunctionPublisher

Conn = psycopg.Connection[Any]


def fail_one(conn: Conn, retry_after: str | None) -> float:
    """Enqueue, claim and fail one event; the seconds until its next attempt."""
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "VALUES ('order', gen_random_uuid()::text, 'created', '{}')")
    event_id, token = conn.execute("SELECT id, lease_token FROM outbox_claim(1)").fetchone()
    assert conn.execute("SELECT outbox_fail(%s, %s, 'busy', false, %s::interval)",
                        (event_id, token, retry_after)).fetchone() == ("pending",)
    return float(conn.execute("SELECT extract(epoch FROM next_attempt_at - clock_timestamp()) FROM outbox "
                              "WHERE id = %s", (event_id,)).fetchone()[0])


def test_a_longer_wait_asked_is_kept_up_to_the_backoff_cap(conn: Conn) -> None:
    conn.execute("UPDATE outbox_settings SET backoff_base = '1 second', backoff_cap = '5 minutes'")
    assert fail_one(conn, None) < 2                         # the backoff: 0.5-1 s for a first attempt
    assert 119 < fail_one(conn, "2 minutes") <= 120          # asked for longer: waited
    assert fail_one(conn, "10 milliseconds") < 2             # asked for less than the backoff: the backoff
    assert 299 < fail_one(conn, "1 day") <= 300              # never past backoff_cap
    assert fail_one(conn, "-1 hour") < 2                     # a negative wait is no wait


def test_the_old_four_argument_call_still_works(conn: Conn) -> None:
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "VALUES ('order', '1', 'created', '{}')")
    event_id, token = conn.execute("SELECT id, lease_token FROM outbox_claim(1)").fetchone()
    assert conn.execute("SELECT outbox_fail(%s, %s, 'no ack', false)", (event_id, token)).fetchone() == ("pending",)


class Busy(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"busy, come back in {seconds:g}s")
        self.retry_after = seconds


async def test_a_worker_passes_the_wait_a_publisher_was_told(dsn: str, conn: Conn) -> None:
    conn.execute("UPDATE outbox_settings SET backoff_base = '10 milliseconds', backoff_cap = '10 minutes'")
    conn.commit()
    told = enqueue(conn, "order", "told", "created", {})
    plain = enqueue(conn, "order", "plain", "created", {})
    conn.commit()

    async def publish(event: OutboxEvent) -> None:
        raise Busy(90) if event.id == told else RuntimeError("down")

    running = start(dsn, FunctionPublisher(publish))
    await wait_until(lambda: equals(count_in(dsn, "pending"), 2), 30, "both failed once")
    await wait_until(lambda: _attempted(dsn, plain, 2), 30, "the plain failure retried after its backoff")
    await running.stop()
    told_attempts, wait = conn.execute(
        "SELECT attempts, extract(epoch FROM next_attempt_at - last_attempt) FROM ("
        " SELECT attempts, next_attempt_at, coalesce(claimed_at, created_at) AS last_attempt FROM outbox"
        " WHERE id = %s) o", (told,)).fetchone()
    assert told_attempts == 1                                # not tried again while it was told to wait
    assert 89 < float(wait) <= 91


async def _attempted(dsn: str, event_id: int, n: int) -> bool:
    from workers import scalar
    return int(await scalar(dsn, "SELECT attempts FROM outbox WHERE id = %s", (event_id,))) >= n
