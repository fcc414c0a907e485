"""The publisher protocol's adapters, in this process: a plain function as a publisher (order
per aggregate, stop at a run's first failure), and loading ``--publisher module:callable``."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
from pathlib import Path

import pytest
from workers import event

from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import (
    FunctionPublisher,
    NotSent,
    PermanentError,
    PublisherNotFound,
    as_publisher,
    load_publisher,
    print_event,
)


def interleaved() -> list[OutboxEvent]:
    """a1 b2 a3 b4 a5: two aggregates."""
    return [event(i, "x", aggregate_id="ab"[(i - 1) % 2]) for i in range(1, 6)]


async def test_an_async_function_keeps_order_per_aggregate_and_stops_a_run_at_its_failure() -> None:
    calls: list[int] = []

    async def publish(e: OutboxEvent) -> None:
        calls.append(e.id)
        await asyncio.sleep(0)
        if e.id == 3:
            raise PermanentError("never")

    outcomes = await FunctionPublisher(publish).publish_batch(interleaved())
    assert [type(o).__name__ for o in outcomes] == ["NoneType", "NoneType", "PermanentError", "NoneType", "NotSent"]
    assert str(outcomes[4]) == "not sent: event 3 of its aggregate failed before it"
    assert 5 not in calls
    a_calls = [i for i in calls if i in (1, 3, 5)]
    assert a_calls == [1, 3], "one after another within a run"


async def test_a_sync_function_runs_in_order_and_skips_the_rest_of_a_failed_run() -> None:
    calls: list[int] = []

    def publish(e: OutboxEvent) -> None:
        calls.append(e.id)
        if e.id == 2:
            raise RuntimeError("down")

    outcomes = await FunctionPublisher(publish).publish_batch(interleaved())
    assert calls == [1, 2, 3, 5]
    assert outcomes[0] is None and outcomes[2] is None and outcomes[4] is None
    assert isinstance(outcomes[1], RuntimeError)
    assert isinstance(outcomes[3], NotSent) and "an earlier event of its aggregate failed" in str(outcomes[3])


async def test_an_async_call_over_the_timeout_fails_and_the_rest_of_its_run_is_not_sent() -> None:
    async def publish(e: OutboxEvent) -> None:
        if e.aggregate_id == "a":
            await asyncio.sleep(10)

    outcomes = await FunctionPublisher(publish, timeout=0.05).publish_batch(interleaved())
    assert isinstance(outcomes[0], TimeoutError) and "longer than 0.05s" in str(outcomes[0])
    assert [type(outcomes[i]).__name__ for i in (2, 4)] == ["NotSent", "NotSent"]
    assert [outcomes[i] for i in (1, 3)] == [None, None]


async def test_the_deadline_fails_the_call_running_keeps_what_was_published_and_stops_the_run() -> None:
    async def publish(e: OutboxEvent) -> None:
        if e.id == 3:
            await asyncio.sleep(10)     # a1 returns, a3 hangs, a5 never starts; b2, b4 return

    outcomes = await FunctionPublisher(publish, timeout=0.05).publish_batch(interleaved())
    assert [outcomes[i] for i in (0, 1, 3)] == [None, None, None]
    assert isinstance(outcomes[2], TimeoutError) and "longer than 0.05s" in str(outcomes[2])
    assert isinstance(outcomes[4], NotSent)


async def test_a_timeout_error_of_the_function_itself_is_its_outcome_before_the_deadline() -> None:
    async def publish(e: OutboxEvent) -> None:
        if e.id == 1:
            raise TimeoutError("the broker did not answer")

    started = asyncio.get_running_loop().time()
    outcomes = await FunctionPublisher(publish, timeout=5).publish_batch(interleaved())
    assert asyncio.get_running_loop().time() - started < 1
    assert str(outcomes[0]) == "the broker did not answer"
    assert [type(outcomes[i]).__name__ for i in (2, 4)] == ["NotSent", "NotSent"]
    assert [outcomes[i] for i in (1, 3)] == [None, None]


async def test_a_function_that_swallows_the_deadline_starts_nothing_after_it() -> None:
    calls: list[int] = []

    async def publish(e: OutboxEvent) -> None:
        calls.append(e.id)
        if e.id == 1:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)     # returns normally once cancelled: delivered, by contract

    outcomes = await FunctionPublisher(publish, timeout=0.05).publish_batch(interleaved())
    assert 3 not in calls and 5 not in calls, calls
    assert outcomes[0] is None and [type(outcomes[i]).__name__ for i in (2, 4)] == ["NotSent", "NotSent"]


async def test_a_batch_cancelled_from_outside_cancels_its_calls_and_says_so() -> None:
    cancelled: list[int] = []

    async def publish(e: OutboxEvent) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(e.id)
            raise

    batch = asyncio.ensure_future(FunctionPublisher(publish, timeout=5).publish_batch(interleaved()))
    await asyncio.sleep(0.05)
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert sorted(cancelled) == [1, 2]     # the first call of each run, in flight


def test_as_publisher_wraps_callables_and_refuses_the_rest() -> None:
    class Batches:
        async def publish_batch(self, events: list[OutboxEvent]) -> list[None]:
            return [None] * len(events)

    batches = Batches()
    assert as_publisher(batches) is batches
    assert isinstance(as_publisher(print), FunctionPublisher)
    with pytest.raises(TypeError, match="not a publisher: 42"):
        as_publisher(42)


def test_load_publisher_says_in_one_line_what_is_wrong(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mypub.py").write_text(textwrap.dedent("""
        def send(event):
            pass

        class Sender:
            async def publish_batch(self, events):
                return [None] * len(events)
    """))
    (tmp_path / "brokenpub.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(load_publisher("mypub:send"), FunctionPublisher)
    assert type(load_publisher("mypub:Sender")).__name__ == "Sender"   # a class is instantiated once
    with pytest.raises(PublisherNotFound, match="no module named 'nopub'"):
        load_publisher("nopub:send")
    cases = {"mypub": "must look like module:callable", "mypub:nothing": "module 'mypub' has no attribute 'nothing'",
             "brokenpub:send": "importing brokenpub failed: ModuleNotFoundError"}
    for spec, says in cases.items():
        with pytest.raises(ValueError, match=says) as raised:
            load_publisher(spec)
        assert not isinstance(raised.value, PublisherNotFound) and "\n" not in str(raised.value)
    for name in ("mypub", "brokenpub"):
        sys.modules.pop(name, None)


def test_print_event_prints_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    print_event(event(7, "shop.order.created", msg_id="m-7", payload=b'{"a": 1}'))
    assert capsys.readouterr().out == '7 shop.order.created msg_id=m-7 attempt=0 {"a": 1}\n'
