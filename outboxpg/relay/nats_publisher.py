"""Publishing to NATS JetStream with nats-py.

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
the rest of its run ``NotSent``.

Atomic batches (nats-server 2.12+, streams with ``allow_atomic``). Sequential acks cost a round
trip per event (on file storage about 4,000 events/s for one hot aggregate). A run of at least
``atomic_min_run`` events whose subjects all go to one stream that allows atomic publish is sent
instead as JetStream atomic batches: chunks of up to 1,000 events (the server's limit), each
message with ``Nats-Batch-Id`` (one per chunk) and ``Nats-Batch-Sequence`` 1..n, the last with
``Nats-Batch-Commit: 1`` and the only reply subject; the server stores the whole chunk or none
of it and answers the commit. Why order holds: (1) a chunk holds consecutive events of the run
in id order and the server stores them in batch-sequence order, all or none (a lost, refused or
out-of-sequence message abandons the batch: nothing of it is stored); (2) chunk i+1 leaves this
process only after chunk i's commit ack said stored, so it is stored after chunk i, and its
first event's predecessor (the last of chunk i) is in the stream; (3) the run's first chunk
starts at the aggregate's first unfinished event, whose predecessors the stream holds (as for
sequential acks). So the stream gets a prefix of the run, chunk by chunk, never a gap.
A chunk that fails (refused, no commit ack in time, connection trouble) is reported
conservatively: nothing of it is known stored, so its first event fails (an ordinary failure,
retried, even when the refusal was "too large": which message it was is not known) and the rest
of the run is ``NotSent``. A retried run (any event with attempt > 1: the chunk might have been
stored after all) is sent with sequential acks, where JetStream's dedup drops what is already
stored; a batch would instead be refused whole for a stored Nats-Msg-Id. A retry cannot miss
this: the claim starts the run at the failed event, whose attempt is then at least 2.
Which stream a subject goes to, and whether it allows atomic publish, is looked up with the
JetStream API and kept for ``_STREAM_TTL`` seconds (dropped at once when a batch is refused).
When batches pay: on file storage a commit costs a few ms (the server stages the batch in a
store of its own) and commits to a stream do not overlap, so short runs are faster with
sequential acks (hence ``atomic_min_run``), and so are many long runs at once: sequential acks
pipeline across runs, so 20 runs of 100 in flight (200 busy aggregates) cost about 100 round
trips, where 20 commits queue up (measured: 12,600 events/s batched against 19,300 sequential).
Batches are used only while at most ``atomic_max_runs`` runs of ``atomic_min_run`` or more are
in flight in this publisher, counting the new batch's: the case of a few hot aggregates, where
sequential acks cost a round trip per event. That also keeps this publisher's open batches far
below the server's limit (50 per stream).

How: a JetStream publish is a core NATS publish with a reply subject, on which the stream
answers with a JSON PubAck (or an error). nats-py's ``JetStreamContext.publish_async`` does that
with, per message, a NUID and an os.urandom() call for the reply token, a semaphore, an
asyncio.Future with a done callback, and a PubAck dataclass built by reflection from stdlib JSON;
together about 40% of the worker's CPU per event. This module uses the same nats-py client
calls underneath (``Client.publish`` with a reply subject, ``Client.subscribe`` on one wildcard
inbox; nats-py keeps doing all the protocol work, reconnects and resubscription included) and
keeps, per batch, one future and a counter: a reply token is a counter value, an ack is parsed
with orjson. It also sees every error answer: publish_async loses those with an HTTP-like code
(400, 404, 500, 503) because ``APIError.from_error`` raises inside its reply callback, so the
publish timed out instead, and "message size exceeds maximum" was retried until dead instead
of dead-lettered at once.

Permanent errors (dead-lettered at once, never retried): a message over the server's
max_payload, headers over JetStream's 64 KiB, a message over the stream's max message size, a
header value containing a line break, and a subject or header the client refuses. The sizes
are counted as the server counts them (measured against nats-server 2.15: payload plus the
header block as nats-py writes it, values trimmed; the subject and the reply subject do not
count), and checked before anything is sent: a message over max_payload makes the server answer
-ERR and close the connection, which nats-py then closes for good. Everything else (no ack in
time, no stream answering, connection down) is an ordinary failure, retried with backoff.

A client nats-py has closed for good (any -ERR from the server but a few, a close from outside)
is replaced: the publishes waiting for an answer fail at once (ordinary failures), ``ready`` is
cleared until a new client is connected (the worker claims nothing meanwhile), and the new one
is connected with the same retries as at start.

Headers: the row's own, then Nats-Msg-Id and the Outbox-* ones (which win over a row header of
the same name); with ``cloudevents``, the CloudEvents binary-mode attributes too
(outboxpg.cloudevents), counted in the size checks. With an OpenTelemetry SDK, a span per event
from its send to its answer (outboxpg.relay.tracing).

Servers: ``url`` is one URL or a comma-separated list (or a list) of them, ``nats://``,
``tls://``, ``ws://`` or ``wss://``; ``parse_servers`` checks them and says in one line what is
wrong with a malformed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from outboxpg.cloudevents import HEADER_NAMES, CloudEvents
from outboxpg.events import OutboxEvent, runs_of
from outboxpg.relay.backoff import next_delay
from outboxpg.relay.publishers import NotSent, PermanentError, not_sent_after
from outboxpg.relay.streams import stream_for
from outboxpg.relay.tracing import PublishTracer, publish_tracer
from outboxpg.text import describe

__all__ = ["NatsPublisher", "check_stream", "ensure_stream", "parse_servers", "supports_atomic_batch"]

log = logging.getLogger("outboxpg.nats")

# JetStream API error codes that no retry can fix.
_PERMANENT_API_CODES = {
    10054,  # message size exceeds maximum allowed
    10097,  # header size exceeds maximum allowed of 64k (checked before sending; in case a server counts otherwise)
}
# JetStream refuses a message whose header block is longer than this (10097).
_JS_MAX_HEADER_BYTES = 65535


_STATUS = "Status"   # nats.js.api.Header.STATUS: an inline status answer (503: no responders)

# Atomic batch publish (ADR-50): the server's defaults, and the smallest version that has it.
_BATCH_MAX = 1000               # messages per atomic batch (streamMaxAtomicBatchSize)
_ATOMIC_SINCE = (2, 12)
_STREAM_TTL = 30.0              # seconds a subject's stream lookup is trusted
# Header bytes a batch adds to a message, at most: "Nats-Batch-Id: <32 hex>\r\n",
# "Nats-Batch-Sequence: <up to 4 digits>\r\n", "Nats-Batch-Commit: 1\r\n".
_BATCH_HEADER_BYTES = (15 + 32 + 2) + (21 + 4 + 2) + 22


class _Batch:
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


class _Run:
    """One aggregate's events in a batch (positions in id order) and how far it got: the event at
    ``positions[next]`` is the one in flight (``token`` set) or about to be sent. Sent as atomic
    batches when ``messages`` is set (each event's headers, checked); then ``positions[next:
    chunk_end]`` is the chunk in flight, and ``positions[next]`` what fails if it does."""

    __slots__ = ("batch", "positions", "next", "token", "finished", "messages", "chunk_end", "long")

    def __init__(self, batch: _Batch, positions: list[int]) -> None:
        self.batch = batch
        self.positions = positions
        self.next = 0
        self.token: str | None = None
        self.finished = False
        self.messages: list[dict[str, str]] | None = None
        self.chunk_end = 0
        self.long = False   # counted in NatsPublisher._long_runs

class NatsPublisher:
    """JetStream publisher. ``await start()`` connects (retrying until ``connect_deadline``).

    ``on_duplicate(stream_seq)``, if given, is called for every ack that says JetStream already
    had the message (a re-publish dropped by deduplication). ``duplicates`` counts them.
    """

    def __init__(self, url: str | Sequence[str] = "nats://127.0.0.1:4222", *, ack_timeout: float = 5.0,
                 max_pending: int = 10_000, connect_deadline: float | None = None,
                 on_duplicate: Callable[[int], None] | None = None, atomic_min_run: int | None = 32,
                 atomic_max_runs: int = 2, cloudevents: CloudEvents | None = None,
                 tracer_provider: Any = None) -> None:
        """``atomic_min_run``: runs at least this long go as atomic batches where the stream
        allows it (None: never), while at most ``atomic_max_runs`` such runs are in flight.
        ``cloudevents``: add its ce-* headers and content-type to every message (binary content
        mode, see outboxpg.cloudevents). ``tracer_provider``: an OpenTelemetry SDK
        TracerProvider to record a span per published event with (default: the global one, if
        it is an SDK's; see outboxpg.relay.tracing). A malformed ``url`` is a ValueError (see
        parse_servers)."""
        self.servers = parse_servers(url)
        self.cloudevents = cloudevents
        self.tracer_provider = tracer_provider
        self.tracer: PublishTracer | None = None   # set by start()
        self.url = ",".join(self.servers)   # for log lines
        self.atomic_min_run = atomic_min_run
        self.atomic_max_runs = atomic_max_runs
        self.atomic_server = False     # the connected server has atomic batch publish (2.12+)
        self._atomic_open = 0          # runs being sent as atomic batches right now
        self._long_runs = 0            # runs of atomic_min_run or more in flight, however sent
        self._streams: dict[str, tuple[str | None, float]] = {}   # subject -> (atomic stream or None, until)
        self._lookups: dict[str, asyncio.Task[str | None]] = {}
        # How runs keep their order; the worker logs it at start (set by start()).
        self.run_publishing = "sequential-acks"
        self.ack_timeout = ack_timeout
        self.max_pending = max_pending   # publish_async's limit on the JetStreamContext (js), for callers that use it
        self.connect_deadline = connect_deadline
        self.on_duplicate = on_duplicate
        self.duplicates = 0
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self._closing = False
        self._reply_prefix = ""
        self._reply_prefix_len = 0
        self._waiting: dict[str, _Run] = {}   # reply token -> the run whose event it answers
        self._token = 0
        # Cleared while a client that nats-py closed for good is being replaced; the worker
        # claims only while it is set.
        self.ready = asyncio.Event()
        self.ready.set()
        self.replacements = 0          # clients replaced after nats-py closed them for good
        self._generation = 0           # which client's closed callback counts
        self._replacing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            return   # started already (outboxpg-worker starts it before Worker.run() would)
        self.tracer = publish_tracer(self.tracer_provider)
        if self.tracer is not None:
            log.info("event=tracing note=%r", "recording an OpenTelemetry span per published event")
        await self._connect(self.connect_deadline)

    async def _connect(self, deadline: float | None) -> None:
        delay = 0.2
        loop = asyncio.get_running_loop()
        give_up = None if deadline is None else loop.time() + deadline
        generation = self._generation + 1
        while True:
            try:
                nc = await nats.connect(
                    self.servers, connect_timeout=2, allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5, name="outboxpg-worker",
                    disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error, closed_cb=functools.partial(self._on_closed, generation))
                break
            except Exception as exc:  # noqa: BLE001 - report and retry any connect failure
                if give_up is not None and loop.time() + delay > give_up:
                    raise
                log.warning("event=nats_connect_failed url=%s error=%r retry_in=%.1fs", self.url, str(exc), delay)
                await asyncio.sleep(delay)
                delay = next_delay(delay)
        self.nc, self._generation = nc, generation
        self.js = self.nc.jetstream(publish_async_max_pending=self.max_pending)
        # One inbox for every ack: "<inbox>.<token>". nats-py renews the subscription after a
        # reconnect; an ack lost meanwhile times out like any other.
        self._reply_prefix = self.nc.new_inbox() + "."
        self._reply_prefix_len = len(self._reply_prefix)
        await self.nc.subscribe(self._reply_prefix + "*", cb=self._on_ack)
        version = server_version(self.nc)
        self.atomic_server = supports_atomic_batch(self.nc)
        shown = ".".join(map(str, version)) if version else "of unknown version"
        if self.atomic_min_run is None:
            self.run_publishing = "sequential-acks"
        elif self.atomic_server:
            self.run_publishing = f"atomic-batch(min_run={self.atomic_min_run})+sequential-acks"
        else:
            self.run_publishing = f"sequential-acks (server {shown} has no atomic batch publish)"
        self.ready.set()

    async def _on_closed(self, generation: int) -> None:
        """nats-py closed a client for good (an -ERR from the server, or a close from outside).
        Not by close() (shutdown), and only the current client: replace it."""
        if self._closing or generation != self._generation:
            return
        self.ready.clear()
        nc = self.nc
        error = getattr(nc, "last_error", None)
        log.warning("event=nats_closed url=%s error=%r note=%r", self.url,
                    describe(error, whole=True) if error else None,
                    "nats-py closed the client for good: connecting a new one")
        # Their answers can only come to the closed client: fail them now rather than at the timeout.
        lost = nats.errors.ConnectionClosedError()
        for token, run in list(self._waiting.items()):
            self._forget(run, token)
            if run.chunk_end:
                self._batch_refused(run, lost)
            else:
                self._finish(run, lost)
        if self._replacing is None or self._replacing.done():
            self._replacing = asyncio.ensure_future(self._replace())

    async def _replace(self) -> None:
        try:
            await self._connect(None)   # retried until it works, a warning per try, as at start
        except Exception as exc:  # noqa: BLE001 - subscribing on the new client failed: try again
            log.warning("event=nats_replace_failed url=%s error=%r", self.url, str(exc))
            if not self._closing:
                await asyncio.sleep(1)
                self._replacing = asyncio.ensure_future(self._replace())
            return
        self.replacements += 1
        log.info("event=nats_replaced url=%s", self.url)

    async def _on_disconnected(self) -> None:
        if not self._closing:
            log.warning("event=nats_disconnected url=%s", self.url)

    async def _on_reconnected(self) -> None:
        log.info("event=nats_reconnected url=%s", self.url)

    async def _on_error(self, exc: Exception) -> None:
        log.debug("event=nats_error error=%r", str(exc))

    async def close(self) -> None:
        self._closing = True
        if self._replacing is not None and not self._replacing.done():
            self._replacing.cancel()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 5)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    async def _on_ack(self, msg: Msg) -> None:
        run = self._waiting.pop(msg.subject[self._reply_prefix_len:], None)
        if run is None:
            return   # the batch stopped waiting (ack_timeout): too late
        run.token = None
        outcome = self._outcome(msg)
        if run.chunk_end:
            # The answer to an atomic batch's commit.
            if outcome is not None:
                self._batch_refused(run, outcome, answered=True)
                return
            # The whole chunk is stored: only now may the next chunk go out.
            done_ns = run.batch.done_ns
            if done_ns is not None:
                now = time.time_ns()
                for n in range(run.next, run.chunk_end):
                    done_ns[run.positions[n]] = now
            run.next, run.chunk_end = run.chunk_end, 0
            if run.next < len(run.positions):
                await self._send_chunk(run)
            else:
                self._finish(run, None)
            return
        if outcome is not None:
            self._finish(run, outcome)
            return
        # Stored (or already stored): only now may the run's next event go out.
        if run.batch.done_ns is not None:
            run.batch.done_ns[run.positions[run.next]] = time.time_ns()
        run.next += 1
        if run.next < len(run.positions):
            await self._send(run)
        else:
            self._finish(run, None)

    def _outcome(self, msg: Msg) -> BaseException | None:
        """What an answer on the reply subject says: None for stored (or already stored)."""
        data = msg.data
        if not data and msg.headers and _STATUS in msg.headers:
            if msg.headers[_STATUS] == "503":
                return RuntimeError("no JetStream stream captures this subject (no responders)")
            return RuntimeError(f"JetStream answered with status {msg.headers[_STATUS]}")
        try:
            ack = orjson.loads(data)
            error = ack.get("error")
        except (orjson.JSONDecodeError, AttributeError) as exc:
            return RuntimeError(f"unreadable JetStream ack {data[:200]!r}: {exc}")
        if error is None:
            if ack.get("duplicate"):
                self.duplicates += 1
                if self.on_duplicate is not None:
                    self.on_duplicate(ack.get("seq", 0))
            return None
        try:
            nats.js.errors.APIError.from_error(error)   # raises the matching nats-py error class
        except nats.js.errors.APIError as exc:
            if exc.err_code in _PERMANENT_API_CODES:
                return PermanentError(f"JetStream refused the message: {exc.description}")
            return exc
        except Exception as exc:  # noqa: BLE001 - an error object nats-py cannot read
            return RuntimeError(f"JetStream refused the message: {error!r} ({exc!r})")
        return RuntimeError(f"JetStream refused the message: {error!r}")

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        """Publish a claimed batch, in order per aggregate: each run's next event is sent only
        once JetStream acked the one before it; the runs themselves are all in flight at once.
        A run stops at its first failure: that event gets the failure, the rest ``NotSent``.
        Events still unacked ``ack_timeout`` after the start get a TimeoutError."""
        assert self.js is not None and self.nc is not None, "NatsPublisher.start() was not awaited"
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
        batch = _Batch(events, asyncio.get_running_loop().create_future(), timed=tracer is not None)
        runs = [_Run(batch, positions) for positions in runs_of(events)]
        # Counted before the first send: an ack read while this loop yields (nats-py flushes
        # inline once its pending buffer is full) cannot finish the batch before every run started.
        batch.open = len(runs)
        try:
            async with asyncio.timeout(self.ack_timeout):
                if self.atomic_server and self.atomic_min_run is not None:
                    await self._choose_atomic(batch, runs)
                for run in runs:
                    if run.messages is not None:
                        await self._send_chunk(run)
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
                        self._waiting.pop(run.token, None)
                        self._finish(run, TimeoutError(f"no ack from JetStream within {self.ack_timeout:g}s"))
                    else:
                        self._finish(run, NotSent("not sent: the batch ran out of time first"))
        if tracer is not None:
            try:
                tracer.record(events, batch.outcomes, batch.sent_ns or [], batch.done_ns or [], started_ns)
            except Exception as exc:  # noqa: BLE001 - spans are a report: never fail a delivered batch over them
                log.warning("event=tracing_failed error=%r", describe(exc))
        return batch.outcomes

    async def _send(self, run: _Run) -> None:
        """Send the run's event at ``positions[next]``, or finish the run if it cannot be sent."""
        batch = run.batch
        if batch.closed:
            return
        event = batch.events[run.positions[run.next]]
        headers = self._headers(event, 0)
        if isinstance(headers, PermanentError):
            self._finish(run, headers)
            return
        self._token += 1
        token = str(self._token)
        self._waiting[token] = run
        run.token = token
        if batch.sent_ns is not None:
            batch.sent_ns[run.positions[run.next]] = time.time_ns()
        try:
            # nats-py queues the message; its flusher task writes everything queued at once.
            await self.nc.publish(event.subject, event.payload, reply=self._reply_prefix + token,  # type: ignore[union-attr]
                                  headers=headers)
        except (nats.errors.MaxPayloadError, nats.errors.BadSubjectError, nats.errors.BadHeaderError) as exc:
            self._forget(run, token)
            self._finish(run, PermanentError(describe(exc, whole=True)))
        except Exception as exc:  # noqa: BLE001 - connection trouble: an ordinary failure
            self._forget(run, token)
            self._finish(run, exc)

    def _headers(self, event: OutboxEvent, extra: int) -> dict[str, str] | PermanentError:
        """The event's message headers, or why it can never be sent (``extra``: header bytes
        still to be added, for the max_payload check)."""
        payload = event.payload
        row_headers = event.headers
        # The values that can hold a line break, looked at in one string (the id and the
        # attempt are numbers).
        text = event.msg_id + event.event_type + event.aggregate_type + event.aggregate_id
        if row_headers:
            text += "".join(row_headers.values())
        if "\n" in text or "\r" in text:
            return PermanentError("a header value contains a line break, which NATS headers cannot carry")
        outbox_id, attempt = str(event.id), str(event.attempt)
        headers = {"Nats-Msg-Id": event.msg_id, "Outbox-Id": outbox_id, "Outbox-Event-Type": event.event_type,
                   "Outbox-Aggregate-Type": event.aggregate_type, "Outbox-Aggregate-Id": event.aggregate_id,
                   "Outbox-Attempt": attempt}
        ce_bytes = 0
        if self.cloudevents is not None:
            # Binary content mode: the attributes come from the columns; a row header of the same
            # name (in any case) gives way, as the Outbox-* ones do.
            ce = self.cloudevents.headers(event)
            ce_bytes = _CE_NAME_BYTES + sum(map(len, ce.values()))   # the values are ASCII (encoded)
            headers.update(ce)
            if row_headers and any(k.lower() in _CE_HEADERS for k in row_headers):
                row_headers = {k: v for k, v in row_headers.items() if k.lower() not in _CE_HEADERS}
        if row_headers:
            headers = {**row_headers, **headers}
        # NATS counts the header block in max_payload: a message over it would make the server
        # answer -ERR and close the connection (for good, in nats-py); JetStream refuses a header
        # block over 64 KiB. First a bound computed without a loop: at least the real size (the
        # values untrimmed, a row header that the outbox's own replace counted too).
        header_bytes = _FIXED_HEADER_BYTES + len(text.encode()) + len(outbox_id) + len(attempt) + extra + ce_bytes
        if row_headers:
            header_bytes += sum(len(k) + 4 for k in row_headers if k not in _OUTBOX_HEADERS)
        max_payload = self.nc.max_payload or 0  # type: ignore[union-attr]
        if (max_payload and header_bytes + len(payload) > max_payload) or header_bytes > _JS_MAX_HEADER_BYTES:
            # Near a limit: count exactly what goes on the wire.
            header_bytes = _header_block_bytes(headers) + extra
            size = header_bytes + len(payload)
            if max_payload and size > max_payload:
                return PermanentError(
                    f"message of {size} bytes (payload {len(payload)}, headers {header_bytes}) exceeds "
                    f"the NATS server's max_payload of {max_payload}")
            if header_bytes > _JS_MAX_HEADER_BYTES:
                return PermanentError(f"headers of {header_bytes} bytes exceed JetStream's limit of "
                                      f"{_JS_MAX_HEADER_BYTES} (64 KiB)")
        return headers

    # -- atomic batches ------------------------------------------------------------------

    async def _choose_atomic(self, batch: _Batch, runs: list[_Run]) -> None:
        """Mark the runs to be sent as atomic batches (``messages`` set): long enough, while
        few long runs are in flight (see the module's docstring), first tries only (attempt 1:
        nothing of them can be in the stream yet), every subject going to one stream that allows
        atomic publish, every message fine with the batch headers. Everything else keeps
        sequential acks."""
        events = batch.events
        min_run = self.atomic_min_run or 0
        long_runs = [run for run in runs if len(run.positions) >= min_run]
        for run in long_runs:
            run.long = True
        self._long_runs += len(long_runs)
        if not long_runs or self._long_runs > self.atomic_max_runs:
            return
        candidates = [run for run in long_runs if all(events[i].attempt <= 1 for i in run.positions)]
        if not candidates:
            return
        subjects = {events[i].subject for run in candidates for i in run.positions}
        streams = dict(zip(subjects, await asyncio.gather(*map(self._atomic_stream, subjects))))
        for run in candidates:
            names = {streams[events[i].subject] for i in run.positions}
            if len(names) != 1 or None in names:
                continue
            messages = []
            for i in run.positions:
                headers = self._headers(events[i], _BATCH_HEADER_BYTES)
                if isinstance(headers, PermanentError):
                    break   # sequential acks give that event its own outcome
                messages.append(headers)
            else:
                run.messages = messages
                self._atomic_open += 1

    async def _atomic_stream(self, subject: str) -> str | None:
        """The stream that captures ``subject`` if it allows atomic publish, else None; looked up
        once per _STREAM_TTL (one lookup at a time per subject)."""
        loop = asyncio.get_running_loop()
        cached = self._streams.get(subject)
        if cached is not None and cached[1] > loop.time():
            return cached[0]
        task = self._lookups.get(subject)
        if task is None:
            task = self._lookups[subject] = asyncio.ensure_future(self._look_up(subject))
            task.add_done_callback(lambda _: self._lookups.pop(subject, None))
        return await asyncio.shield(task)

    async def _look_up(self, subject: str) -> str | None:
        assert self.js is not None
        try:
            name = await self.js.find_stream_name_by_subject(subject)
            info = await self.js.stream_info(name)
        except nats.js.errors.NotFoundError:
            name = None   # no stream: the sequential publish says so, event by event
        except Exception as exc:  # noqa: BLE001 - timeout, no JetStream...: sequential, ask again next time
            log.debug("event=stream_lookup_failed subject=%s error=%r", subject, str(exc))
            return None
        else:
            if not info.config.allow_atomic:
                name = None
        self._streams[subject] = (name, asyncio.get_running_loop().time() + _STREAM_TTL)
        return name

    async def _send_chunk(self, run: _Run) -> None:
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
        self._token += 1
        token = str(self._token)
        self._waiting[token] = run
        run.token, run.chunk_end = token, end
        events, positions, publish = batch.events, run.positions, self.nc.publish  # type: ignore[union-attr]
        if batch.sent_ns is not None:
            now = time.time_ns()
            for n in range(start, end):
                batch.sent_ns[positions[n]] = now
        try:
            for n in range(start, end):
                event = events[positions[n]]
                headers = {**messages[n], "Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(n - start + 1)}
                if n + 1 < end:
                    await publish(event.subject, event.payload, headers=headers)
                else:
                    headers["Nats-Batch-Commit"] = "1"
                    await publish(event.subject, event.payload, reply=self._reply_prefix + token, headers=headers)
        except Exception as exc:  # noqa: BLE001 - connection trouble (the messages were checked)
            # What was sent is an incomplete batch: the server stores none of it.
            self._forget(run, token)
            self._batch_refused(run, exc)

    def _batch_refused(self, run: _Run, outcome: BaseException, answered: bool = False) -> None:
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
            self._streams.pop(events[i].subject, None)
        self._finish(run, outcome)

    def _forget(self, run: _Run, token: str) -> None:
        self._waiting.pop(token, None)
        if run.token == token:
            run.token = None

    def _finish(self, run: _Run, outcome: BaseException | None) -> None:
        """End the run: ``outcome`` for the event at ``positions[next]`` (None: the run's last
        event, stored), NotSent for the events after it."""
        if run.finished:
            return
        run.finished = True
        run.token = None
        if run.messages is not None:
            self._atomic_open -= 1
        if run.long:
            self._long_runs -= 1
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


# Header bytes besides the values: "NATS/1.0\r\n", "<name>: " and "\r\n" per header, the closing "\r\n".
_OUTBOX_HEADERS = ("Nats-Msg-Id", "Outbox-Id", "Outbox-Event-Type", "Outbox-Aggregate-Type", "Outbox-Aggregate-Id",
                   "Outbox-Attempt")
_FIXED_HEADER_BYTES = len("NATS/1.0\r\n") + sum(len(name) + 4 for name in _OUTBOX_HEADERS) + 2
_CE_HEADERS = frozenset(HEADER_NAMES)
_CE_NAME_BYTES = sum(len(name) + 4 for name in HEADER_NAMES)


def _header_block_bytes(headers: dict[str, str]) -> int:
    """The header block as nats-py writes it ("NATS/1.0\r\n", "<name>: <value>\r\n" with the
    value trimmed, "\r\n"): what NATS counts in max_payload and JetStream in its 64 KiB."""
    return 12 + sum(len(k) + 4 + len(v.strip().encode()) for k, v in headers.items())


_SCHEMES = ("nats", "tls", "ws", "wss")
_HOSTNAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")


def parse_servers(urls: str | Sequence[str]) -> list[str]:
    """The NATS servers in ``urls`` (a comma-separated list, or a list), each a URL
    ``scheme://[user:password@]host[:port]``. A ValueError says in
    one line what is wrong with a malformed one, without its password: what nats-py would retry
    forever (a list given as one URL, an unknown scheme taken for a host name...)."""
    parts = urls.split(",") if isinstance(urls, str) else list(urls)
    servers = []
    for raw in parts:
        part = raw.strip()
        shown = re.sub(r"//[^/@]*@", "//***@", part)
        if not part:
            raise ValueError("an empty server in the NATS URL list" if len(parts) > 1 else "the NATS URL is empty")
        if "://" not in part:
            raise ValueError(f"NATS URL {shown!r} has no scheme: write it as nats://host:port "
                             "(or tls://, ws://, wss://)")
        if any(c.isspace() for c in part):
            raise ValueError(f"NATS URL {shown!r} contains a space: separate several servers with commas")
        url = part
        try:
            u = urlsplit(url)
            _ = u.port   # a port that is not a number 0-65535 raises here
        except ValueError as exc:
            raise ValueError(f"malformed NATS URL {shown!r}: {exc}") from None
        if u.scheme.lower() not in _SCHEMES:
            raise ValueError(f"NATS URL {shown!r} has the scheme {u.scheme!r}: use nats://, tls://, ws:// or wss://"
                             + (" (several servers: separate the URLs with commas)" if "," in part else ""))
        host = u.hostname or ""
        try:
            valid_host = bool(ipaddress.ip_address(host)) if ":" in host else bool(_HOSTNAME.fullmatch(host))
        except ValueError:
            valid_host = False
        if not valid_host:
            raise ValueError(f"NATS URL {shown!r} has no valid host name")
        if u.path not in ("", "/") or u.query or u.fragment:
            raise ValueError(f"NATS URL {shown!r} has a path, query or fragment: a server URL is "
                             "scheme://[user:password@]host[:port]")
        servers.append(url)
    if len({u.split("://")[0].lower() in ("ws", "wss") for u in servers}) > 1:
        raise ValueError("the NATS URL list mixes websocket (ws://, wss://) and other servers: nats-py cannot")
    return servers


def server_version(nc: Client) -> tuple[int, int, int] | None:
    """The connected server's version from its INFO, or None if it cannot be read."""
    try:
        v = nc.connected_server_version
        return v.major, v.minor, v.patch
    except Exception:  # noqa: BLE001 - no INFO yet, or not a semantic version
        return None


def supports_atomic_batch(nc: Client) -> bool:
    """Whether the connected server has atomic batch publish (nats-server 2.12+)."""
    version = server_version(nc)
    return version is not None and version[:2] >= _ATOMIC_SINCE


async def check_stream(js: JetStreamContext, subject: str, needed_window: timedelta) -> list[str]:
    """Problems with the stream that would capture ``subject``, as human-readable lines."""
    name = await stream_for(js, subject)
    if name is None:
        return [f"no JetStream stream captures {subject!r}: every publish will fail until one does "
                f"(create one, e.g. with --ensure-stream NAME)"]
    info = await js.stream_info(name)
    window = info.config.duplicate_window or 0
    problems = []
    if window < needed_window.total_seconds():
        problems.append(
            f"stream {name!r} has a duplicate window of {window:g}s, shorter than lease + backoff cap "
            f"({needed_window.total_seconds():g}s): a re-published event could be stored twice")
    return problems


async def ensure_stream(js: JetStreamContext, name: str, subjects: list[str], window: timedelta,
                        atomic: bool = False) -> str:
    """Create stream ``name`` capturing ``subjects``, or update it to capture them with at least
    ``window`` of deduplication; with ``atomic`` (the server has atomic batch publish, see
    supports_atomic_batch), also with allow_atomic. Returns what it did."""
    try:
        info = await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(StreamConfig(name=name, subjects=subjects, duplicate_window=window.total_seconds(),
                                         allow_atomic=True if atomic else None))
        return (f"created stream {name} subjects={subjects} duplicate_window={window.total_seconds():g}s"
                + (" allow_atomic=true" if atomic else ""))
    config = info.config
    want_subjects = sorted(set(config.subjects or []) | set(subjects))
    want_window = max(config.duplicate_window or 0, window.total_seconds())
    want_atomic = bool(config.allow_atomic) or atomic
    if (want_subjects == sorted(config.subjects or []) and want_window == (config.duplicate_window or 0)
            and want_atomic == bool(config.allow_atomic)):
        return (f"stream {name} already captures {subjects} with duplicate_window={want_window:g}s"
                + (" allow_atomic=true" if want_atomic else ""))
    config.subjects = want_subjects
    config.duplicate_window = want_window
    if want_atomic:
        config.allow_atomic = True
    await js.update_stream(config)
    return (f"updated stream {name} subjects={want_subjects} duplicate_window={want_window:g}s"
            + (" allow_atomic=true" if want_atomic else ""))
