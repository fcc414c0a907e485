"""The worker against a real PostgreSQL and a real nats-server (issue: outboxpg-worker)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from helpers import PLANS_KEPT
from jetstream import make_stream, read_stream
from locks import WAKEUP_LOCK
from workers import all_in, count_in, equals, fleet_idle, queued_for_wakeup_lock, start, wait_until

from outboxpg import Event, enqueue, enqueue_many
from outboxpg.events import OutboxEvent
from outboxpg.relay.gateway import Gateway
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.publishers import FunctionPublisher
from outboxpg.relay.worker import LOOK_AGAIN_MOST, WorkerConfig


async def test_three_workers_deliver_every_event_once_in_aggregate_order(dsn, conn, nats_server, fast_retries):
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    workers = [start(dsn, NatsPublisher(nats_server.url), batch_size=50, concurrency=3, name=f"w{i}")
               for i in range(3)]
    # 10,000 events of 200 aggregates, written in 20 business transactions while the workers run.
    async with await psycopg.AsyncConnection.connect(dsn) as producer:
        for chunk in range(20):
            async with producer.transaction():
                await enqueue_many(producer, [Event("order", str(i % 200), "updated", {"i": i})
                                              for i in range(chunk * 500, chunk * 500 + 500)])
    await wait_until(lambda: equals(count_in(dsn, "published"), 10_000), 120, "10,000 events published")
    for w in workers:
        await w.stop()
    assert sum(w.worker.stats.delivered for w in workers) == 10_000

    msgs = await read_stream(stream)
    await stream.nc.close()
    rows = conn.execute("SELECT id, msg_id, aggregate_type || '/' || aggregate_id FROM outbox").fetchall()
    assert len(msgs) == 10_000
    assert len({m.msg_id for m in msgs}) == 10_000
    assert {(m.outbox_id, m.msg_id, m.aggregate) for m in msgs} == set(rows)
    per_aggregate: dict[str, list[int]] = defaultdict(list)
    for m in msgs:  # stream order
        per_aggregate[m.aggregate].append(m.outbox_id)
    assert len(per_aggregate) == 200
    for aggregate, ids in per_aggregate.items():
        assert ids == sorted(ids), f"{aggregate} delivered out of id order"


async def test_failing_publisher_dead_letters_after_max_attempts_and_others_flow(dsn, conn, fast_retries):
    conn.execute("UPDATE outbox_settings SET max_attempts = 3")
    delivered: list[int] = []

    async def publish(event: OutboxEvent) -> None:
        if event.aggregate_id == "bad":
            raise RuntimeError("downstream says no")
        delivered.append(event.id)

    bad_first = enqueue(conn, "order", "bad", "created", {})
    bad_second = enqueue(conn, "order", "bad", "paid", {})
    good = [enqueue(conn, "order", f"good{i % 10}", "created", {"i": i}) for i in range(50)]
    running = start(dsn, FunctionPublisher(publish), batch_size=20)
    await wait_until(lambda: equals(count_in(dsn, "published"), 50), 30, "good events published")
    await wait_until(lambda: equals(count_in(dsn, "dead"), 1), 30, "bad event dead")
    await running.stop()

    state, attempts, error = conn.execute(
        "SELECT state, attempts, last_error FROM outbox WHERE id = %s", (bad_first,)).fetchone()
    assert (state, attempts) == ("dead", 3)
    assert "downstream says no" in error
    # Its aggregate's later event waits behind it; it was never handed out.
    assert conn.execute("SELECT state, attempts FROM outbox WHERE id = %s", (bad_second,)).fetchone() == ("pending", 0)
    assert sorted(delivered) == sorted(good)
    assert running.worker.stats.dead == 1


async def test_oversize_payload_is_dead_lettered_at_once(dsn, conn, nats_server, fast_retries):
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    # Over max_event_bytes' default too: written with the limit raised (or before there was one),
    # it must still die at once at the worker.
    conn.execute("UPDATE outbox_settings SET max_event_bytes = 2000000")
    huge = enqueue(conn, "blob", "1", "uploaded", {"blob": "x" * 1_200_000})
    after = enqueue(conn, "blob", "1", "tagged", {})
    other = enqueue(conn, "blob", "2", "uploaded", {"blob": "small"})
    running = start(dsn, NatsPublisher(nats_server.url))
    await wait_until(lambda: equals(count_in(dsn, "dead"), 1), 20, "oversize event dead")
    await wait_until(lambda: equals(count_in(dsn, "published"), 1), 20, "the other aggregate's event published")
    await running.stop()
    state, attempts, error = conn.execute(
        "SELECT state, attempts, last_error FROM outbox WHERE id = %s", (huge,)).fetchone()
    assert (state, attempts) == ("dead", 1)
    assert "max_payload" in error
    assert conn.execute("SELECT state FROM outbox WHERE id = %s", (after,)).fetchone() == ("pending",)
    assert conn.execute("SELECT state FROM outbox WHERE id = %s", (other,)).fetchone() == ("published",)
    msgs = await read_stream(stream)
    await stream.nc.close()
    assert [m.outbox_id for m in msgs] == [other]


async def test_listen_connection_killed_worker_reconnects_and_delivers_within_2s(dsn, conn):
    seen: dict[int, float] = {}

    async def publish(event: OutboxEvent) -> None:
        seen[event.id] = time.monotonic()

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    killed = conn.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND query = 'LISTEN outbox'").fetchone()[0]
    assert killed == 1
    t0 = time.monotonic()
    event_id = enqueue(conn, "order", "1", "created", {})
    await wait_until(lambda: _has(seen, event_id), 2.0, "event delivered after LISTEN backend was killed")
    await wait_until(running.idle, 5, "worker idle again")
    assert running.worker.listener.reconnects == 1
    # And the wakeup path works again: a new event arrives without any poll.
    t1 = time.monotonic()
    second = enqueue(conn, "order", "2", "created", {})
    await wait_until(lambda: _has(seen, second), 2.0, "event delivered by notification")
    await running.stop()
    assert seen[event_id] - t0 < 2.0 and seen[second] - t1 < 2.0


async def test_idle_lock_connection_killed_worker_retakes_it(dsn, conn):
    seen: dict[int, float] = {}

    async def publish(event: OutboxEvent) -> None:
        seen[event.id] = time.monotonic()

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    holder = "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s AND granted"
    old_pid = conn.execute(holder, WAKEUP_LOCK).fetchone()[0]
    conn.execute("SELECT pg_terminate_backend(%s)", (old_pid,))

    async def retaken() -> bool:
        row = conn.execute(holder, WAKEUP_LOCK).fetchone()
        return row is not None and row[0] != old_pid
    await wait_until(retaken, 5, "wakeup lock taken again on a new connection")
    event_id = enqueue(conn, "order", "1", "created", {})
    await wait_until(lambda: _has(seen, event_id), 2.0, "event delivered by notification")
    await running.stop()


async def _has(d: dict[int, float], key: int) -> bool:
    return key in d


async def test_idle_worker_does_not_poll_busily_and_is_woken_by_notify(dsn, conn):
    seen: dict[int, float] = {}

    async def publish(event: OutboxEvent) -> None:
        seen[event.id] = time.monotonic()

    running = start(dsn, FunctionPublisher(publish), poll_interval=1.0)
    await wait_until(running.idle, 10, "worker idle")
    claims_before = running.worker.stats.claims
    await asyncio.sleep(3.2)
    idle_claims = running.worker.stats.claims - claims_before
    # One claim per fallback poll (1 s here), nothing in between.
    assert 2 <= idle_claims <= 5, idle_claims
    t0 = time.monotonic()
    event_id = enqueue(conn, "order", "1", "created", {})
    await wait_until(lambda: _has(seen, event_id), 1.0, "event delivered", interval=0.005)
    await running.stop()
    assert seen[event_id] - t0 < 0.5, "woken by NOTIFY, not by the 1 s poll"


async def test_retry_wakes_worker_at_its_due_time_not_at_the_poll(dsn, conn):
    conn.execute("UPDATE outbox_settings SET backoff_base = '300 milliseconds', backoff_cap = '300 milliseconds'")
    attempts: list[float] = []

    async def publish(event: OutboxEvent) -> None:
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise RuntimeError("first attempt fails")

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    enqueue(conn, "order", "1", "created", {})
    await wait_until(lambda: equals(count_in(dsn, "published"), 1), 5, "event published on its retry")
    await running.stop()
    assert len(attempts) == 2
    assert 0.1 <= attempts[1] - attempts[0] < 2.0  # the 150-300 ms backoff, not the 120 s poll


async def test_poll_only_mode_uses_no_listen_and_no_lock(dsn, conn):
    seen: list[int] = []

    async def publish(event: OutboxEvent) -> None:
        seen.append(event.id)

    running = start(dsn, FunctionPublisher(publish), poll_only=True, poll_interval=0.3)
    await asyncio.sleep(0.5)
    event_id = enqueue(conn, "order", "1", "created", {})
    await wait_until(lambda: equals(count_in(dsn, "published"), 1), 5, "event published by polling")
    listening = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                             "AND query = 'LISTEN outbox'").fetchone()[0]

    async def advisory_locks() -> int:
        return int(conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0])

    # None between claims: a claim holds advisory locks of its own while its transaction runs
    # (a reading taken then showed one), but nothing is kept from one transaction to the next.
    await wait_until(lambda: equals(advisory_locks, 0), 5, "no advisory lock held between claims")
    await running.stop()
    assert seen == [event_id]
    assert listening == 0


@pytest.mark.slow
async def test_nats_outage_of_10s_under_load_delivers_everything_without_busy_loop(dsn, conn, own_nats_server):
    conn.execute("UPDATE outbox_settings SET backoff_base = '200 milliseconds', backoff_cap = '2 seconds'")
    stream = await make_stream(own_nats_server.url)
    await stream.nc.close()
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    running = start(dsn, NatsPublisher(own_nats_server.url), batch_size=100, publish_timeout=0.5, lease=5)
    written = 0

    async def produce(seconds: float) -> None:
        nonlocal written
        async with await psycopg.AsyncConnection.connect(dsn) as producer:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                async with producer.transaction():
                    await enqueue_many(producer, [Event("order", str((written + i) % 50), "updated", {"n": written + i})
                                                  for i in range(20)])
                written += 20
                await asyncio.sleep(0.1)

    load = asyncio.create_task(produce(15))
    await asyncio.sleep(2)
    own_nats_server.stop()
    claims_at_stop = running.worker.stats.claims
    await asyncio.sleep(10)
    claims_during_outage = running.worker.stats.claims - claims_at_stop
    own_nats_server.start()
    await load
    await wait_until(lambda: equals(count_in(dsn, "published"), written), 60, f"all {written} events published")
    await running.stop()
    assert await count_in(dsn, "dead")() == 0
    assert running.worker.stats.failed > 0, "the outage was felt"
    # No spinning. With every batch out waiting for its acks, the worker looks again (and its
    # lane claims) at most every LOOK_AGAIN_MOST once its looks find nothing: about 200 claims in
    # the 10 s (198-202 seen). A loop that did not wait would claim thousands of times.
    assert claims_during_outage < 2 * 10 / LOOK_AGAIN_MOST, claims_during_outage
    stream = await make_stream_reader(own_nats_server.url, stream.name, stream.prefix)
    msgs = await read_stream(stream)
    await stream.nc.close()
    assert len({m.msg_id for m in msgs}) == written == len(msgs)


async def make_stream_reader(url: str, name: str, prefix: str) -> Any:
    import nats
    from jetstream import StreamHandle

    nc = await nats.connect(url)
    return StreamHandle(nc, nc.jetstream(), name, prefix)


def test_sync_function_publisher_works(dsn, conn):
    seen: list[int] = []

    def publish(event: OutboxEvent) -> None:
        seen.append(event.id)

    ids = [enqueue(conn, "order", str(i), "created", {"i": i}) for i in range(5)]

    async def main() -> None:
        running = start(dsn, publish)  # a bare function is wrapped in FunctionPublisher
        await wait_until(lambda: equals(count_in(dsn, "published"), 5), 10, "published")
        await running.stop()

    asyncio.run(main())
    assert sorted(seen) == ids


async def test_next_event_of_an_aggregate_follows_without_waiting_for_the_poll(dsn, conn):
    """Events of one aggregate go out one after another; each is claimable only once the
    previous one is reported, and no NOTIFY announces that: the worker must not sleep then."""
    seen: list[tuple[int, float]] = []

    async def publish(event: OutboxEvent) -> None:
        await asyncio.sleep(0.02)  # a slow broker: the report comes well after the next claim
        seen.append((event.id, time.monotonic()))

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    with conn.transaction():
        ids = [enqueue(conn, "order", "hot", "step", {"n": n}) for n in range(5)]
    t0 = time.monotonic()
    await wait_until(lambda: equals(count_in(dsn, "published"), 5), 10, "all five published")
    await running.stop()
    assert [i for i, _ in seen] == ids
    assert seen[-1][1] - t0 < 3.0, "each next event was claimed right after the previous report"


async def test_a_quiet_aggregate_is_not_held_back_by_a_batch_in_flight(dsn, conn):
    """A busy worker gets no NOTIFY, and after a short claim it waits for a batch in flight; it
    still claims again within tens of milliseconds, so an event of another aggregate committed
    while a slow batch is out is published long before that batch is reported."""
    slow_started = asyncio.Event()
    slow_may_end = asyncio.Event()
    seen: list[str] = []

    async def publish(event: OutboxEvent) -> None:
        if event.aggregate_id == "busy":
            slow_started.set()
            await slow_may_end.wait()
        seen.append(event.aggregate_id)

    running = start(dsn, FunctionPublisher(publish), poll_interval=120, publish_timeout=30, lease=90)
    await wait_until(running.idle, 10, "worker idle")
    enqueue(conn, "order", "busy", "step", {})
    await asyncio.wait_for(slow_started.wait(), 10)
    enqueue(conn, "order", "quiet", "created", {})
    async def quiet_seen() -> bool:
        return "quiet" in seen

    try:
        await wait_until(quiet_seen, 5, "the quiet aggregate's event published")
        assert seen == ["quiet"]                       # the busy batch is still in flight
    finally:
        slow_may_end.set()
    await wait_until(lambda: equals(count_in(dsn, "published"), 2), 10, "both published")
    await running.stop()


async def test_a_quiet_aggregate_goes_out_while_every_batch_is_held_by_busy_runs(dsn, conn):
    """Every one of the worker's batches is out with a busy aggregate's run that the publisher
    holds (a slow destination): the worker's lane still claims the quiet aggregates' events beside
    them (outbox_claim's quiet_only), and the quiet event is published before any of those
    batches is reported; the busy runs are not touched by the lane."""
    with conn.transaction():
        enqueue_many(conn, [Event("order", f"busy-{n % 3}", "step", {"n": n}) for n in range(150)])
    # Heads made, and marked as moved on many times: three busy aggregates, 50 events waiting each.
    rows = conn.execute("SELECT id, lease_token FROM outbox_claim(1)").fetchall()
    conn.execute("SELECT outbox_release(%s, %s)", ([r[0] for r in rows], rows[0][1]))
    conn.execute("UPDATE outbox_heads SET moves = 3")
    held = asyncio.Event()
    busy_out: set[str] = set()
    seen: list[str] = []

    async def publish(event: OutboxEvent) -> None:
        if event.aggregate_id.startswith("busy"):
            busy_out.add(event.aggregate_id)
            await held.wait()
        seen.append(event.aggregate_id)

    running = start(dsn, FunctionPublisher(publish), poll_interval=120, publish_timeout=30, lease=90,
                    concurrency=2, batch_size=40)

    async def both_batches_out() -> bool:
        return len(busy_out) == 2

    try:
        await wait_until(both_batches_out, 10, "two batches out, each with one busy aggregate's run")
        enqueue(conn, "order", "quiet", "created", {})

        async def quiet_seen() -> bool:
            return "quiet" in seen

        await wait_until(quiet_seen, 5, "the quiet aggregate's event published beside the held batches")
        assert seen == ["quiet"]
        assert len(busy_out) == 2                      # the lane took no busy run
    finally:
        held.set()
    await wait_until(lambda: equals(count_in(dsn, "published"), 151), 20, "everything published")
    await running.stop()


async def test_a_quiet_run_is_reported_without_waiting_for_a_long_run_beside_it(dsn, conn):
    """One batch holds a busy aggregate's long run, which the publisher holds, and a quiet
    aggregate's event: the quiet run is reported as soon as it is published, so the quiet
    aggregate's next event goes out while the long run is still held (its head would otherwise
    stay leased until the whole batch is reported)."""
    with conn.transaction():
        enqueue_many(conn, [Event("order", "busy", "step", {"n": n}) for n in range(40)])
        enqueue(conn, "order", "quiet", "created", {})
    held = asyncio.Event()
    seen: list[str] = []

    async def publish(event: OutboxEvent) -> None:
        if event.aggregate_id == "busy":
            await held.wait()
        seen.append(f"{event.aggregate_id}:{event.event_type}")

    running = start(dsn, FunctionPublisher(publish), poll_interval=120, publish_timeout=30, lease=90,
                    batch_size=50)
    try:
        async def first_seen() -> bool:
            return seen == ["quiet:created"]

        await wait_until(first_seen, 10, "the quiet event published, the busy run held")
        enqueue(conn, "order", "quiet", "updated", {})

        async def next_seen() -> bool:
            return "quiet:updated" in seen

        await wait_until(next_seen, 5, "the quiet aggregate's next event published beside the held run")
        assert seen == ["quiet:created", "quiet:updated"]
    finally:
        held.set()
    await wait_until(lambda: equals(count_in(dsn, "published"), 42), 20, "everything published")
    await running.stop()


async def test_a_burst_into_an_idle_fleet_is_drained_by_every_worker(dsn, conn):
    """Three idle workers, then one transaction of 6,000 events over 200 aggregates, and once
    they are idle again another. The notification wakes all three at once; the first claim takes
    the burst in, and the others' claims, which find its heads not yet committed (the second
    time, the heads the first drain parked at the front), wait for it instead of coming back
    empty: that sent those workers back to sleep until the 30 s poll, and one worker drained the
    burst alone."""
    delivered: dict[str, int] = defaultdict(int)

    def publisher(name: str) -> FunctionPublisher:
        async def publish(event: OutboxEvent) -> None:
            await asyncio.sleep(0.001)        # a destination's round trip: the drain lasts seconds
            delivered[name] += 1
        return FunctionPublisher(publish)

    workers = [start(dsn, publisher(f"w{i}"), batch_size=50, name=f"w{i}") for i in range(3)]

    for burst in (1, 2):
        await wait_until(fleet_idle(conn, workers), 10, "the three workers idle")
        delivered.clear()
        conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                     "SELECT 'order', 'a' || (g % 200), 'created', '{}' FROM generate_series(1, 6000) g")
        await wait_until(all_in(dsn, "published", 6_000 * burst), 25, f"burst {burst} published")
        assert sorted(delivered) == ["w0", "w1", "w2"], f"burst {burst}: only {dict(delivered)} took part"
    for w in workers:
        await w.stop()


async def test_claims_have_a_connection_of_their_own(dsn, conn):
    """Every connection of the shared pool taken (reports stuck on a lock, say): a claim still
    runs, on the claims' own connection, the one connection that plans outbox_claim."""
    enqueue(conn, "order", "1", "created", {})
    gateway = Gateway(WorkerConfig(dsn=dsn, concurrency=1), "outboxpg-worker")
    await gateway.open()
    try:
        held = [await gateway.pool.getconn(timeout=10) for _ in range(gateway.pool.max_size)]
        rows = await asyncio.wait_for(gateway.claim(10, timedelta(seconds=30), "w"), 5)
        assert len(rows) == 1
        for c in held:
            await gateway.pool.putconn(c)
    finally:
        await gateway.close()


async def test_the_claims_connection_is_warmed_up_before_its_first_claim(dsn, conn):
    """The claims' connection calls outbox_warm_up() as it opens: its first claim, with events
    waiting, plans no statement of the claim (it would plan over a hundred cold; the one planned
    is the worker's own prepared statement), and the warm-up left none of its own events behind."""
    for i in range(200):
        enqueue(conn, "order", str(i % 20), "created", {})
    gateway = Gateway(WorkerConfig(dsn=dsn, concurrency=1), "outboxpg-worker")
    await gateway.open()
    try:
        async with gateway.claims.connection() as c:
            before = (await (await c.execute(PLANS_KEPT)).fetchone())[0]
        rows = await gateway.claim(50, timedelta(seconds=30), "w")
        async with gateway.claims.connection() as c:
            after = (await (await c.execute(PLANS_KEPT)).fetchone())[0]
        assert len(rows) == 50 and before > 100 and after == before + 1, (len(rows), before, after)
    finally:
        await gateway.close()
    assert conn.execute("SELECT count(*) FROM outbox WHERE aggregate_id = 'warm-up'").fetchone()[0] == 0


async def test_the_reports_keep_warmed_up_connections_while_idle(dsn, conn):
    """--report-connections (2): the reports' pool opens that many with the gateway, each warmed up
    as it opens, so that a burst's first reports open no server session and plan nothing of
    outbox_complete; 0: none while idle, as before."""
    gateway = Gateway(WorkerConfig(dsn=dsn, concurrency=1), "outboxpg-worker")
    await gateway.open()
    try:
        await gateway.pool.wait(10)
        async with gateway.pool.connection() as a, gateway.pool.connection() as b:
            plans = [(await (await c.execute(PLANS_KEPT)).fetchone())[0] for c in (a, b)]
        assert all(p > 100 for p in plans), plans
        assert gateway.pool.get_stats()["pool_size"] == 2
    finally:
        await gateway.close()
    assert conn.execute("SELECT count(*) FROM outbox WHERE aggregate_id = 'warm-up'").fetchone()[0] == 0

    none_kept = Gateway(WorkerConfig(dsn=dsn, concurrency=1, report_connections=0), "outboxpg-worker")
    await none_kept.open()
    try:
        await asyncio.sleep(0.5)
        assert none_kept.pool.get_stats()["pool_size"] == 0
    finally:
        await none_kept.close()


SLOW_WARM_UPS = """
    CREATE FUNCTION slow_warm_up() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.aggregate_id = 'warm-up' AND NEW.state = 'processing' THEN
            PERFORM pg_sleep(0.3);
        END IF;
        RETURN NEW;
    END $$;
    CREATE TRIGGER slow_warm_up AFTER UPDATE ON outbox FOR EACH ROW EXECUTE FUNCTION slow_warm_up()"""
WARM_UPS_RUNNING = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'active' "
                    "AND query LIKE 'SELECT outbox_warm_up(%%' AND pid <> pg_backend_pid()")


async def test_the_claims_connection_is_handed_out_once_every_warm_up_is_done(dsn, conn):
    """A warm-up claims as a worker does: the heads its claim takes are skipped by other claims
    until it undoes its work. The claims' connection is handed out once the reports' kept
    connections have warmed up as well, so that the worker's first claims never meet its own
    warm-ups holding heads (run_until_idle, what outboxpg.testing.drain runs, took a claim that
    came back empty beside one for "nothing claimable" and returned with events left). The
    warm-ups are made slow here: a trigger sleeps 0.3 s when one's own event is claimed."""
    conn.execute(SLOW_WARM_UPS)
    gateway = Gateway(WorkerConfig(dsn=dsn, concurrency=1), "outboxpg-worker")
    await gateway.open()
    try:
        async with gateway.claims.connection():
            await asyncio.sleep(0.1)    # what would start beside the first claim has started
            running = conn.execute(WARM_UPS_RUNNING).fetchone()[0]
            kept = gateway.pool.get_stats()["pool_size"]
        assert (running, kept) == (0, 2)
    finally:
        await gateway.close()


async def test_a_failed_warm_up_is_a_warning_and_the_connection_serves(dsn, conn, caplog):
    """The warm-up claims as the worker will: a shard on a database whose shards are not enabled
    fails there first. One warning line; the claims' connection is still handed out, and the
    claim itself then fails with the database's own reason."""
    gateway = Gateway(WorkerConfig(dsn=dsn, concurrency=1, shard="0/2"), "outboxpg-worker")
    with caplog.at_level("WARNING", logger="outboxpg.worker"):
        await gateway.open()
        try:
            with pytest.raises(psycopg.Error, match="shards are not enabled"):
                await gateway.claim(10, timedelta(seconds=30), "w", shard="0/2")
        finally:
            await gateway.close()
    warnings = [r.getMessage() for r in caplog.records if "warm_up_failed" in r.getMessage()]
    assert len(warnings) == 1 and "shards are not enabled" in warnings[0], warnings


async def test_idle_workers_queued_for_the_wakeup_lock_hold_back_no_vacuum(dsn, conn):
    """Two idle workers: one holds the wakeup lock, the other queues for it. A session waiting in
    a statement holds that statement's snapshot, and with it the xmin horizon: VACUUM of every
    table of the database (the application's too) stopped at the start of the fleet's idle time,
    and the worker's own xmin watch reported it. The queued worker waits a second at a time."""
    workers = [start(dsn, FunctionPublisher(lambda e: None), name=f"w{i}") for i in range(2)]

    await wait_until(fleet_idle(conn, workers), 10, "one worker holding the wakeup lock, the other queued")
    await asyncio.sleep(3)
    held_back = conn.execute(
        "SELECT application_name, now() - xact_start FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_xmin IS NOT NULL "
        "AND now() - xact_start > interval '2.5 seconds'").fetchall()
    for w in workers:
        await w.stop()
    assert held_back == [], held_back


async def test_an_event_whose_producer_skipped_notify_goes_out_while_another_producer_stays_open(dsn, conn):
    """Two producers write while the worker drains, so neither NOTIFYs (20_producing's lane of the
    wakeup lock: every worker is busy). One commits after the worker's last claim, the other stays
    open. The worker that goes idle queues for the wakeup lock, which the open one keeps from being
    granted: it must still claim what the committed one wrote, instead of queuing again and again
    until its poll (120 s here; the event once waited for all of it)."""
    delivered: dict[int, float] = {}
    gate = asyncio.Event()

    async def publish(event: OutboxEvent) -> None:
        await gate.wait()
        delivered[event.id] = time.monotonic()

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    first = enqueue(conn, "order", "first", "e", {})          # wakes the worker: it lets the lock go

    async def lock_free() -> bool:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
                           "AND objid = %s AND objsubid = 2", WAKEUP_LOCK).fetchone()
        return row == (0,)
    await wait_until(lock_free, 5, "the worker draining, the wakeup lock free")
    open_one = psycopg.connect(dsn)
    later = psycopg.connect(dsn)
    try:
        enqueue(open_one, "order", "open", "e", {})           # no NOTIFY: the worker is busy
        committed = enqueue(later, "order", "later", "e", {})
        gate.set()                                            # the worker finishes, claims, goes idle
        await wait_until(queued_for_wakeup_lock(conn), 5, "the worker queued for the wakeup lock")
        t0 = time.monotonic()
        later.commit()
        await wait_until(lambda: _has(delivered, committed), 5, "the committed producer's event delivered")
        waited = delivered[committed] - t0
    finally:
        open_one.rollback()
        open_one.close()
        later.close()
        await running.stop()
    assert first in delivered
    assert waited < 2.0, waited


async def test_events_go_out_soon_after_a_claim_left_open_elsewhere_is_ended(dsn, conn):
    """A session claims in a transaction and leaves it idle (psql after BEGIN): until it ends, no
    claim takes new events in. The server ends it after its lease (4 s here, outbox_claim); the
    idle worker, which found nothing while it stayed, must then claim the events without waiting
    for a notification (they were announced while the session stayed) or its poll (120 s)."""
    delivered: dict[int, float] = {}

    async def publish(event: OutboxEvent) -> None:
        delivered[event.id] = time.monotonic()

    running = start(dsn, FunctionPublisher(publish), poll_interval=120)
    await wait_until(running.idle, 10, "worker idle")
    ids = [enqueue(conn, "order", f"before-{n}", "e", {}) for n in range(3)]
    await wait_until(lambda: _has(delivered, ids[-1]), 5, "the first events delivered")
    left_open = psycopg.connect(dsn)
    try:
        left_open.execute("SELECT * FROM outbox_claim(1, '4 seconds')").fetchall()   # holds the intake row
        t0 = time.monotonic()
        later = [r[0] for r in conn.execute(                 # one statement: one notification
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "SELECT 'order', 'later-' || g, 'e', '{}' FROM generate_series(1, 5) g RETURNING id").fetchall()]
        await asyncio.sleep(0.5)
        await wait_until(running.idle, 5, "the worker idle again, having found nothing")
        assert not any(i in delivered for i in later)

        async def all_later() -> bool:
            return all(i in delivered for i in later)
        await wait_until(all_later, 10, "the later events delivered")
        waited = max(delivered[i] for i in later) - t0
    finally:
        left_open.close()
        await running.stop()
    assert waited < 6.5, waited


async def test_a_run_the_lane_had_out_is_followed_by_the_rest_of_its_aggregate(dsn, conn):
    """The worker's one batch is out with a busy aggregate's run, held by the publisher, and its
    lane takes a quiet aggregate's event beside it, held too; two more events of that aggregate
    commit while the worker is busy (nobody idle: no notification). The busy batch comes back
    first, and the worker finds nothing to claim: the quiet aggregate's head is the lane's. When
    the lane's batch is reported, the two are claimable, and nothing says so: the worker must not
    have gone to sleep while the lane's batch was out (before, it slept until that batch's lease
    would have run out, 90 s here)."""
    with conn.transaction():
        enqueue_many(conn, [Event("order", "busy", "step", {"n": n}) for n in range(40)])
    rows = conn.execute("SELECT id, lease_token FROM outbox_claim(1)").fetchall()
    conn.execute("SELECT outbox_release(%s, %s)", ([r[0] for r in rows], rows[0][1]))
    conn.execute("UPDATE outbox_heads SET moves = 3")            # a busy aggregate
    busy_held, quiet_held = asyncio.Event(), asyncio.Event()
    out: list[str] = []

    async def publish(event: OutboxEvent) -> None:
        out.append(event.aggregate_id)
        await (busy_held if event.aggregate_id == "busy" else quiet_held).wait()

    running = start(dsn, FunctionPublisher(publish), poll_interval=120, publish_timeout=30, lease=90,
                    concurrency=1, batch_size=40)
    try:
        await wait_until(lambda: _has(out, "busy"), 10, "the busy run out")
        enqueue(conn, "order", "quiet", "step", {"n": 0})
        await wait_until(lambda: _has(out, "quiet"), 10, "the lane's quiet run out")
        with conn.transaction():
            enqueue_many(conn, [Event("order", "quiet", "step", {"n": n}) for n in (1, 2)])
        busy_held.set()
        await wait_until(lambda: equals(count_in(dsn, "published"), 40), 10, "the busy run published")
        await asyncio.sleep(0.5)                                  # the worker found nothing more
        assert out.count("quiet") == 1
        quiet_held.set()
        await wait_until(lambda: equals(count_in(dsn, "published"), 43), 5, "the quiet aggregate's next two events")
    finally:
        busy_held.set()
        quiet_held.set()
        await running.stop()


async def _has(out: list[str], aggregate: str) -> bool:
    return aggregate in out
