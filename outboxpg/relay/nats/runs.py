"""A publish_batch() call in flight: its events' outcomes, its runs (one aggregate's events each)
and how far each got, the reply tokens waiting for an answer, and how a run ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import not_sent_after

__all__ = ["Batch", "InFlight", "Run"]


class Batch:
    """One publish_batch() call: its events, their outcomes, and how many runs are unfinished."""

    __slots__ = ("events", "outcomes", "open", "done", "closed", "sent_ns", "done_ns")

    def __init__(self, events: Sequence[OutboxEvent], done: asyncio.Future[None], timed: bool = False) -> None:
        self.events = events
        self.outcomes: list[BaseException | None] = [None] * len(events)
        # With tracing: when each event was sent and answered (time.time_ns(); 0: not yet).
        self.sent_ns: list[int] | None = [0] * len(events) if timed else None
        self.done_ns: list[int] | None = [0] * len(events) if timed else None
        self.open = 0          # runs not finished yet
        self.done = done       # set when ``open`` reaches 0
        self.closed = False    # the batch stopped waiting (ack_timeout or cancelled): send nothing more


class Run:
    """One aggregate's events in a batch (positions in id order) and how far it got: the event at
    ``positions[next]`` is the one in flight (``token`` set) or about to be sent. Sent as atomic
    batches when ``messages`` is set (each event's headers, checked); then ``positions[next:
    chunk_end]`` is the chunk in flight, and ``positions[next]`` what fails if it does."""

    __slots__ = ("batch", "positions", "next", "token", "finished", "messages", "chunk_end", "long")

    def __init__(self, batch: Batch, positions: list[int]) -> None:
        self.batch = batch
        self.positions = positions
        self.next = 0
        self.token: str | None = None
        self.finished = False
        self.messages: list[dict[str, str]] | None = None
        self.chunk_end = 0
        self.long = False   # counted in InFlight.long_runs


class InFlight:
    """The runs of every batch in flight in one publisher: which one each reply token answers
    (``waiting``), how many are long and how many go as atomic batches."""

    def __init__(self) -> None:
        self.waiting: dict[str, Run] = {}   # reply token -> the run whose event (or chunk) it answers
        self._token = 0
        self.atomic_open = 0   # runs being sent as atomic batches right now
        self.long_runs = 0     # runs of atomic_min_run or more in flight, however sent

    def wait_for(self, run: Run) -> str:
        """A new reply token for the run's next publish (or chunk)."""
        self._token += 1
        token = str(self._token)
        self.waiting[token] = run
        run.token = token
        return token

    def forget(self, run: Run, token: str) -> None:
        self.waiting.pop(token, None)
        if run.token == token:
            run.token = None

    def finish(self, run: Run, outcome: BaseException | None) -> None:
        """End the run: ``outcome`` for the event at ``positions[next]`` (None: the run's last
        event, stored), NotSent for the events after it."""
        if run.finished:
            return
        run.finished = True
        run.token = None
        if run.messages is not None:
            self.atomic_open -= 1
        if run.long:
            self.long_runs -= 1
        batch = run.batch
        positions = run.positions
        if outcome is not None:
            outcomes = batch.outcomes
            outcomes[positions[run.next]] = outcome
            if batch.done_ns is not None:
                batch.done_ns[positions[run.next]] = time.time_ns()
            not_sent_after(batch.events, positions[run.next + 1:], batch.events[positions[run.next]].id, outcomes)
        batch.open -= 1
        if batch.open == 0 and not batch.done.done():
            batch.done.set_result(None)
