"""NatsPublisher on its own, against a real nats-server: outcomes in order, duplicates, what each
kind of answer on the reply subject means, and timeouts. A core NATS responder stands in for
JetStream where a test needs an answer JetStream would not give on demand."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats
import nats.js.errors
import orjson
import pytest
from jetstream import make_stream
from workers import event

from outboxpg.events import OutboxEvent
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.publishers import PermanentError


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
        assert not pub.inflight.waiting
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
        "coreok": b'{"ok": true}',                            # a core NATS service, not a stream
        "empty": b"",
        "noseq": orjson.dumps({"stream": "S"}),
        "otherstream": orjson.dumps({"stream": "NOT_HERE", "seq": 3}),   # no stream captures the subject
    }
    nc = await nats.connect(nats_server.url)

    async def respond(msg: Any) -> None:
        kind = msg.subject.rsplit(".", 1)[1]
        if kind == "silent":
            return
        await nc.publish(msg.reply, answers[kind])

    await nc.subscribe(f"{prefix}.*", cb=respond)
    await nc.flush()
    pub = NatsPublisher(nats_server.url, ack_timeout=0.5, streams={"S"})   # as if the start check found S
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
        for kind in ("coreok", "noseq"):
            assert type(out[kind]) is RuntimeError and "not a JetStream ack (no stream and seq)" in str(out[kind])
        assert type(out["empty"]) is RuntimeError and "unreadable JetStream ack b''" in str(out["empty"])
        assert type(out["otherstream"]) is RuntimeError and str(out["otherstream"]) == (
            f"answer naming stream 'NOT_HERE' is not a JetStream ack for '{prefix}.otherstream' (no stream captures "
            "it): not known stored")
        assert not pub.inflight.waiting, "a timed-out publish is forgotten"
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
    pub = NatsPublisher(nats_server.url, ack_timeout=0.3, streams={"S"})
    await pub.start()
    try:
        slow, fast = await asyncio.gather(
            pub.publish_batch([event(i, f"{prefix}.slow") for i in range(3)]),
            pub.publish_batch([event(i, f"{prefix}.fast") for i in range(200)]))
        assert all(isinstance(o, TimeoutError) for o in slow)
        assert fast == [None] * 200
        await asyncio.sleep(0.6)   # the slow acks arrive now, for nobody
        assert await pub.publish_batch([event(1, f"{prefix}.fast")]) == [None]
        assert not pub.inflight.waiting
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
            await self.respond(i, reply)

    async def respond(self, i: int, reply: str) -> None:
        if i in self.silent:
            return
        if i in self.refuse:
            data = orjson.dumps({"error": {"code": 400, "err_code": 10054,
                                           "description": "message size exceeds maximum allowed"}})
        else:
            self.stored.add(i)
            data = orjson.dumps({"stream": "S", "seq": len(self.stored)})
        await self.pub._on_ack(_FakeMsg(reply, data))  # type: ignore[arg-type]


def _connect_fake(pub: NatsPublisher, fake: _FakeNats) -> None:
    """``fake`` in place of the client NatsPublisher.start() would connect."""
    connection = pub.connection
    connection.nc = fake  # type: ignore[assignment]
    connection.js = object()  # type: ignore[assignment]
    connection.reply_prefix, connection.reply_prefix_len = fake.prefix, len(fake.prefix)


def _fake_publisher(seed: int, ack_timeout: float = 2.0, **kw: Any) -> tuple[NatsPublisher, _FakeNats]:
    pub = NatsPublisher(ack_timeout=ack_timeout, streams={"S"})
    fake = _FakeNats(pub, seed, **kw)
    _connect_fake(pub, fake)
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
    assert not pub.inflight.waiting


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


# -- runs as atomic batches (fake server) ---------------------------------------------------

class _FakeAtomicNats(_FakeNats):
    """_FakeNats that also understands atomic batches as nats-server 2.12+ does: messages with
    Nats-Batch-Id are held until the one with Nats-Batch-Commit, then stored all together (or,
    if the batch holds an id in ``refuse``, none of them) and only the commit answered. It checks
    that a batch's first message goes out only once its predecessor is stored, and that a batch
    is one aggregate's consecutive events, in order, sequence 1..n."""

    def __init__(self, pub: NatsPublisher, seed: int, **kw: Any) -> None:
        super().__init__(pub, seed, **kw)
        self.open: dict[str, list[int]] = {}
        self.batches: list[list[int]] = []     # committed or refused, as sent
        self.held: dict[str, list[int]] = {}   # reply -> the batch its commit closes

    async def publish(self, subject: str, payload: bytes, reply: str = "", headers: dict[str, str] | None = None) -> None:
        assert headers is not None
        batch_id = headers.get("Nats-Batch-Id")
        if batch_id is None:
            await super().publish(subject, payload, reply, headers)
            return
        i = int(headers["Outbox-Id"])
        ids = self.open.setdefault(batch_id, [])
        if int(headers["Nats-Batch-Sequence"]) != len(ids) + 1:
            self.violations.append(f"{i}: batch sequence {headers['Nats-Batch-Sequence']} after {len(ids)}")
        before = self.previous[i]
        if not ids and before is not None and before not in self.stored:
            self.violations.append(f"batch starting at {i} sent before {before} was acked as stored")
        if ids and before != ids[-1]:
            self.violations.append(f"{i} follows {ids[-1]} in a batch, not its predecessor {before}")
        ids.append(i)
        self.sent.append(i)
        if headers.get("Nats-Batch-Commit") == "1":
            assert reply, "the commit carries the reply subject"
            self.batches.append(self.open.pop(batch_id))
            self.held[reply] = ids
            self.outstanding.append((ids[0], reply))
        elif reply:
            self.violations.append(f"{i}: a reply subject on a message before the commit")

    async def respond(self, i: int, reply: str) -> None:
        ids = self.held.pop(reply, None)
        if ids is None:
            await super().respond(i, reply)   # a plain publish
            return
        if self.silent & set(ids):
            return
        if self.refuse & set(ids):
            data = orjson.dumps({"error": {"code": 400, "err_code": 10054,
                                           "description": "message size exceeds maximum allowed"}})
        else:
            self.stored.update(ids)
            data = orjson.dumps({"stream": "S", "seq": len(self.stored), "batch": "b", "count": len(ids)})
        await self.pub._on_ack(_FakeMsg(reply, data))  # type: ignore[arg-type]


def _fake_atomic_publisher(seed: int, events: list[OutboxEvent], ack_timeout: float = 2.0, min_run: int = 4,
                           **kw: Any) -> tuple[NatsPublisher, _FakeAtomicNats]:
    pub = NatsPublisher(ack_timeout=ack_timeout, atomic_min_run=min_run, streams={"S"})
    fake = _FakeAtomicNats(pub, seed, **kw)
    _connect_fake(pub, fake)
    pub.connection.atomic_server = True
    pub.atomic.streams.remember("fake.x", "S", ttl=float("inf"))   # as if looked up: a stream with allow_atomic
    by_agg: dict[str, list[int]] = {}
    for e in events:
        by_agg.setdefault(e.aggregate_id, []).append(e.id)
    for ids in by_agg.values():
        for n, i in enumerate(ids):
            fake.previous[i] = ids[n - 1] if n else None
    return pub, fake


@pytest.mark.parametrize("seed", range(10))
async def test_long_runs_go_as_atomic_batches_chunk_after_chunk_and_a_refused_chunk_fails_its_first(seed: int) -> None:
    # a: 2,300 events (chunks of 1000, 1000, 300); b: 6 (a batch), its 4th refused; c: 3 (too
    # short: sequential acks); d: 2,100 whose 2nd chunk is refused; e: 8 on their 2nd attempt.
    events = _interleaved({"a": 2300, "b": 6, "c": 3, "d": 2100})
    events += [event(len(events) + 1 + n, "fake.x", aggregate_id="e", attempt=2) for n in range(8)]
    by_agg: dict[str, list[int]] = {}
    for e in events:
        by_agg.setdefault(e.aggregate_id, []).append(e.id)
    a, b, c, d, e_ = (by_agg[k] for k in "abcde")
    pub, fake = _fake_atomic_publisher(seed, events, ack_timeout=10, refuse=frozenset({b[3], d[1500]}))
    pub.atomic.max_runs = 4   # a, b, d and e are long
    answering = asyncio.ensure_future(fake.answer())
    try:
        out = dict(zip((ev.id for ev in events), await pub.publish_batch(events)))
    finally:
        answering.cancel()
    assert fake.violations == []
    assert [len(x) for x in fake.batches if x[0] in a] == [1000, 1000, 300]
    assert [out[i] for i in a] == [None] * 2300
    assert fake.stored >= set(a)
    # b's only chunk was refused: nothing of it stored; its first event fails (ordinarily, not
    # dead: which message was too large is not known), the rest were not sent.
    assert not fake.stored & set(b)
    assert type(out[b[0]]) is RuntimeError and "atomic batch of 6 events refused" in str(out[b[0]])
    assert all(type(out[i]).__name__ == "NotSent" for i in b[1:])
    # d: its first chunk stored, the second refused as a whole; the third never sent.
    assert fake.stored & set(d) == set(d[:1000])
    assert type(out[d[1000]]) is RuntimeError and all(type(out[i]).__name__ == "NotSent" for i in d[1001:])
    assert not set(d[2000:]) & set(fake.sent)
    # c (short) and e (a retry) went one by one, with sequential acks.
    assert not any(x[0] in c or x[0] in e_ for x in fake.batches)
    assert [out[i] for i in c + e_] == [None] * 11
    assert not pub.inflight.waiting and pub.inflight.atomic_open == 0


async def test_an_unanswered_commit_times_out_its_chunk() -> None:
    events = _interleaved({"r0": 5, "r1": 5})
    by_agg: dict[str, list[int]] = {}
    for e in events:
        by_agg.setdefault(e.aggregate_id, []).append(e.id)
    pub, fake = _fake_atomic_publisher(0, events, ack_timeout=0.3, silent=frozenset({by_agg["r0"][2]}))
    answering = asyncio.ensure_future(fake.answer())
    try:
        out = dict(zip((ev.id for ev in events), await pub.publish_batch(events)))
    finally:
        answering.cancel()
    assert fake.violations == []
    assert sorted(x[0] for x in fake.batches) == [by_agg["r0"][0], by_agg["r1"][0]]
    r0 = by_agg["r0"]
    assert isinstance(out[r0[0]], TimeoutError) and all(type(out[i]).__name__ == "NotSent" for i in r0[1:])
    assert [out[i] for i in by_agg["r1"]] == [None] * 5
    assert not pub.inflight.waiting and pub.inflight.atomic_open == 0 and pub.inflight.long_runs == 0


async def test_batches_only_while_few_long_runs_are_in_flight() -> None:
    """Many long runs at once pipeline better with sequential acks: a batch whose long runs,
    with those in flight already, exceed atomic_max_runs is sent without atomic batches."""
    many = _interleaved({f"m{n}": 5 for n in range(3)})
    few = [event(1000 + n, "fake.x", aggregate_id="f") for n in range(5)]
    pub, fake = _fake_atomic_publisher(0, many + few)
    assert pub.atomic.max_runs == 2
    answering = asyncio.ensure_future(fake.answer())
    try:
        assert await pub.publish_batch(many) == [None] * 15
        assert fake.batches == [], "3 long runs: sequential acks"
        assert await pub.publish_batch(few) == [None] * 5
        assert fake.batches == [[e.id for e in few]]
        # Two batches at once: 3 + 1 long runs in flight: all sequential again.
        fake.batches.clear()
        more = [event(2000 + n, "fake.x", aggregate_id=f"x{n % 3}") for n in range(15)]
        more1 = [event(3000 + n, "fake.x", aggregate_id="y") for n in range(5)]
        fake.previous.update({e.id: None for e in more + more1})
        for batch in (more, more1):
            for n, e in enumerate(batch):
                same = [x.id for x in batch[:n] if x.aggregate_id == e.aggregate_id]
                fake.previous[e.id] = same[-1] if same else None
        assert await asyncio.gather(pub.publish_batch(more), pub.publish_batch(more1)) == [[None] * 15, [None] * 5]
        assert fake.batches == []
    finally:
        answering.cancel()
    assert fake.violations == []
    assert pub.inflight.long_runs == 0 and pub.inflight.atomic_open == 0
