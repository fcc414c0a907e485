"""Answers about a subject's stream, asked of the JetStream API and remembered for a while.

Two questions are asked per subject: which stream captures it (an answer naming a stream the
worker did not check at start counts as an ack only if that stream captures the event's subject,
publisher.py), and which stream takes its atomic batches (batches.py). Each answer is kept for
TTL seconds, and the callers that need one at the same time share one lookup.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["SubjectCache", "TTL"]

TTL = 30.0                    # seconds an answer about a subject is trusted
_MAX_SUBJECTS_KNOWN = 10_000  # subjects remembered at once (then forgotten, all)


class SubjectCache:
    """``look_up(subject)``: the answer to remember (a stream name or None); if it raises, the
    callers waiting for it get the exception and nothing is remembered."""

    def __init__(self, look_up: Callable[[str], Awaitable[str | None]]) -> None:
        self._look_up = look_up
        self._known: dict[str, tuple[str | None, float]] = {}   # subject -> (answer, until)
        self._lookups: dict[str, asyncio.Task[str | None]] = {}

    async def get(self, subject: str) -> str | None:
        known = self._known.get(subject)
        if known is not None and known[1] > asyncio.get_running_loop().time():
            return known[0]
        task = self._lookups.get(subject)
        if task is None:
            task = self._lookups[subject] = asyncio.ensure_future(self._remembered(subject))
            task.add_done_callback(lambda _: self._lookups.pop(subject, None))
        return await asyncio.shield(task)

    def forget(self, subject: str) -> None:
        self._known.pop(subject, None)

    def remember(self, subject: str, answer: str | None, ttl: float = TTL) -> None:
        if len(self._known) >= _MAX_SUBJECTS_KNOWN:
            self._known.clear()
        self._known[subject] = (answer, asyncio.get_running_loop().time() + ttl)

    async def _remembered(self, subject: str) -> str | None:
        answer = await self._look_up(subject)
        self.remember(subject, answer)
        return answer
