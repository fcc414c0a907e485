"""Runs sent as JetStream atomic batches (nats-server 2.12+, streams with ``allow_atomic``).

Sequential acks cost a round trip per event (on file storage about 4,000 events/s for one hot
aggregate). A run of at least ``atomic_min_run`` events whose subjects all go to one stream that
allows atomic publish is sent instead as JetStream atomic batches: chunks of up to 1,000 events
(the server's limit), each message with ``Nats-Batch-Id`` (one per chunk) and
``Nats-Batch-Sequence`` 1..n, the last with ``Nats-Batch-Commit: 1`` and the only reply subject;
the server stores the whole chunk or none of it and answers the commit. Why order holds: (1) a
chunk holds consecutive events of the run in id order and the server stores them in
batch-sequence order, all or none (a lost, refused or out-of-sequence message abandons the
batch: nothing of it is stored); (2) chunk i+1 leaves this process only after chunk i's commit
ack said stored, so it is stored after chunk i, and its first event's predecessor (the last of
chunk i) is in the stream; (3) the run's first chunk starts at the aggregate's first unfinished
event, whose predecessors the stream holds (as for sequential acks). So the stream gets a prefix
of the run, chunk by chunk, never a gap.

A chunk that fails (refused, no commit ack in time, connection trouble) is reported
conservatively: nothing of it is known stored, so its first event fails (an ordinary failure,
retried, even when the refusal was "too large": which message it was is not known) and the rest
of the run is ``NotSent``. A retried run (any event with attempt > 1: the chunk might have been
stored after all) is sent with sequential acks, where JetStream's dedup drops what is already
stored; a batch would instead be refused whole for a stored Nats-Msg-Id. A retry cannot miss
this: the claim starts the run at the failed event, whose attempt is then at least 2.
Which stream a subject goes to, and whether it allows atomic publish, is looked up with the
JetStream API and kept for a while (captures.py; dropped at once when a batch is refused).

When batches pay: on file storage a commit costs a few ms (the server stages the batch in a
store of its own) and commits to a stream do not overlap, so short runs are faster with
sequential acks (hence ``atomic_min_run``), and so are many long runs at once: sequential acks
pipeline across runs, so 20 runs of 100 in flight (200 busy aggregates) cost about 100 round
trips, where 20 commits queue up (measured: 12,600 events/s batched against 19,300 sequential).
Batches are used only while at most ``atomic_max_runs`` runs of ``atomic_min_run`` or more are
in flight in this publisher, counting the new batch's: the case of a few hot aggregates, where
sequential acks cost a round trip per event. That also keeps this publisher's open batches far
below the server's limit (50 per stream).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import nats.js.errors

from outboxpg.events import OutboxEvent
from outboxpg.relay.nats.captures import SubjectCache
from outboxpg.relay.nats.connection import NatsConnection
from outboxpg.relay.nats.headers import BATCH_HEADER_BYTES
from outboxpg.relay.nats.runs import Batch, InFlight, Run
from outboxpg.relay.publishers import PermanentError
from outboxpg.text import describe

__all__ = ["AtomicBatches"]

log = logging.getLogger("outboxpg.nats")

_BATCH_MAX = 1000               # messages per atomic batch (the server's streamMaxAtomicBatchSize)


class AtomicBatches:
    """Chooses the runs to send as atomic batches and sends them, chunk after chunk.
    ``headers(event, extra)``: the event's message headers, or the PermanentError that keeps
    it from being sent."""

    def __init__(self, connection: NatsConnection, inflight: InFlight, min_run: int | None, max_runs: int,
                 headers: Callable[[OutboxEvent, int], dict[str, str] | PermanentError]) -> None:
        self.connection = connection
        self.inflight = inflight
        self.min_run = min_run          # None: never
        self.max_runs = max_runs
        self.headers = headers
        self.streams = SubjectCache(self._look_up)   # subject -> its stream if it allows atomic publish

    async def choose(self, batch: Batch, runs: list[Run]) -> None:
        """Mark the runs to be sent as atomic batches (``messages`` set): long enough, while
        few long runs are in flight (see the module's docstring), first tries only (attempt 1:
        nothing of them can be in the stream yet), every subject going to one stream that allows
        atomic publish, every message fine with the batch headers. Everything else keeps
        sequential acks."""
        inflight = self.inflight
        events = batch.events
        min_run = self.min_run or 0
        long_runs = [run for run in runs if len(run.positions) >= min_run]
        for run in long_runs:
            run.long = True
        inflight.long_runs += len(long_runs)
        if not long_runs or inflight.long_runs > self.max_runs:
            return
        candidates = [run for run in long_runs if all(events[i].attempt <= 1 for i in run.positions)]
        if not candidates:
            return
        subjects = {events[i].subject for run in candidates for i in run.positions}
        # A lookup that failed (a timeout, no JetStream...) is not remembered: sequential this
        # time, asked again next time.
        found = await asyncio.gather(*map(self.streams.get, subjects), return_exceptions=True)
        streams = {s: None if isinstance(f, BaseException) else f for s, f in zip(subjects, found)}
        for run in candidates:
            names = {streams[events[i].subject] for i in run.positions}
            if len(names) != 1 or None in names:
                continue
            messages = []
            for i in run.positions:
                headers = self.headers(events[i], BATCH_HEADER_BYTES)
                if isinstance(headers, PermanentError):
                    break   # sequential acks give that event its own outcome
                messages.append(headers)
            else:
                run.messages = messages
                inflight.atomic_open += 1

    async def _look_up(self, subject: str) -> str | None:
        """The stream that captures ``subject`` if it allows atomic publish, else None."""
        connection = self.connection
        assert connection.js is not None
        try:
            name = await connection.js.find_stream_name_by_subject(subject)
            info = await connection.js.stream_info(name)
        except nats.js.errors.NotFoundError:
            name = None   # no stream: the sequential publish says so, event by event
        except Exception as exc:
            log.debug("event=stream_lookup_failed subject=%s error=%r", subject, str(exc))
            raise
        else:
            if not info.config.allow_atomic:
                name = None
        return name

    async def send_chunk(self, run: Run) -> None:
        """Send ``positions[next:]``, up to _BATCH_MAX of them, as one atomic batch; only the
        commit (the last message) has a reply subject: the server answers it for the whole."""
        batch = run.batch
        if batch.closed:
            return
        messages = run.messages
        assert messages is not None
        start = run.next
        end = min(start + _BATCH_MAX, len(run.positions))
        batch_id = uuid.uuid4().hex
        token = self.inflight.wait_for(run)
        run.chunk_end = end
        connection = self.connection
        events, positions, publish = batch.events, run.positions, connection.nc.publish  # type: ignore[union-attr]
        if batch.sent_ns is not None:
            now = time.time_ns()
            for n in range(start, end):
                batch.sent_ns[positions[n]] = now
        try:
            for n in range(start, end):
                event = events[positions[n]]
                # The batch's headers first, as the outbox's own come before the row's (headers.py).
                if n + 1 < end:
                    headers = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(n - start + 1), **messages[n]}
                    await publish(event.subject, event.payload, headers=headers)
                else:
                    headers = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(n - start + 1),
                               "Nats-Batch-Commit": "1", **messages[n]}
                    await publish(event.subject, event.payload, reply=connection.reply_prefix + token,
                                  headers=headers)
        except Exception as exc:  # noqa: BLE001 - connection trouble (the messages were checked)
            # What was sent is an incomplete batch: the server stores none of it.
            self.inflight.forget(run, token)
            self.refused(run, exc)

    async def answered(self, run: Run, outcome: BaseException | None) -> None:
        """The server's answer to the chunk's commit: stored, then the next chunk goes out (or
        the run is finished), else the chunk is refused."""
        if outcome is not None:
            self.refused(run, outcome, answered=True)
            return
        # The whole chunk is stored: only now may the next chunk go out.
        done_ns = run.batch.done_ns
        if done_ns is not None:
            now = time.time_ns()
            for n in range(run.next, run.chunk_end):
                done_ns[run.positions[n]] = now
        run.next, run.chunk_end = run.chunk_end, 0
        if run.next < len(run.positions):
            await self.send_chunk(run)
        else:
            self.inflight.finish(run, None)

    def refused(self, run: Run, outcome: BaseException, answered: bool = False) -> None:
        """A chunk not known stored: its first event fails (ordinarily: a retry goes one by one
        and finds the culprit), the rest of the run is not sent."""
        if answered:
            # The server's answer to the commit. A PermanentError too becomes an ordinary
            # failure: which message of the batch was too large is not known.
            outcome = RuntimeError(f"atomic batch of {run.chunk_end - run.next} events refused, nothing of it "
                                   f"stored, to be retried one by one: {describe(outcome, whole=True)}")
        # Ask again which stream takes these subjects, and whether it still allows atomic
        # publish (10174: no longer), before the next batch to them.
        events = run.batch.events
        for i in run.positions:
            self.streams.forget(events[i].subject)
        self.inflight.finish(run, outcome)
