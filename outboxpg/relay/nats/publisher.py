"""NatsPublisher: publishing a claimed batch to NATS JetStream with nats-py, in order per aggregate.

Every event goes to its row's subject with ``Nats-Msg-Id`` = the row's msg_id, so JetStream
drops a re-publish of the same event (after a crash or a lost ack) within the stream's
duplicate window.

Order per aggregate ("sequential acks"). A claimed batch holds runs: consecutive events of one
aggregate, in id order. Within a run, event k+1 is sent only after JetStream's ack for event k
said stored (or duplicate: stored before); across runs everything is pipelined, so a batch of
500 single-event runs costs one round trip, as before. Pipelining inside a run would not be
safe: messages written before a connection drops can be lost while those queued behind them
are sent after the reconnect, storing k+1 without k; and an error answer for k (too large, say)
does not stop k+1. With sequential acks, the proof is short: k+1 leaves this process only after
the server said k is in the stream, so k+1 is stored after k, whatever happens to the
connection; and a retry of the run starts again from its first unpublished event, whose
predecessors the stream already holds (the SQL never hands out an event while an earlier one of
its aggregate is unfinished, except inside one run). A run stops at its first failure: that
event's outcome is the failure, the rest of the run get ``NotSent`` (the worker releases them).
The whole batch is bounded by ``ack_timeout``: an event still unacked then gets a TimeoutError,
the rest of its run ``NotSent``. Long runs of a few hot aggregates go as atomic batches instead
where the server and the stream allow it (batches.py).

Published means stored: an answer counts only if it is a JetStream PubAck (acks.py) from a
stream in ``streams`` (the worker passes the ones its start check found: the stream of
``<subject_prefix>.>`` and those capturing the explicit subjects), or from a stream JetStream
says captures the event's subject (captures.py). A core
NATS service answering on the subject, or an answer naming a stream that does not capture it,
is a failure.

Everything else that is not a never-sendable message (headers.py) nor an answer no retry can fix
(acks.py), such as no ack in time, no stream answering or the connection down, is an ordinary
failure, retried with backoff. With an OpenTelemetry SDK, a span per event from its send to its
answer (outboxpg.relay.tracing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from outboxpg.cloudevents import CloudEvents
from outboxpg.events import OutboxEvent, runs_of
from outboxpg.relay.nats.acks import AckReader, OtherStream
from outboxpg.relay.nats.batches import AtomicBatches
from outboxpg.relay.nats.captures import SubjectCache
from outboxpg.relay.nats.connection import NatsConnection, parse_servers
from outboxpg.relay.nats.headers import message_headers
from outboxpg.relay.nats.runs import Batch, InFlight, Run
from outboxpg.relay.publishers import NotSent, PermanentError
from outboxpg.relay.tracing import PublishTracer, publish_tracer
from outboxpg.text import describe

__all__ = ["NatsPublisher"]

log = logging.getLogger("outboxpg.nats")


class NatsPublisher:
    """JetStream publisher. ``await start()`` connects (retrying until ``connect_deadline``).

    ``on_duplicate(stream_seq)``, if given, is called for every ack that says JetStream already
    had the message (a re-publish dropped by deduplication). ``duplicates`` counts them.
    """

    def __init__(self, url: str | Sequence[str] = "nats://127.0.0.1:4222", *, ack_timeout: float = 5.0,
                 max_pending: int = 10_000, connect_deadline: float | None = None,
                 on_duplicate: Callable[[int], None] | None = None, atomic_min_run: int | None = 32,
                 atomic_max_runs: int = 2, cloudevents: CloudEvents | None = None,
                 tracer_provider: Any = None, streams: Iterable[str] = ()) -> None:
        """``atomic_min_run``: runs at least this long go as atomic batches where the stream
        allows it (None: never), while at most ``atomic_max_runs`` such runs are in flight.
        ``cloudevents``: add its ce-* headers and content-type to every message (binary content
        mode, see outboxpg.cloudevents). ``tracer_provider``: an OpenTelemetry SDK
        TracerProvider to record a span per published event with (default: the global one, if
        it is an SDK's; see outboxpg.relay.tracing). ``streams``: the JetStream streams whose
        acks count at once (expect_streams adds more); an ack from any other stream counts only
        if JetStream says that stream captures the event's subject. A malformed ``url`` is a
        ValueError (see parse_servers)."""
        self.servers = parse_servers(url)
        self.cloudevents = cloudevents
        self.tracer_provider = tracer_provider
        self.tracer: PublishTracer | None = None   # set by start()
        self.ack_timeout = ack_timeout
        self.connect_deadline = connect_deadline
        self.connection = NatsConnection(self.servers, max_pending=max_pending, on_reply=self._on_ack,
                                         on_lost=self._on_lost)
        self.url = self.connection.url   # for log lines
        # Set while the client can publish (cleared while one closed for good is replaced): the
        # worker claims only while it is set.
        self.ready = self.connection.ready
        self.acks = AckReader(on_duplicate, streams)
        self.captures = SubjectCache(self._capturing_stream)
        self.inflight = InFlight()
        self.atomic = AtomicBatches(self.connection, self.inflight, atomic_min_run, atomic_max_runs, self._headers)

    def expect_streams(self, names: Iterable[str]) -> None:
        """Count the acks of these streams at once (the worker's start check found them)."""
        assert self.acks.streams is not None
        self.acks.streams.update(names)

    @property
    def nc(self) -> Client | None:
        return self.connection.nc

    @property
    def js(self) -> JetStreamContext | None:
        return self.connection.js

    @property
    def replacements(self) -> int:
        """Clients replaced after nats-py closed them for good."""
        return self.connection.replacements

    @property
    def duplicates(self) -> int:
        return self.acks.duplicates

    @property
    def run_publishing(self) -> str:
        """How runs keep their order; the worker logs it at start."""
        min_run = self.atomic.min_run
        if min_run is None or self.connection.nc is None:
            return "sequential-acks"
        if self.connection.atomic_server:
            return f"atomic-batch(min_run={min_run})+sequential-acks"
        version = self.connection.version
        shown = ".".join(map(str, version)) if version else "of unknown version"
        return f"sequential-acks (server {shown} has no atomic batch publish)"

    @property
    def closed(self) -> bool:
        """close() was called (the worker's /healthz fails while it runs)."""
        return self.connection.closed

    def health_problem(self) -> str | None:
        """Why the broker cannot take publishes now, or None (the worker's /readyz)."""
        return self.connection.problem()

    async def start(self) -> None:
        nc = self.connection.nc
        if nc is not None and not nc.is_closed:
            return   # started already (outboxpg-worker starts it before Worker.run() would)
        self.tracer = publish_tracer(self.tracer_provider)
        if self.tracer is not None:
            log.info("event=tracing note=%r", "recording an OpenTelemetry span per published event")
        await self.connection.connect(self.connect_deadline)

    async def close(self) -> None:
        await self.connection.close()

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        """Publish a claimed batch, in order per aggregate: each run's next event is sent only
        once JetStream acked the one before it; the runs themselves are all in flight at once.
        A run stops at its first failure: that event gets the failure, the rest ``NotSent``.
        Events still unacked ``ack_timeout`` after the start get a TimeoutError."""
        assert self.connection.js is not None and self.connection.nc is not None, \
            "NatsPublisher.start() was not awaited"
        if not self.ready.is_set():
            # The client was closed for good and is being replaced: wait for the new one, within
            # the batch's time. (The worker claims nothing meanwhile: this is a batch claimed before.)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready.wait(), self.ack_timeout)
            if not self.ready.is_set():
                closed = nats.errors.ConnectionClosedError()
                outcomes: list[BaseException | None] = [None] * len(events)
                for positions in runs_of(events):
                    outcomes[positions[0]] = closed
                    for i in positions[1:]:
                        outcomes[i] = NotSent("not sent: the NATS client was being replaced")
                return outcomes
        tracer = self.tracer
        started_ns = time.time_ns() if tracer is not None else 0
        batch = Batch(events, asyncio.get_running_loop().create_future(), timed=tracer is not None)
        runs = [Run(batch, positions) for positions in runs_of(events)]
        # Counted before the first send: an ack read while this loop yields (nats-py flushes
        # inline once its pending buffer is full) cannot finish the batch before every run started.
        batch.open = len(runs)
        try:
            async with asyncio.timeout(self.ack_timeout):
                if self.connection.atomic_server and self.atomic.min_run is not None:
                    await self.atomic.choose(batch, runs)
                # Short runs first: JetStream stores in the order messages arrive, so a quiet
                # aggregate's event is not queued behind the runs of busy ones. Order holds
                # within each run, whatever the order of the runs.
                for run in sorted(runs, key=lambda r: len(r.positions)):
                    if run.messages is not None:
                        await self.atomic.send_chunk(run)
                    else:
                        await self._send(run)
                if batch.open:
                    await batch.done
        except TimeoutError:
            pass
        finally:
            if batch.open:
                # Timed out, or this task was cancelled: forget the unanswered publishes, send
                # nothing more. The event in flight failed; the rest of its run was not sent.
                batch.closed = True
                for run in runs:
                    if run.finished:
                        continue
                    if run.token is not None:
                        self.inflight.waiting.pop(run.token, None)
                        self.inflight.finish(run, TimeoutError(f"no ack from JetStream within {self.ack_timeout:g}s"))
                    else:
                        self.inflight.finish(run, NotSent("not sent: the batch ran out of time first"))
        if tracer is not None:
            try:
                tracer.record(events, batch.outcomes, batch.sent_ns or [], batch.done_ns or [], started_ns)
            except Exception as exc:  # noqa: BLE001 - spans are a report: never fail a delivered batch over them
                log.warning("event=tracing_failed error=%r", describe(exc))
        return batch.outcomes

    async def _send(self, run: Run) -> None:
        """Send the run's event at ``positions[next]``, or finish the run if it cannot be sent."""
        batch = run.batch
        if batch.closed:
            return
        event = batch.events[run.positions[run.next]]
        headers = self._headers(event, 0)
        if isinstance(headers, PermanentError):
            self.inflight.finish(run, headers)
            return
        token = self.inflight.wait_for(run)
        if batch.sent_ns is not None:
            batch.sent_ns[run.positions[run.next]] = time.time_ns()
        connection = self.connection
        try:
            # nats-py queues the message; its flusher task writes everything queued at once.
            await connection.nc.publish(event.subject, event.payload,  # type: ignore[union-attr]
                                        reply=connection.reply_prefix + token, headers=headers)
        except (nats.errors.MaxPayloadError, nats.errors.BadSubjectError, nats.errors.BadHeaderError) as exc:
            self.inflight.forget(run, token)
            self.inflight.finish(run, PermanentError(describe(exc, whole=True)))
        except Exception as exc:  # noqa: BLE001 - connection trouble: an ordinary failure
            self.inflight.forget(run, token)
            self.inflight.finish(run, exc)

    def _headers(self, event: OutboxEvent, extra: int) -> dict[str, str] | PermanentError:
        return message_headers(event, self.cloudevents, self.connection.nc.max_payload or 0,  # type: ignore[union-attr]
                               extra)

    async def _on_ack(self, msg: Msg) -> None:
        run = self.inflight.waiting.pop(msg.subject[self.connection.reply_prefix_len:], None)
        if run is None:
            return   # the batch stopped waiting (ack_timeout): too late
        outcome = self.acks.outcome(msg.data, msg.headers)
        if isinstance(outcome, OtherStream):
            # run.token stays set meanwhile: if the batch runs out of time first, it fails the
            # event in flight as unanswered.
            outcome = await self._confirm_stream(run, outcome)
            if run.finished:
                return
        run.token = None
        if run.chunk_end:
            await self.atomic.answered(run, outcome)   # the answer to an atomic batch's commit
            return
        if outcome is not None:
            self.inflight.finish(run, outcome)
            return
        # Stored (or already stored): only now may the run's next event go out.
        if run.batch.done_ns is not None:
            run.batch.done_ns[run.positions[run.next]] = time.time_ns()
        run.next += 1
        if run.next < len(run.positions):
            await self._send(run)
        else:
            self.inflight.finish(run, None)

    async def _confirm_stream(self, run: Run, ack: OtherStream) -> BaseException | None:
        """None if JetStream says ``ack.stream`` captures the subject the answer is for (then
        the ack counts), else why the answer is not an ack for it."""
        events = run.batch.events
        subject = events[run.positions[(run.chunk_end or run.next + 1) - 1]].subject
        try:
            name = await self.captures.get(subject)
        except Exception as exc:  # noqa: BLE001 - timeout, no JetStream API...: not known stored
            return RuntimeError(f"answer from stream {ack.stream!r}, but which stream captures {subject!r} cannot "
                                f"be checked: {describe(exc)}")
        if name == ack.stream:
            self.acks.stored(ack.seq, ack.duplicate)
            return None
        captured = "no stream captures it" if name is None else f"stream {name!r} captures it"
        return RuntimeError(f"answer naming stream {ack.stream!r} is not a JetStream ack for {subject!r} "
                            f"({captured}): not known stored")

    async def _capturing_stream(self, subject: str) -> str | None:
        assert self.connection.js is not None
        try:
            return await self.connection.js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return None

    def _on_lost(self) -> None:
        """nats-py closed the client for good: the publishes waiting for an answer fail now."""
        lost = nats.errors.ConnectionClosedError()
        for token, run in list(self.inflight.waiting.items()):
            self.inflight.forget(run, token)
            if run.chunk_end:
                self.atomic.refused(run, lost)
            else:
                self.inflight.finish(run, lost)
