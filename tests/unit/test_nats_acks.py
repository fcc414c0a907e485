"""What an answer on the reply subject means (AckReader), and how a run in flight ends (InFlight):
the failed event's outcome, NotSent for the rest of its run, the batch done when its last run is."""

from __future__ import annotations

import asyncio

import nats.js.errors
import orjson
import pytest
from workers import event

from outboxpg.relay.nats.acks import AckReader, OtherStream
from outboxpg.relay.nats.runs import Batch, InFlight, Run
from outboxpg.relay.publishers import NotSent, PermanentError


def error(code: int, err_code: int, description: str) -> bytes:
    return orjson.dumps({"error": {"code": code, "err_code": err_code, "description": description}})


def test_stored_and_duplicate_acks_are_successes_and_duplicates_are_counted() -> None:
    seen: list[int] = []
    acks = AckReader(on_duplicate=seen.append)
    assert acks.outcome(orjson.dumps({"stream": "S", "seq": 7}), None) is None
    assert acks.duplicates == 0 and seen == []
    assert acks.outcome(orjson.dumps({"stream": "S", "seq": 7, "duplicate": True}), None) is None
    assert acks.outcome(orjson.dumps({"stream": "S", "seq": 0, "duplicate": True}), None) is None
    assert acks.duplicates == 2 and seen == [7, 0]
    assert AckReader().outcome(orjson.dumps({"stream": "S", "seq": 1, "duplicate": True}), None) is None


def test_answers_that_no_retry_can_fix_are_permanent() -> None:
    for err_code, description in ((10054, "message size exceeds maximum allowed"),
                                  (10097, "header size exceeds maximum allowed of 64k")):
        outcome = AckReader().outcome(error(400, err_code, description), None)
        assert isinstance(outcome, PermanentError)
        assert str(outcome) == f"JetStream refused the message: {description}"


@pytest.mark.parametrize(("answer", "headers", "kind", "says"), [
    (error(400, 10060, "expected stream does not match"), None, nats.js.errors.BadRequestError,
     "expected stream does not match"),
    (error(503, 10008, "jetstream unavailable"), None, nats.js.errors.ServiceUnavailableError, "jetstream unavailable"),
    (b"", {"Status": "503"}, RuntimeError, "no JetStream stream captures this subject (no responders)"),
    (b"", {"Status": "408"}, RuntimeError, "JetStream answered with status 408"),
    (b"<html>", None, RuntimeError, "unreadable JetStream ack b'<html>': "),
    (b"[1, 2]", None, RuntimeError, "unreadable JetStream ack b'[1, 2]'"),
    (orjson.dumps({"error": "flat text"}), None, RuntimeError, "JetStream refused the message: 'flat text'"),
    # Published means stored (issue 25): only a PubAck naming a stream and a sequence counts.
    (b'{"ok": true}', None, RuntimeError, "not a JetStream ack (no stream and seq): b'{\"ok\": true}', so not known "
                                          "stored: does a service other than a JetStream stream answer on this subject?"),
    (b"{}", None, RuntimeError, "not a JetStream ack (no stream and seq)"),
    (b"", None, RuntimeError, "unreadable JetStream ack b''"),
    (orjson.dumps({"stream": "S", "duplicate": True}), None, RuntimeError, "not a JetStream ack"),
    (orjson.dumps({"stream": "", "seq": 1}), None, RuntimeError, "not a JetStream ack"),
    (orjson.dumps({"stream": "S", "seq": "1"}), None, RuntimeError, "not a JetStream ack"),
    (orjson.dumps({"stream": "S", "seq": True}), None, RuntimeError, "not a JetStream ack"),
])
def test_other_answers_are_ordinary_failures(answer: bytes, headers: dict[str, str] | None, kind: type,
                                             says: str) -> None:
    outcome = AckReader().outcome(answer, headers)
    assert type(outcome) is kind and not isinstance(outcome, PermanentError)
    assert says in str(outcome)


def test_an_ack_from_a_stream_not_expected_is_to_be_confirmed_and_not_counted_yet() -> None:
    seen: list[int] = []
    acks = AckReader(on_duplicate=seen.append, streams={"OUTBOX"})
    assert acks.outcome(orjson.dumps({"stream": "OUTBOX", "seq": 1}), None) is None
    other = acks.outcome(orjson.dumps({"stream": "BILLING", "seq": 4, "duplicate": True}), None)
    assert isinstance(other, OtherStream) and (other.stream, other.seq, other.duplicate) == ("BILLING", 4, True)
    assert acks.duplicates == 0 and seen == []
    acks.stored(other.seq, other.duplicate)   # once confirmed
    assert acks.duplicates == 1 and seen == [4]


async def test_a_run_that_fails_gives_its_failure_to_the_event_in_flight_and_notsent_to_the_rest() -> None:
    events = [event(i, "x", aggregate_id="ab"[i % 2]) for i in range(1, 7)]   # b a b a b a
    batch = Batch(events, asyncio.get_running_loop().create_future())
    a, b = Run(batch, [1, 3, 5]), Run(batch, [0, 2, 4])
    batch.open = 2
    inflight = InFlight()
    token = inflight.wait_for(a)
    assert inflight.waiting == {token: a} and a.token == token and inflight.wait_for(b) != token
    inflight.forget(a, token)
    assert a.token is None and token not in inflight.waiting
    a.next = 1                  # a's first event was stored, its second failed
    failure = RuntimeError("refused")
    inflight.finish(a, failure)
    assert batch.outcomes[3] is failure and isinstance(batch.outcomes[5], NotSent)
    assert batch.outcomes[1] is None and not batch.done.done()
    inflight.finish(a, RuntimeError("again"))   # a finished run stays as it ended
    assert batch.outcomes[3] is failure and batch.open == 1
    b.next = 2
    inflight.finish(b, None)    # b's last event stored
    assert batch.open == 0 and batch.done.done()
    assert [o is None for o in batch.outcomes] == [True, True, True, False, True, False]


def test_finishing_a_long_or_atomic_run_frees_its_place() -> None:
    loop = asyncio.new_event_loop()
    try:
        batch = Batch([event(1, "x")], loop.create_future())
        batch.open = 1
        run = Run(batch, [0])
        run.long, run.messages = True, [{}]
        inflight = InFlight()
        inflight.long_runs, inflight.atomic_open = 3, 1
        inflight.finish(run, None)
        assert (inflight.long_runs, inflight.atomic_open) == (2, 0)
    finally:
        loop.close()
