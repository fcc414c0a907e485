"""NatsPublisher on its own, against a real nats-server: outcomes in order, duplicates, what each
kind of answer on the reply subject means, and timeouts. A core NATS responder stands in for
JetStream where a test needs an answer JetStream would not give on demand."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timezone
from typing import Any

import nats
import nats.js.errors
import orjson
import pytest

from jetstream import make_stream
from outboxpg.events import OutboxEvent, PermanentError
from outboxpg.nats_publisher import NatsPublisher


def event(i: int, subject: str, **kw: Any) -> OutboxEvent:
    fields: dict[str, Any] = dict(id=i, subject=subject, aggregate_type="order", aggregate_id=str(i),
                                  event_type="created", payload=b'{"i": %d}' % i, headers={},
                                  msg_id=f"m-{uuid.uuid4()}", attempt=0, created_at=datetime.now(timezone.utc))
    fields.update(kw)
    return OutboxEvent(**fields)


async def test_outcomes_in_order_and_duplicates_counted(nats_server: Any) -> None:
    stream = await make_stream(nats_server.url)
    seen: list[int] = []
    pub = NatsPublisher(nats_server.url, ack_timeout=5, on_duplicate=seen.append)
    await pub.start()
    try:
        good = [event(i, f"{stream.prefix}.order.created") for i in range(5)]
        batch = [good[0], event(100, f"{stream.prefix}.x", headers={"X-Note": "a\nb"}),
                 good[1], event(101, f"nostream{uuid.uuid4().hex[:8]}.x"), *good[2:]]
        out = await pub.publish_batch(batch)
        assert [type(o).__name__ for o in out] == ["NoneType", "PermanentError", "NoneType", "RuntimeError",
                                                    "NoneType", "NoneType", "NoneType"]
        assert "no JetStream stream" in str(out[3])
        assert pub.duplicates == 0
        # The same events again: JetStream drops them (same Nats-Msg-Id), which is a success.
        assert await pub.publish_batch(good) == [None] * 5
        assert pub.duplicates == 5 and sorted(seen) == [1, 2, 3, 4, 5]
        info = await stream.js.stream_info(stream.name)
        assert info.state.messages == 5
        msg = await stream.js.get_msg(stream.name, 2)
        assert msg.headers is not None and msg.headers["Outbox-Id"] == "1" and msg.data == b'{"i": 1}'
        assert not pub._waiting
    finally:
        await pub.close()
        await stream.nc.close()


async def test_answers_on_the_reply_subject(nats_server: Any) -> None:
    """Every kind of answer, from a stand-in responder: each maps to the right outcome, even
    the error answers that nats-py's publish_async loses (APIError.from_error raises)."""
    prefix = f"fake{uuid.uuid4().hex[:8]}"
    answers = {
        "ok": orjson.dumps({"stream": "S", "seq": 7}),
        "dup": orjson.dumps({"stream": "S", "seq": 7, "duplicate": True}),
        "toobig": orjson.dumps({"error": {"code": 400, "err_code": 10054,
                                          "description": "message size exceeds maximum allowed"}}),
        "wrongstream": orjson.dumps({"error": {"code": 400, "err_code": 10060,
                                               "description": "expected stream does not match"}}),
        "unavailable": orjson.dumps({"error": {"code": 503, "err_code": 10008, "description": "jetstream unavailable"}}),
        "garbage": b"<html>",
    }
    nc = await nats.connect(nats_server.url)

    async def respond(msg: Any) -> None:
        kind = msg.subject.rsplit(".", 1)[1]
        if kind == "silent":
            return
        await nc.publish(msg.reply, answers[kind])

    await nc.subscribe(f"{prefix}.*", cb=respond)
    await nc.flush()
    pub = NatsPublisher(nats_server.url, ack_timeout=0.5)
    await pub.start()
    try:
        kinds = [*answers, "silent"]
        out = dict(zip(kinds, await pub.publish_batch([event(i, f"{prefix}.{k}") for i, k in enumerate(kinds)])))
        assert out["ok"] is None and out["dup"] is None and pub.duplicates == 1
        assert isinstance(out["toobig"], PermanentError) and "maximum" in str(out["toobig"])
        assert isinstance(out["wrongstream"], nats.js.errors.BadRequestError)
        assert "expected stream does not match" in str(out["wrongstream"])
        assert isinstance(out["unavailable"], nats.js.errors.ServiceUnavailableError)
        assert isinstance(out["garbage"], RuntimeError) and "unreadable" in str(out["garbage"])
        assert isinstance(out["silent"], TimeoutError)
        assert not pub._waiting, "a timed-out publish is forgotten"
    finally:
        await pub.close()
        await nc.close()


async def test_a_late_ack_is_ignored_and_concurrent_batches_keep_their_own(nats_server: Any) -> None:
    prefix = f"late{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(nats_server.url)
    delay = {"slow": 0.6, "fast": 0.0}

    async def respond(msg: Any) -> None:
        async def later() -> None:
            await asyncio.sleep(delay[msg.subject.rsplit(".", 1)[1]])
            await nc.publish(msg.reply, b'{"stream": "S", "seq": 1}')
        asyncio.ensure_future(later())

    await nc.subscribe(f"{prefix}.*", cb=respond)
    await nc.flush()
    pub = NatsPublisher(nats_server.url, ack_timeout=0.3)
    await pub.start()
    try:
        slow, fast = await asyncio.gather(
            pub.publish_batch([event(i, f"{prefix}.slow") for i in range(3)]),
            pub.publish_batch([event(i, f"{prefix}.fast") for i in range(200)]))
        assert all(isinstance(o, TimeoutError) for o in slow)
        assert fast == [None] * 200
        await asyncio.sleep(0.6)   # the slow acks arrive now, for nobody
        assert await pub.publish_batch([event(1, f"{prefix}.fast")]) == [None]
        assert not pub._waiting
    finally:
        await pub.close()
        await nc.close()


async def test_unstarted_publisher_says_so() -> None:
    with pytest.raises(AssertionError, match="start"):
        await NatsPublisher().publish_batch([])


# -- runs: order per aggregate --------------------------------------------------------------

class _FakeMsg:
    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data, self.headers = subject, data, None


class _FakeNats:
    """Stands in for nats-py's Client: records every publish and answers them in random order
    (across all outstanding messages, so acks of different runs interleave), failing the event
    ids in ``refuse`` with a "too large" error answer and never answering those in ``silent``.
    It checks, at every send, that the aggregate's previous event was acked as stored."""

    max_payload = 1024 * 1024
    prefix = "_INBOX.fake."

    def __init__(self, pub: NatsPublisher, seed: int, refuse: frozenset[int] = frozenset(),
                 silent: frozenset[int] = frozenset()) -> None:
        import random

        self.pub = pub
        self.rng = random.Random(seed)
        self.refuse, self.silent = refuse, silent
        self.sent: list[int] = []
        self.outstanding: list[tuple[int, str]] = []
        self.stored: set[int] = set()
        self.previous: dict[int, int | None] = {}   # event id -> the id before it in its aggregate
        self.violations: list[str] = []
        self.sent_at_first_ack: int | None = None

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers: dict[str, str] | None = None) -> None:
        assert headers is not None
        i = int(headers["Outbox-Id"])
        before = self.previous[i]
        if before is not None and before not in self.stored:
            self.violations.append(f"{i} sent before {before} was acked as stored")
        self.sent.append(i)
        self.outstanding.append((i, reply))

    async def answer(self) -> None:
        """Answer one outstanding message at random, forever (cancel it)."""
        while True:
            await asyncio.sleep(0)
            if not self.outstanding:
                continue
            i, reply = self.outstanding.pop(self.rng.randrange(len(self.outstanding)))
            if self.sent_at_first_ack is None:
                self.sent_at_first_ack = len(self.sent)
            if i in self.silent:
                continue
            if i in self.refuse:
                data = orjson.dumps({"error": {"code": 400, "err_code": 10054,
                                               "description": "message size exceeds maximum allowed"}})
            else:
                self.stored.add(i)
                data = orjson.dumps({"stream": "S", "seq": len(self.stored)})
            await self.pub._on_ack(_FakeMsg(reply, data))  # type: ignore[arg-type]


def _fake_publisher(seed: int, ack_timeout: float = 2.0, **kw: Any) -> tuple[NatsPublisher, _FakeNats]:
    pub = NatsPublisher(ack_timeout=ack_timeout)
    fake = _FakeNats(pub, seed, **kw)
    pub.nc = fake  # type: ignore[assignment]
    pub.js = object()  # type: ignore[assignment]
    pub._reply_prefix, pub._reply_prefix_len = fake.prefix, len(fake.prefix)
    return pub, fake


def _interleaved(aggregates: dict[str, int]) -> list[OutboxEvent]:
    """Events of several aggregates, ids ascending, aggregates interleaved round-robin (as a
    claim ORDER BY id returns them)."""
    out: list[OutboxEvent] = []
    left = dict(aggregates)
    while any(left.values()):
        for agg in aggregates:
            if left[agg]:
                left[agg] -= 1
                out.append(event(len(out) + 1, "fake.x", aggregate_id=agg))
    return out


@pytest.mark.parametrize("seed", range(20))
async def test_a_run_sends_event_k_plus_1_only_after_k_is_acked_and_stops_at_its_first_failure(seed: int) -> None:
    events = _interleaved({"a": 6, "b": 6, "c": 1, "d": 4})
    by_agg: dict[str, list[int]] = {}
    for e in events:
        by_agg.setdefault(e.aggregate_id, []).append(e.id)
    a, b, c, d = by_agg["a"], by_agg["b"], by_agg["c"], by_agg["d"]
    # a: its 3rd event is refused as too large; b: its 2nd event is never answered (times out).
    pub, fake = _fake_publisher(seed, ack_timeout=0.3, refuse=frozenset({a[2]}), silent=frozenset({b[1]}))
    for ids in by_agg.values():
        for n, i in enumerate(ids):
            fake.previous[i] = ids[n - 1] if n else None
    answering = asyncio.ensure_future(fake.answer())
    try:
        out = dict(zip((e.id for e in events), await pub.publish_batch(events)))
    finally:
        answering.cancel()
    assert fake.violations == []
    assert [type(out[i]).__name__ for i in a] == ["NoneType", "NoneType", "PermanentError", "NotSent", "NotSent",
                                                  "NotSent"]
    assert [type(out[i]).__name__ for i in b] == ["NoneType", "TimeoutError", "NotSent", "NotSent", "NotSent",
                                                  "NotSent"]
    assert [out[i] for i in c + d] == [None] * 5
    # What followed a failure in its run never left the process.
    assert set(fake.sent) == {*a[:3], *b[:2], *c, *d}
    assert fake.sent.count(a[2]) == 1 and len(fake.sent) == len(set(fake.sent))
    # Runs are pipelined: the first event of every run went out before the first ack came back.
    assert fake.sent_at_first_ack == 4
    assert not pub._waiting


async def test_single_event_runs_are_all_sent_before_the_first_ack() -> None:
    events = [event(i, "fake.x") for i in range(1, 501)]   # 500 aggregates, one event each
    pub, fake = _fake_publisher(0)
    fake.previous = {e.id: None for e in events}
    answering = asyncio.ensure_future(fake.answer())
    try:
        out = await pub.publish_batch(events)
    finally:
        answering.cancel()
    assert out == [None] * 500
    assert fake.sent_at_first_ack == 500


async def test_headers_count_toward_max_payload(nats_server: Any) -> None:
    """A message whose payload fits but whose headers push it over max_payload is refused here
    as permanent: sent, the server would answer -ERR and close the connection for good."""
    stream = await make_stream(nats_server.url)
    pub = NatsPublisher(nats_server.url, ack_timeout=5)
    await pub.start()
    try:
        assert pub.nc is not None
        limit = pub.nc.max_payload
        subject = f"{stream.prefix}.order.created"
        fits = event(1, subject, payload=b"x" * (limit - 400))
        over = event(2, subject, payload=b"x" * (limit - 100), aggregate_id="other")
        after = event(3, subject)
        out = await pub.publish_batch([fits, over, after])
        assert out[0] is None and out[2] is None
        assert isinstance(out[1], PermanentError) and "max_payload" in str(out[1]) and "headers" in str(out[1])
        assert await pub.publish_batch([event(4, subject)]) == [None], "the connection is still usable"
        info = await stream.js.stream_info(stream.name)
        assert info.state.messages == 3
    finally:
        await pub.close()
        await stream.nc.close()
