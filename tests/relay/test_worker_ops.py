"""Operating the worker: Prometheus metrics and scheduled maintenance."""

from __future__ import annotations

import asyncio
import time
import urllib.request

from locks import MAINTENANCE_LOCK
from prometheus_client.parser import text_string_to_metric_families
from workers import count_in, equals, start, wait_until

from outboxpg import enqueue
from outboxpg.embedded import free_port
from outboxpg.events import OutboxEvent
from outboxpg.relay.metrics import WorkerMetrics
from outboxpg.relay.publishers import FunctionPublisher, PermanentError
from outboxpg.relay.worker import Worker, WorkerConfig


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_metrics_endpoint_matches_the_database(dsn, conn, fast_retries):
    conn.execute("UPDATE outbox_settings SET max_attempts = 2")

    async def publish(event: OutboxEvent) -> None:
        if event.event_type == "poison":
            raise PermanentError("never publishable")
        if event.aggregate_id == "flaky" and event.attempt == 1:
            raise RuntimeError("first try fails")

    for i in range(30):
        enqueue(conn, "order", str(i), "created" if i % 3 else "paid", {"i": i})
    enqueue(conn, "order", "p", "poison", {})
    enqueue(conn, "order", "flaky", "created", {})
    enqueue(conn, "order", "late", "created", {})
    port = free_port()
    metrics = WorkerMetrics(dsn, sample_every=0.0)
    metrics.serve(port)
    worker = Worker(WorkerConfig(dsn=dsn, publish_timeout=2, lease=10), FunctionPublisher(publish), metrics)
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: equals(count_in(dsn, "published"), 32), 20, "32 published")
    await wait_until(lambda: equals(count_in(dsn, "dead"), 1), 20, "poison dead")
    # A backlog the worker cannot take: events of a dead aggregate wait behind it.
    enqueue(conn, "order", "p", "after-poison", {})
    await asyncio.sleep(0.3)
    # The worker counts a batch after its report commits: scrape until the counters have caught
    # up with the rows (a count that never does fails here).
    m = await asyncio.to_thread(scrape, port)
    end = time.monotonic() + 10
    while sum(v for (name, _), v in m.items() if name == "outboxpg_events_delivered_total") < 32 \
            or m.get(("outboxpg_events_dead_lettered_total", (("event_type", "poison"),))) != 1:
        assert time.monotonic() < end, m
        await asyncio.sleep(0.05)
        m = await asyncio.to_thread(scrape, port)
    worker.stop()
    await task

    by_type = dict(conn.execute("SELECT event_type, count(*) FROM outbox WHERE state = 'published' "
                                "GROUP BY 1").fetchall())
    assert m[("outboxpg_events_delivered_total", (("event_type", "created"),))] == by_type["created"]
    assert m[("outboxpg_events_delivered_total", (("event_type", "paid"),))] == by_type["paid"]
    assert m[("outboxpg_events_dead_lettered_total", (("event_type", "poison"),))] == 1
    assert m[("outboxpg_events_failed_total", (("event_type", "created"),))] == 1  # flaky's first try
    assert m[("outboxpg_backlog_events", ())] == 1          # after-poison, held back
    assert m[("outboxpg_dead_events", ())] == 1
    assert m[("outboxpg_oldest_pending_age_seconds", ())] >= 0
    assert m[("outboxpg_listener_up", ())] == 1
    assert m[("outboxpg_claim_batch_size_count", ())] >= 1
    assert m[("outboxpg_event_lag_seconds_count", ())] == 34  # every published or failed report
    assert m[("outboxpg_last_claim_timestamp_seconds", ())] > 1.7e9


async def test_scheduled_maintenance_runs_under_the_advisory_lock_and_failures_do_not_stop_delivery(dsn, conn):
    before = conn.execute("SELECT count(*) FROM outbox_partitions").fetchone()[0]
    conn.execute("UPDATE outbox_settings SET partitions_ahead = 6")
    # Another worker "is maintaining": it holds the lock, so this worker's runs skip.
    conn.execute("SELECT pg_advisory_lock(%s, %s)", MAINTENANCE_LOCK)
    seen: list[int] = []

    async def publish(event: OutboxEvent) -> None:
        seen.append(event.id)

    running = start(dsn, FunctionPublisher(publish), maintenance_interval=0.3)
    await asyncio.sleep(1.0)
    assert conn.execute("SELECT count(*) FROM outbox_partitions").fetchone()[0] == before
    conn.execute("SELECT pg_advisory_unlock(%s, %s)", MAINTENANCE_LOCK)

    async def created() -> bool:
        return conn.execute("SELECT count(*) FROM outbox_partitions").fetchone()[0] == before + 3
    await wait_until(created, 5, "the three extra partitions created")

    # Maintenance failing (here: its function gone) is logged and retried; delivery goes on.
    conn.execute("ALTER FUNCTION outbox_maintain(boolean) RENAME TO outbox_maintain_away")
    await asyncio.sleep(0.8)
    event_id = enqueue(conn, "order", "1", "created", {})
    await wait_until(lambda: equals(count_in(dsn, "published"), 1), 5, "event delivered while maintenance fails")
    await running.stop()
    assert seen == [event_id]
