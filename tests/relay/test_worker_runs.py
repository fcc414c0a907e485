"""Runs: the worker delivers up to outbox_settings.max_run consecutive events of one aggregate
under one lease, and the stream still never holds an aggregate's events out of id order,
whatever fails in the middle of a run. Each test injects a fault at the k-th event of runs,
then reads the JetStream stream back and checks, per aggregate, strictly increasing outbox ids
(the Outbox-Id header), each event once, and the database's end state."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import nats
import pytest
from jetstream import NatsProxy, make_stream
from runs import assert_in_order_once, start, states, stream_ids, until_published, write
from workers import wait_until

from outboxpg import enqueue
from outboxpg.events import OutboxEvent
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.publishers import FunctionPublisher


def assert_no_send_before_previous_delivered(calls: list[tuple[int, bool]], ids: dict[str, list[int]]) -> None:
    """``calls``: (event id, succeeded) in call order. Event j of an aggregate may be tried only
    after event j-1 succeeded."""
    previous = {i: agg_ids[n - 1] for agg_ids in ids.values() for n, i in enumerate(agg_ids) if n}
    delivered: set[int] = set()
    for i, ok in calls:
        if i in previous:
            assert previous[i] in delivered, f"event {i} tried before event {previous[i]} was delivered"
        if ok:
            delivered.add(i)


class JetStreamFunction:
    """A user publisher ``fn(event)`` that publishes to JetStream itself (with the headers the
    stream checks read back) and fails (raises, or hangs past the publish timeout) at the
    events in ``faults`` on their first attempt."""

    def __init__(self, url: str, faults: set[int], fault: str) -> None:
        self.url, self.faults, self.fault = url, faults, fault
        self.calls: list[tuple[int, bool]] = []
        self.nc: Any = None

    async def connect(self) -> None:
        self.nc = await nats.connect(self.url)
        self.js = self.nc.jetstream()

    async def __call__(self, event: OutboxEvent) -> None:
        ok = False
        try:
            headers = {"Nats-Msg-Id": event.msg_id, "Outbox-Id": str(event.id),
                       "Outbox-Aggregate-Type": event.aggregate_type, "Outbox-Aggregate-Id": event.aggregate_id}
            if event.id in self.faults and self.fault == "raise":
                self.faults.discard(event.id)
                raise RuntimeError(f"injected failure at event {event.id}")
            await self.js.publish(event.subject, event.payload, headers=headers)
            if event.id in self.faults and self.fault == "hang":
                # Stored, but the answer comes too late: the worker fails it at its deadline
                # (the call is cancelled here) and retries it; JetStream drops the re-publish.
                self.faults.discard(event.id)
                await asyncio.sleep(30)
            ok = True
        finally:
            self.calls.append((event.id, ok))


@pytest.mark.parametrize("fault", ["raise", "hang"])
async def test_user_publisher_failing_or_timing_out_at_the_kth_event_of_a_run(dsn, conn, nats_server, fast_retries,
                                                                             fault):
    """(a) the k-th event of a run raises; (b) it times out (stored, but too late). The rest of
    that run is released, not tried; the run resumes at the failed event; the others flow."""
    conn.execute("UPDATE outbox_settings SET max_run = 5")
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    ids = write(conn, [f"a{i}" for i in range(6)], 12)
    # The 3rd event of the first run of a0..a2, the 1st of a3's second run, a4's last.
    faults = {ids["a0"][2], ids["a1"][2], ids["a2"][2], ids["a3"][5], ids["a4"][11]}
    fn = JetStreamFunction(nats_server.url, set(faults), fault)
    await fn.connect()
    try:
        running = start(dsn, FunctionPublisher(fn, timeout=0.5), publish_timeout=0.5, lease=5, batch_size=100)
        await until_published(conn, 72, 30)
        await running.stop()
    finally:
        await fn.nc.close()
    assert_in_order_once(await stream_ids(nats_server.url, stream), ids)
    assert_no_send_before_previous_delivered(fn.calls, ids)
    tried = defaultdict(int)
    for i, _ in fn.calls:
        tried[i] += 1
    # Each faulty event was tried twice; every other event once: what followed a failure in
    # its run was released untried and came again after it.
    assert {i for i, n in tried.items() if n == 2} == faults
    assert all(n == 1 for i, n in tried.items() if i not in faults)
    errors = dict(conn.execute("SELECT id, last_error FROM outbox WHERE last_error IS NOT NULL").fetchall())
    assert set(errors) == faults, "a release records no failure"
    assert set(states(conn).values()) == {"published"}
    stats = running.worker.stats
    assert (stats.delivered, stats.failed, stats.dead) == (72, 5, 0)
    # a0..a2 lose two events each, a3 four (its 2nd run cut at its 1st), a4 none (its last).
    assert stats.released == 2 * 3 + 4


async def test_too_large_kth_event_is_dead_at_once_and_holds_back_its_aggregate_only(dsn, conn, nats_server,
                                                                                    fast_retries):
    """(c) the k-th event of a run is over max_payload (the payload alone, or only with the
    headers NATS counts too): dead-lettered at once as permanent; the events after it stay
    pending behind the dead letter (order beats liveness) while other aggregates flow."""
    conn.execute("UPDATE outbox_settings SET max_run = 10")
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    probe = await nats.connect(nats_server.url)
    limit = probe.max_payload
    await probe.close()
    # '{"blob": "x...x"}' as jsonb text: 12 bytes besides the x's.
    huge = {"blob": "x" * (limit + 100)}
    just_under = {"blob": "x" * (limit - 12 - 60)}   # fits alone, not with ~250 bytes of headers

    def payload(agg: str, n: int) -> dict[str, Any]:
        if n == 3 and agg == "big":
            return huge
        if n == 2 and agg == "tight":
            return just_under
        return {"n": n}

    # The huge one is over max_event_bytes' default too: written with the limit raised.
    conn.execute("UPDATE outbox_settings SET max_event_bytes = %s", (2 * limit,))
    ids = write(conn, ["big", "tight", "ok1", "ok2"], 8, payload)
    running = start(dsn, NatsPublisher(nats_server.url, ack_timeout=2), batch_size=100)
    await until_published(conn, 3 + 2 + 8 + 8, 20)
    await asyncio.sleep(0.5)   # nothing more may follow: the held-back events stay pending
    await running.stop()
    s = states(conn)
    assert [s[i] for i in ids["big"]] == ["published"] * 3 + ["dead"] + ["pending"] * 4
    assert [s[i] for i in ids["tight"]] == ["published"] * 2 + ["dead"] + ["pending"] * 5
    dead = conn.execute("SELECT id, attempts, last_error FROM outbox WHERE state = 'dead' ORDER BY id").fetchall()
    assert [(i, n) for i, n, _ in dead] == [(ids["tight"][2], 1), (ids["big"][3], 1)]
    assert all("max_payload" in e for _, _, e in dead)
    # Released, not failed: the held-back events never counted an attempt nor got an error.
    held = ids["big"][4:] + ids["tight"][3:]
    assert conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s) AND attempts = 0 AND last_error IS NULL",
                        (held,)).fetchone()[0] == len(held)
    expected = {"big": ids["big"][:3], "tight": ids["tight"][:2], "ok1": ids["ok1"], "ok2": ids["ok2"]}
    assert_in_order_once(await stream_ids(nats_server.url, stream), expected)
    assert running.worker.stats.dead == 2


@pytest.mark.parametrize("how", ["proxy-cut", "server-restart"])
async def test_nats_connection_dropped_in_the_middle_of_runs(dsn, conn, nats_server, own_nats_server, fast_retries,
                                                             how):
    """(d) the connection to NATS drops while runs are being published: cut by a proxy (bytes in
    flight lost) or the server restarted. No aggregate's events are stored out of order, and
    every event is delivered exactly once in the end."""
    conn.execute("UPDATE outbox_settings SET max_run = 50")
    server = nats_server if how == "proxy-cut" else own_nats_server
    stream = await make_stream(server.url)
    await stream.nc.close()
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    ids = write(conn, [f"h{i}" for i in range(8)], 400)    # 3,200 events, 8 hot aggregates
    total = 3200
    proxy = NatsProxy(server.port)
    url = await proxy.start() if how == "proxy-cut" else server.url
    publisher = NatsPublisher(url, ack_timeout=1.0)
    running = start(dsn, publisher, batch_size=100, publish_timeout=1.0, lease=3)
    try:
        for k in range(3):
            await until_published(conn, 300 + k * 700, 30)
            # Cut at a moment when some run is in its middle: an event unacked, the one before
            # it stored (checked and cut with no await in between).
            deadline = time.monotonic() + 10
            while not any(run.next > 0 for run in publisher.inflight.waiting.values()):
                assert time.monotonic() < deadline, "no run in flight to cut"
                await asyncio.sleep(0)
            if how == "proxy-cut":
                proxy.cut()
            else:
                assert server.proc is not None
                server.proc.kill()      # no goodbye: whatever the server had not answered is lost
                server.stop()
                await asyncio.sleep(0.5)
                server.start()
        await until_published(conn, total, 60)
        await running.stop()
    finally:
        await proxy.close()
    assert running.worker.stats.failed > 0, "the drops were felt"
    assert set(states(conn).values()) == {"published"}
    assert_in_order_once(await stream_ids(server.url, stream), ids)


@pytest.mark.slow
async def test_claims_again_when_the_first_in_flight_batch_is_reported_not_the_last(dsn, conn):
    """A slow batch in flight must not hold back an aggregate that the other batches' reports
    make claimable again: after a short claim the worker waits for the FIRST in-flight batch."""
    slow_started = asyncio.Event()
    done_at: dict[int, float] = {}

    async def publish(event: OutboxEvent) -> None:
        if event.aggregate_id == "slow":
            slow_started.set()
            await asyncio.sleep(6)
        done_at[event.id] = time.monotonic()

    slow = enqueue(conn, "order", "slow", "step", {})
    hot = [enqueue(conn, "order", "hot", "step", {"n": n}) for n in range(5)]
    # One event per claim: the slow one, then the hot aggregate's events one batch each, every
    # next one claimable only once the previous batch is reported.
    running = start(dsn, FunctionPublisher(publish), batch_size=1, concurrency=4, publish_timeout=8, lease=20)
    await asyncio.wait_for(slow_started.wait(), 5)
    t0 = time.monotonic()
    await wait_until(lambda: _all_in(hot, done_at), 4.0, "the hot aggregate delivered while the slow batch hangs")
    assert slow not in done_at
    await running.stop()
    assert max(done_at[i] for i in hot) - t0 < 4.0   # the slow batch takes 6 s (room for a busy machine)
    assert sorted(hot, key=done_at.__getitem__) == hot


async def _all_in(ids: list[int], seen: dict[int, float]) -> bool:
    return all(i in seen for i in ids)


async def test_worker_logs_its_run_publishing_scheme_at_start(dsn, nats_server, caplog):
    caplog.set_level("INFO", logger="outboxpg.worker")
    for publisher, scheme in ((NatsPublisher(nats_server.url), "atomic-batch(min_run=32)+sequential-acks"),
                              (NatsPublisher(nats_server.url, atomic_min_run=None), "sequential-acks"),
                              (FunctionPublisher(lambda e: None), "sequential-calls")):
        running = start(dsn, publisher)
        await wait_until(lambda: _logged(caplog, "event=start"), 10, "the start line")
        await running.stop()
        lines = [r.getMessage() for r in caplog.records if "event=start" in r.getMessage()]
        assert len(lines) == 1 and lines[0].endswith(f"run_publishing={scheme}"), lines
        caplog.clear()


async def _logged(caplog: Any, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)
