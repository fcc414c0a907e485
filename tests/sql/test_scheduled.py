"""Scheduled delivery (deliver_at) and outbox_cancel (migrations/0021_outbox_deliver_at.sql), from
plain SQL and from the Python helpers, against a real PostgreSQL (and a real worker)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from commands import run_all
from helpers import aggregate_of_shard, claim, claim_ids, complete, fail, make_due
from roles import denied
from workers import event, start, wait_until

from outboxpg import Event, enqueue, enqueue_many
from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import FunctionPublisher
from outboxpg.relay.stats import Recorder


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



def test_the_next_wakeup_of_a_shard_is_of_its_own_aggregates(conn):
    """A worker of shard 1/2 sleeps until its own aggregates' next time, not another shard's."""
    conn.execute("SELECT outbox_shards_enable()")
    agg = {shard: aggregate_of_shard(conn, shard) for shard in ("0/2", "1/2")}
    soon = insert(conn, agg["0/2"], "10 minutes")
    later = insert(conn, agg["1/2"], "20 minutes")
    assert claim_ids(conn) == []                  # the claim makes their heads, ready at deliver_at
    at = dict(conn.execute("SELECT id, deliver_at FROM outbox").fetchall())
    assert conn.execute("SELECT outbox_next_wakeup(), outbox_next_wakeup(NULL), outbox_next_wakeup('0/2'), "
                        "outbox_next_wakeup('1/2')").fetchone() == (at[soon], at[soon], at[soon], at[later])
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="shard must be I/N"):
        conn.execute("SELECT outbox_next_wakeup('2/2')")


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


# -- scheduled events are neither failures nor lag ----------------------------------------------

def test_a_scheduled_event_is_counted_scheduled_not_waiting_for_a_retry(dsn, conn):
    """An event whose deliver_at is ahead and that was never tried is 'scheduled' in outbox_stats,
    outbox_health and `outboxpg status`; waiting_retry keeps meaning failed and waiting."""
    # The retry waits a minute, not the default second: the two `outboxpg status` runs below
    # take longer than a second on a busy machine.
    conn.execute("UPDATE outbox_settings SET backoff_base = '1 minute'")
    scheduled = insert(conn, "7", "1 hour")
    failing = insert(conn, "8")
    insert(conn, "9", "-1 minute")                # due already: neither
    (row, due) = claim(conn, 10)
    assert row["id"] == failing
    assert fail(conn, failing, row["lease_token"]) == "pending"
    complete(conn, [due["id"]], due["lease_token"])
    stats = conn.execute("SELECT pending, scheduled, waiting_retry FROM outbox_stats").fetchone()
    assert stats == (2, 1, 1)
    health = conn.execute("SELECT pending, scheduled, waiting_retry FROM outbox_health").fetchone()
    assert health == (2, 1, 1)

    js, text = run_all(("status", "--dsn", dsn, "--json"), ("status", "--dsn", dsn))
    h = js.json()["health"]
    assert (h["pending"], h["scheduled"], h["waiting_retry"]) == (2, 1, 1)
    assert text.code == 0, text
    assert "(pending 2, of which scheduled 1, waiting for a retry 1; processing 0)" in text.out, text.out
    # Due, it is neither: it waits for a worker like any other event.
    conn.execute("UPDATE outbox SET next_attempt_at = now() - interval '1 second' WHERE id = %s", (scheduled,))
    assert conn.execute("SELECT scheduled, waiting_retry FROM outbox_stats").fetchone() == (0, 1)


def test_the_claim_says_when_an_event_was_due(conn):
    """outbox_claim's due_at: when the event was first due (its deliver_at, or its creation when
    that came later), which the worker's lag counts from."""
    later = insert(conn, "7", "1.2 seconds")
    past = insert(conn, "8", "-1 hour")
    now = insert(conn, "9")
    created = dict(conn.execute("SELECT id, created_at FROM outbox").fetchall())
    deliver_at = conn.execute("SELECT deliver_at FROM outbox WHERE id = %s", (later,)).fetchone()[0]
    rows = {r["id"]: r for r in claim(conn, 10)}
    assert rows[past]["due_at"] == created[past] and rows[now]["due_at"] == created[now]
    got, _ = claim_until(conn, 1, 5)
    assert got == [later]
    fail(conn, later, conn.execute("SELECT lease_token FROM outbox WHERE id = %s", (later,)).fetchone()[0])
    make_due(conn, [later])
    (again,) = claim(conn, 10)                      # a retry: still due since deliver_at
    assert again["id"] == later and again["due_at"] == deliver_at


def test_worker_lag_counts_from_when_the_event_was_due():
    """An event due in 20 s and delivered 10 ms after is 10 ms of lag, not 20,010 (lag_max_ms)."""
    created = datetime.now(UTC)
    due = created + timedelta(seconds=20)
    scheduled = replace(event(1, "x", created_at=created), due_at=due)
    plain = event(2, "x", created_at=due)           # an OutboxEvent made without due_at: created_at
    recorder = Recorder("w", 60.0, None)
    acked = due + timedelta(milliseconds=10)
    recorder.reported([scheduled, plain], acked, [scheduled, plain], 2, [], [], 0, 0)
    assert abs(recorder.stats.lag_max - 0.010) < 1e-6
    assert abs(recorder.stats.lag_sum - 0.020) < 1e-6


def test_a_scheduled_event_has_no_age_until_it_is_due(conn):
    """oldest_pending_age (outbox_stats, outbox_health, the worker's gauge) counts from when an
    event is due: an event scheduled an hour ahead is not an hour-old backlog, nor is one due a
    minute ago an event of creation age."""
    conn.execute("BEGIN")   # one now() for the inserts and the reads
    insert(conn, "7", "1 hour")
    for view in ("outbox_stats", "outbox_health"):
        assert conn.execute(f"SELECT oldest_pending_age FROM {view}").fetchone() == (None,), view
    conn.execute("UPDATE outbox SET created_at = now() - interval '2 hours', "
                 "deliver_at = now() - interval '1 minute', next_attempt_at = now() - interval '1 minute'")
    for view in ("outbox_stats", "outbox_health"):
        assert conn.execute(f"SELECT oldest_pending_age FROM {view}").fetchone() == (timedelta(minutes=1),), view
    conn.execute("ROLLBACK")
