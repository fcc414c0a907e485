"""cancel_all stops a task that lets a cancellation slip by (as asyncio.wait_for does on 3.11)."""

from __future__ import annotations

import asyncio

from outboxpg.relay.tasks import cancel_all


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
