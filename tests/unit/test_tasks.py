"""cancel_all stops a task that lets a cancellation slip by (as asyncio.wait_for does on 3.11)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from outboxpg.relay.tasks import cancel_all, say_where_after, where_tasks_wait


async def _misses_one_cancel(seen: list[str]) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        seen.append("missed")       # what wait_for's race does: the request is gone
    while True:
        await asyncio.sleep(3600)   # the next sleep ends only at a second cancel()


async def _fails_on_the_way_out() -> None:
    try:
        await asyncio.sleep(3600)
    finally:
        raise RuntimeError("cleanup failed")


async def test_a_task_that_misses_a_cancel_is_cancelled_again() -> None:
    seen: list[str] = []
    task = asyncio.create_task(_misses_one_cancel(seen))
    other = asyncio.create_task(_fails_on_the_way_out())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all([task, other], every=0.05), 5)
    assert seen == ["missed"]
    assert task.cancelled() and other.done()


async def test_done_tasks_are_left_as_they_are() -> None:
    async def done() -> None:
        return None

    task = asyncio.create_task(done())
    await task
    await cancel_all([task])
    assert not task.cancelled()


async def test_say_where_after_names_each_waiting_task(caplog: pytest.LogCaptureFixture) -> None:
    async def stuck_in_here() -> None:
        await asyncio.sleep(3600)

    task = asyncio.create_task(stuck_in_here(), name="the-stuck-one")
    await asyncio.sleep(0)
    assert any(w.startswith("the-stuck-one: stuck_in_here (test_tasks.py:") for w in where_tasks_wait())
    with caplog.at_level(logging.WARNING, logger="outboxpg.worker"):
        await say_where_after(0.01, "w1")
    (record,) = caplog.records
    assert "event=shutdown_slow worker=w1" in record.getMessage() and "the-stuck-one: stuck_in_here" in record.getMessage()
    await cancel_all([task])
