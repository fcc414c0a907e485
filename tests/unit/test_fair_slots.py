"""FairSlots (outboxpg.relay.slots): the publishing slots of one process over several databases,
handed out in turn to the databases waiting for one."""

from __future__ import annotations

import asyncio

import pytest

from outboxpg.relay.slots import FairSlots


async def _taker(slots: FairSlots, who: str, order: list[str]) -> None:
    await slots.acquire(who)
    order.append(who)


def test_freed_slots_go_round_robin_over_the_databases_waiting() -> None:
    async def main() -> list[str]:
        slots = FairSlots(1)
        await slots.acquire("busy")
        order: list[str] = []
        # The busy database queues three batches before the quiet ones queue one each.
        tasks = [asyncio.create_task(_taker(slots, w, order)) for w in ("busy", "busy", "busy", "q1", "q2")]
        await asyncio.sleep(0)
        assert slots.waiting == 5 and order == []
        for _ in range(5):
            slots.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        slots.release()
        assert slots.used == 0
        return order

    # Not busy, busy, busy, q1, q2 (first come, first served): each database in its turn.
    assert asyncio.run(main()) == ["busy", "q1", "q2", "busy", "busy"]


def test_free_slots_are_taken_at_once_up_to_the_limit() -> None:
    async def main() -> None:
        slots = FairSlots(2)
        await slots.acquire("a")
        await slots.acquire("a")
        waiting = asyncio.create_task(slots.acquire("b"))
        await asyncio.sleep(0.01)
        assert not waiting.done() and slots.used == 2
        slots.release()
        await asyncio.wait_for(waiting, 1)
        assert slots.used == 2

    asyncio.run(main())


def test_a_cancelled_waiter_keeps_no_slot_and_passes_on_one_handed_to_it() -> None:
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


def test_a_limit_under_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairSlots(0)
