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
