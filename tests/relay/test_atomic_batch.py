"""Runs as JetStream atomic batches (nats-server 2.12+, streams with allow_atomic), against the
real nats-server: a long run is stored whole and in order; a refused batch stores nothing of its
chunk and is reported first-fails / rest-not-sent, its retry goes one by one; streams without
allow_atomic and old servers get sequential acks; the stream holds every aggregate in id order."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats
import pytest
from jetstream import NatsProxy, StreamHandle, make_stream
from nats.js.api import StreamConfig
from runs import assert_in_order_once, start, states, stream_ids, until_published, write
from workers import event

from outboxpg.events import OutboxEvent
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.nats.streams import ensure_stream
from outboxpg.relay.publishers import NotSent, PermanentError


async def stored(stream: StreamHandle) -> list[dict[str, str]]:
    """The headers of every message in the stream, in stream order."""
    info = await stream.js.stream_info(stream.name)
    if not info.state.messages:
        return []
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        m = await stream.js.get_msg(stream.name, seq)
        out.append(dict(m.headers or {}))
    return out


def run_of(prefix: str, first_id: int, n: int, aggregate: str, **kw: Any) -> list[OutboxEvent]:
    kw.setdefault("attempt", 1)
    return [event(first_id + k, f"{prefix}.order.step", aggregate_id=aggregate, **kw) for k in range(n)]


async def test_a_long_run_is_stored_whole_in_order_as_batches_of_at_most_1000(nats_server: Any) -> None:
    stream = await make_stream(nats_server.url, atomic=True)
    pub = NatsPublisher(nats_server.url, ack_timeout=10)
    await pub.start()
    try:
        assert pub.run_publishing == "atomic-batch(min_run=32)+sequential-acks"
        hot = run_of(stream.prefix, 1, 2300, "hot")
        short = run_of(stream.prefix, 5000, 5, "short")
        events = hot[:3] + short + hot[3:]   # interleaved, each run in id order
        assert await pub.publish_batch(events) == [None] * len(events)
        msgs = await stored(stream)
        assert len(msgs) == 2305
        hot_msgs = [m for m in msgs if m["Outbox-Aggregate-Id"] == "hot"]
        assert [int(m["Outbox-Id"]) for m in hot_msgs] == [e.id for e in hot]
        # Three batches (1000, 1000, 300), one after another, each with its own id.
        batch_ids = [m["Nats-Batch-Id"] for m in hot_msgs]
        assert [batch_ids.count(b) for b in dict.fromkeys(batch_ids)] == [1000, 1000, 300]
        assert [int(m["Nats-Batch-Sequence"]) for m in hot_msgs[:3]] == [1, 2, 3]
        # The short run went one by one.
        assert all("Nats-Batch-Id" not in m for m in msgs if m["Outbox-Aggregate-Id"] == "short")
        assert pub.inflight.atomic_open == 0 and not pub.inflight.waiting
    finally:
        await pub.close()
        await stream.nc.close()


async def test_a_quiet_aggregate_is_not_stored_behind_a_busy_run_of_its_batch(nats_server: Any) -> None:
    """Runs go shortest first: the one event of a quiet aggregate, last in the batch by id, is
    stored before the busy run's first chunk of 1,000 (not 1,000 messages later)."""
    stream = await make_stream(nats_server.url, atomic=True)
    pub = NatsPublisher(nats_server.url, ack_timeout=10)
    await pub.start()
    try:
        events = run_of(stream.prefix, 1, 1500, "busy") + run_of(stream.prefix, 9000, 1, "quiet")
        assert await pub.publish_batch(events) == [None] * len(events)
        msgs = await stored(stream)
        assert [m["Outbox-Aggregate-Id"] for m in msgs].index("quiet") == 0
        assert [int(m["Outbox-Id"]) for m in msgs if m["Outbox-Aggregate-Id"] == "busy"] == list(range(1, 1501))
    finally:
        await pub.close()
        await stream.nc.close()


@pytest.mark.parametrize("refusal", ["too-large", "duplicate-in-batch", "already-stored"])
async def test_a_refused_batch_stores_nothing_and_its_retry_goes_one_by_one(nats_server: Any, refusal: str) -> None:
    """A message of the batch over the stream's max_msg_size (under NATS max_payload), two
    events with one Nats-Msg-Id, or an event the stream already holds: the server refuses the
    whole batch. The run's first event fails (ordinarily), the rest is NotSent; the same run on
    its 2nd attempt goes with sequential acks and the stream ends up with each event once, in
    order."""
    stream = await make_stream(nats_server.url, atomic=True, max_msg_size=4096)
    pub = NatsPublisher(nats_server.url, ack_timeout=10)
    await pub.start()
    try:
        run = run_of(stream.prefix, 1, 40, "hot")
        if refusal == "too-large":
            run[20] = event(21, run[20].subject, aggregate_id="hot", attempt=1, payload=b'"' + b"x" * 5000 + b'"')
        elif refusal == "duplicate-in-batch":
            run[20] = event(21, run[20].subject, aggregate_id="hot", attempt=1, msg_id=run[19].msg_id)
        else:
            assert await pub.publish_batch(run[:1]) == [None]   # sequential (a run of 1): stored
        out = await pub.publish_batch(run)
        assert type(out[0]) is not PermanentError and isinstance(out[0], Exception), out[0]
        assert "atomic batch of 40 events refused" in str(out[0])
        assert all(isinstance(o, NotSent) for o in out[1:])
        assert len(await stored(stream)) == (1 if refusal == "already-stored" else 0)
        # The retry (the worker would claim the run again, its first event on attempt 2).
        retry = [OutboxEvent(**{**{f: getattr(e, f) for f in e.__slots__}, "attempt": 2}) for e in run]
        out = await pub.publish_batch(retry)
        msgs = await stored(stream)
        assert all("Nats-Batch-Id" not in m for m in msgs)
        if refusal == "too-large":
            assert out[:20] == [None] * 20 and isinstance(out[20], PermanentError)
            assert all(isinstance(o, NotSent) for o in out[21:])
            assert [int(m["Outbox-Id"]) for m in msgs] == list(range(1, 21))
        else:
            # The duplicate (or the already stored event) is dropped by JetStream's dedup.
            assert out == [None] * 40
            expected = [i for i in range(1, 41) if not (refusal == "duplicate-in-batch" and i == 21)]
            assert [int(m["Outbox-Id"]) for m in msgs] == expected
        assert pub.inflight.atomic_open == 0 and not pub.inflight.waiting
    finally:
        await pub.close()
        await stream.nc.close()


async def test_a_stream_without_allow_atomic_gets_sequential_acks(nats_server: Any) -> None:
    stream = await make_stream(nats_server.url, atomic=False)
    pub = NatsPublisher(nats_server.url, ack_timeout=10)
    await pub.start()
    try:
        run = run_of(stream.prefix, 1, 200, "hot")
        assert await pub.publish_batch(run) == [None] * 200
        msgs = await stored(stream)
        assert [int(m["Outbox-Id"]) for m in msgs] == list(range(1, 201))
        assert all("Nats-Batch-Id" not in m for m in msgs)
    finally:
        await pub.close()
        await stream.nc.close()


async def test_a_stream_switched_off_allow_atomic_is_noticed(nats_server: Any) -> None:
    """The lookup is cached; a batch refused because allow_atomic was turned off since drops
    the cache entry, and the next long run goes one by one."""
    stream = await make_stream(nats_server.url, atomic=True)
    pub = NatsPublisher(nats_server.url, ack_timeout=10)
    await pub.start()
    try:
        assert await pub.publish_batch(run_of(stream.prefix, 1, 40, "hot")) == [None] * 40
        info = await stream.js.stream_info(stream.name)
        info.config.allow_atomic = False
        await stream.js.update_stream(info.config)
        out = await pub.publish_batch(run_of(stream.prefix, 41, 40, "hot"))
        assert isinstance(out[0], Exception) and "atomic publish is disabled" in str(out[0])
        assert await pub.publish_batch(run_of(stream.prefix, 41, 40, "hot")) == [None] * 40
        msgs = await stored(stream)
        assert [int(m["Outbox-Id"]) for m in msgs] == list(range(1, 81))
        assert all("Nats-Batch-Id" not in m for m in msgs[40:])
    finally:
        await pub.close()
        await stream.nc.close()


async def test_an_old_server_gets_sequential_acks_and_says_so(nats_server: Any) -> None:
    stream = await make_stream(nats_server.url, atomic=True)
    proxy = NatsProxy(nats_server.port, version="2.9.10")
    pub = NatsPublisher(await proxy.start(), ack_timeout=10)
    await pub.start()
    try:
        assert pub.run_publishing == "sequential-acks (server 2.9.10 has no atomic batch publish)"
        assert await pub.publish_batch(run_of(stream.prefix, 1, 100, "hot")) == [None] * 100
        assert all("Nats-Batch-Id" not in m for m in await stored(stream))
    finally:
        await pub.close()
        await proxy.close()
        await stream.nc.close()


async def test_ensure_stream_allows_atomic_where_the_server_has_it(nats_server: Any) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    tag = uuid.uuid4().hex[:8]
    try:
        said = await ensure_stream(js, f"E{tag}", [f"e{tag}.>"], window=__import__("datetime").timedelta(minutes=6),
                                   atomic=True)
        assert said.endswith("allow_atomic=true")
        assert (await js.stream_info(f"E{tag}")).config.allow_atomic is True
        # An existing stream without it is updated to allow it; without atomic, nothing changes.
        await js.add_stream(StreamConfig(name=f"F{tag}", subjects=[f"f{tag}.>"], duplicate_window=600))
        from datetime import timedelta
        assert "allow_atomic" not in await ensure_stream(js, f"F{tag}", [f"f{tag}.>"], timedelta(minutes=6))
        assert not (await js.stream_info(f"F{tag}")).config.allow_atomic
        said = await ensure_stream(js, f"F{tag}", [f"f{tag}.>"], timedelta(minutes=6), atomic=True)
        assert said.startswith("updated") and said.endswith("allow_atomic=true")
        assert (await js.stream_info(f"F{tag}")).config.allow_atomic is True
    finally:
        await nc.close()


# -- the worker -----------------------------------------------------------------------------

@pytest.mark.parametrize("atomic", [True, False])
async def test_worker_keeps_every_aggregate_in_order_with_a_refused_batch_in_the_middle(dsn, conn, nats_server,
                                                                                       fast_retries, atomic):
    """Two hot aggregates with runs of 100 (batches where the stream allows atomic), and one event
    too large for the stream (over its max_msg_size) in the middle of one: that batch is
    refused whole, its first event fails and the rest is released; the retry goes one by one,
    stores the events before the culprit and dead-letters it. The stream holds each aggregate
    in id order, each event once."""
    conn.execute("UPDATE outbox_settings SET max_run = 100")
    stream = await make_stream(nats_server.url, atomic=atomic, max_msg_size=8192)
    await stream.nc.close()
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    ids = write(conn, ["big", "hot"], 250,
                lambda agg, n: {"blob": "x" * 10_000} if agg == "big" and n == 150 else {"n": n})
    running = start(dsn, NatsPublisher(nats_server.url, ack_timeout=5), batch_size=500, publish_timeout=5, lease=10)
    await until_published(conn, 150 + 250, 60)
    await asyncio.sleep(0.5)   # the events after the dead letter stay pending
    await running.stop()
    s = states(conn)
    assert [s[i] for i in ids["big"]] == ["published"] * 150 + ["dead"] + ["pending"] * 99
    assert all(s[i] == "published" for i in ids["hot"])
    expected = {**ids, "big": ids["big"][:150]}
    assert_in_order_once(await stream_ids(nats_server.url, stream), expected)
    errors = dict(conn.execute("SELECT id, last_error FROM outbox WHERE last_error IS NOT NULL").fetchall())
    stats = running.worker.stats
    assert stats.dead == 1 and "maximum" in errors.pop(ids["big"][150])
    if atomic:
        # The batch holding the culprit (the run from event 100 of "big") was refused whole:
        # its first event failed once, the rest were released; then one by one.
        assert errors == {ids["big"][100]: errors[ids["big"][100]]}
        assert "atomic batch of 100 events refused" in errors[ids["big"][100]]
        assert stats.failed == 1 and stats.released >= 99
        headers = await stored(StreamHandle(*(await _js(nats_server.url)), stream.name, stream.prefix))
        assert any("Nats-Batch-Id" in m for m in headers), "the runs of 100 went as batches"
    else:
        assert errors == {} and stats.failed == 0


async def _js(url: str) -> tuple[Any, Any]:
    nc = await nats.connect(url)
    return nc, nc.jetstream()
