"""Events being published at once across the databases of one relay process (``outboxpg-worker``
over several databases): a global budget, handed out in turn to the databases waiting for some of
it, round robin over databases (not over batches). The databases share one publisher (one NATS
connection): without a global budget the events on it add up with the number of databases, and
each batch queues behind all the others; without the round robin, a database with a deep
backlog, whose batches always wait, would take all that is freed before a quieter database's
turn came.

A batch takes as many units as it has events (a batch larger than the whole budget takes all of
it), so a quiet database's batch of a few events fits beside a backlog's batches of 500 without
waiting, while many busy databases share the budget in turn. The budget is held while a batch is
published, not while it is claimed or reported: a database whose statements hang (down, paused,
locked) holds none of it, and slows nobody else. Each database's Worker also keeps its own
``--concurrency`` limit on its batches claimed and not yet reported.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Hashable

__all__ = ["FairSlots"]


class FairSlots:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"events in flight across databases must be at least 1, got {limit}")
        self.limit = limit
        self.used = 0
        # The databases waiting, in turn order; each with its waiters: (units, future).
        self._waiting: OrderedDict[Hashable, deque[tuple[int, asyncio.Future[None]]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def units(self, n: int) -> int:
        """What a batch of ``n`` events takes: n, at least 1, at most the whole budget."""
        return max(1, min(n, self.limit))

    async def acquire(self, who: Hashable, n: int = 1) -> int:
        """Take ``n`` units (see units()) for ``who``: at once while they are free and nobody
        waits, else in turn. Returns what was taken, to give back with release(). Cancelled
        while waiting: nothing is kept (units handed over just then are passed on)."""
        units = self.units(n)
        if not self._waiting and self.used + units <= self.limit:
            self.used += units
            return units
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (units, fut)
        self._waiting.setdefault(who, deque()).append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(units)          # handed over as we were cancelled: pass them on
            else:
                queue = self._waiting.get(who)
                if queue is not None and entry in queue:
                    queue.remove(entry)
                    if not queue:
                        del self._waiting[who]
                self._hand_out()             # a smaller waiter behind may fit now
            raise
        return units

    def release(self, units: int = 1) -> None:
        """Give ``units`` back, and hand out what is free in turn: the database at the head of
        the turn order gets its next batch's units as soon as they are free (nobody behind it
        overtakes it, so a large batch is never starved by small ones), then goes to the back
        of the order if it has more batches waiting."""
        self.used -= units
        self._hand_out()

    def _hand_out(self) -> None:
        while self._waiting:
            who, queue = next(iter(self._waiting.items()))
            units, fut = queue[0]
            if fut.done():                   # cancelled: its waiter removes it, skip it here
                queue.popleft()
                if not queue:
                    del self._waiting[who]
                continue
            if self.used + units > self.limit:
                return
            queue.popleft()
            del self._waiting[who]
            if queue:
                self._waiting[who] = queue   # its next batch, at the back of the turn order
            self.used += units
            fut.set_result(None)
