"""Batches being published at once across the databases of one relay process (``outboxpg-worker``
over several databases): a global limit, each freed slot handed to the next database waiting for
one, round robin over databases (not over batches). The databases share one publisher (one NATS
connection): without a global limit their batches on it add up with the number of databases,
and each batch queues behind all the others; without the round robin, a database with a deep
backlog, whose batches always wait for a slot, would take every one freed before a quieter
database's turn came.

A slot is held while a batch is published, not while it is claimed or reported: a database whose
statements hang (down, paused, locked) holds no slot, and slows nobody else. Each database's
Worker also keeps its own ``--concurrency`` limit on its batches claimed and not yet reported.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Hashable

__all__ = ["FairSlots"]


class FairSlots:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"batches in flight across databases must be at least 1, got {limit}")
        self.limit = limit
        self.used = 0
        # The databases waiting for a slot, in turn order; each with its waiters (one, in practice).
        self._waiting: OrderedDict[Hashable, deque[asyncio.Future[None]]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, who: Hashable) -> None:
        """A slot for ``who``: at once while some are free and nobody waits, else in turn.
        Cancelled while waiting: no slot is kept (one handed over just then is passed on)."""
        if self.used < self.limit and not self._waiting:
            self.used += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(who, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()          # handed over as we were cancelled: pass it on
            else:
                queue = self._waiting.get(who)
                if queue is not None and fut in queue:
                    queue.remove(fut)
                    if not queue:
                        del self._waiting[who]
            raise

    def release(self) -> None:
        """Give a slot back: straight to the database whose turn it is, if one waits (each database
        with more batches waiting goes to the back of the turn order after each slot)."""
        while self._waiting:
            who, queue = self._waiting.popitem(last=False)
            fut = queue.popleft()
            if queue:
                self._waiting[who] = queue     # its next waiter, at the back of the turn order
            if not fut.done():
                fut.set_result(None)           # the slot changes hands: self.used stays
                return
        self.used -= 1
