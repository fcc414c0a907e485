"""FairSlots (outboxpg.relay.slots): the events being published at once by one process over
several databases, handed out in turn to the databases waiting for some."""

from __future__ import annotations

import asyncio

import pytest

from outboxpg.relay.slots import FairSlots


async def _taker(slots: FairSlots, who: str, n: int, order: list[str]) -> None:
    await slots.acquire(who, n)
    order.append(who)


def test_freed_units_go_round_robin_over_the_databases_waiting() -> None:
    async def main() -> list[str]:
        slots = FairSlots(10)
        held = await slots.acquire("busy", 10)
        order: list[str] = []
        # The busy database queues three batches of 10 before the quiet ones queue one each.
        tasks = [asyncio.create_task(_taker(slots, w, 10, order)) for w in ("busy", "busy", "busy", "q1", "q2")]
        await asyncio.sleep(0)
        assert slots.waiting == 5 and order == []
        for _ in range(5):
            slots.release(held)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        slots.release(held)
        assert slots.used == 0
        return order

    # Not busy, busy, busy, q1, q2 (first come, first served): each database in its turn.
    assert asyncio.run(main()) == ["busy", "q1", "q2", "busy", "busy"]


def test_a_small_batch_fits_beside_large_ones_without_waiting() -> None:
    async def main() -> None:
        slots = FairSlots(4000)
        for _ in range(4):
            assert await slots.acquire("backlog", 500) == 500
        assert await asyncio.wait_for(slots.acquire("quiet", 3), 0.1) == 3
        assert slots.used == 2003

    asyncio.run(main())


def test_a_large_batch_at_the_head_is_not_overtaken_and_one_over_the_budget_takes_all() -> None:
    async def main() -> None:
        slots = FairSlots(100)
        first = await slots.acquire("a", 60)
        big = asyncio.create_task(slots.acquire("b", 500))     # more than the budget: takes all 100
        await asyncio.sleep(0)
        small = asyncio.create_task(slots.acquire("c", 10))   # would fit, but b's turn comes first
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done()
        slots.release(first)
        assert await asyncio.wait_for(big, 1) == 100
        await asyncio.sleep(0.01)
        assert not small.done()
        slots.release(100)
        assert await asyncio.wait_for(small, 1) == 10
        slots.release(10)
        assert slots.used == 0

    asyncio.run(main())


def test_a_cancelled_waiter_keeps_nothing_and_passes_on_what_was_handed_to_it() -> None:
    async def main() -> None:
        slots = FairSlots(1)
        await slots.acquire("a")
        gone = asyncio.create_task(slots.acquire("b"))
        later = asyncio.create_task(slots.acquire("c"))
        await asyncio.sleep(0)
        slots.release()          # handed to b ...
        gone.cancel()            # ... which is cancelled before it runs: c gets it
        with pytest.raises(asyncio.CancelledError):
            await gone
        await asyncio.wait_for(later, 1)
        assert slots.used == 1 and slots.waiting == 0
        slots.release()
        assert slots.used == 0

    asyncio.run(main())


def test_a_cancelled_head_lets_a_waiter_behind_it_in() -> None:
    async def main() -> None:
        slots = FairSlots(10)
        await slots.acquire("a", 8)
        head = asyncio.create_task(slots.acquire("b", 10))
        await asyncio.sleep(0)
        behind = asyncio.create_task(slots.acquire("c", 2))
        await asyncio.sleep(0)
        assert not behind.done()
        head.cancel()
        with pytest.raises(asyncio.CancelledError):
            await head
        assert await asyncio.wait_for(behind, 1) == 2

    asyncio.run(main())


def test_a_budget_under_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairSlots(0)
