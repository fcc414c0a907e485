"""Publishing to NATS JetStream with nats-py.

Every event goes to its row's subject with ``Nats-Msg-Id`` = the row's msg_id, so JetStream
drops a re-publish of the same event (after a crash or a lost ack) within the stream's
duplicate window. Publishes are pipelined and their acks awaited together, bounded by
``ack_timeout``.

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

Permanent errors (dead-lettered at once, never retried): a payload over the server's
max_payload or the stream's max message size, a header value containing a line break, and a
subject or header the client refuses. Everything else (no ack in time, no stream answering,
connection down) is an ordinary failure, retried with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import nats
import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from outboxpg.events import OutboxEvent, PermanentError

__all__ = ["NatsPublisher", "check_stream", "ensure_stream"]

log = logging.getLogger("outboxpg.nats")

# JetStream API error codes that no retry can fix.
_PERMANENT_API_CODES = {
    10054,  # message size exceeds maximum allowed
}


_STATUS = "Status"   # nats.js.api.Header.STATUS: an inline status answer (503: no responders)


class _Batch:
    """The acks one publish_batch() call is waiting for."""

    __slots__ = ("outcomes", "waiting", "done")

    def __init__(self, outcomes: list[BaseException | None], done: asyncio.Future[None]) -> None:
        self.outcomes = outcomes
        self.waiting = 0
        self.done = done


class NatsPublisher:
    """JetStream publisher. ``await start()`` connects (retrying until ``connect_deadline``).

    ``on_duplicate(stream_seq)``, if given, is called for every ack that says JetStream already
    had the message (a re-publish dropped by deduplication). ``duplicates`` counts them.
    """

    def __init__(self, url: str = "nats://127.0.0.1:4222", *, ack_timeout: float = 5.0,
                 max_pending: int = 10_000, connect_deadline: float | None = None,
                 on_duplicate: Callable[[int], None] | None = None) -> None:
        self.url = url
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
        self._waiting: dict[str, tuple[_Batch, int]] = {}   # reply token -> (batch, index)
        self._token = 0

    async def start(self) -> None:
        delay = 0.2
        loop = asyncio.get_running_loop()
        give_up = None if self.connect_deadline is None else loop.time() + self.connect_deadline
        while True:
            try:
                self.nc = await nats.connect(
                    self.url, connect_timeout=2, allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5, name="outboxpg-worker",
                    disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error)
                break
            except Exception as exc:  # noqa: BLE001 - report and retry any connect failure
                if give_up is not None and loop.time() + delay > give_up:
                    raise
                log.warning("event=nats_connect_failed url=%s error=%r retry_in=%.1fs", self.url, str(exc), delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        self.js = self.nc.jetstream(publish_async_max_pending=self.max_pending)
        # One inbox for every ack: "<inbox>.<token>". nats-py renews the subscription after a
        # reconnect; an ack lost meanwhile times out like any other.
        self._reply_prefix = self.nc.new_inbox() + "."
        self._reply_prefix_len = len(self._reply_prefix)
        await self.nc.subscribe(self._reply_prefix + "*", cb=self._on_ack)

    async def _on_disconnected(self) -> None:
        if not self._closing:
            log.warning("event=nats_disconnected url=%s", self.url)

    async def _on_reconnected(self) -> None:
        log.info("event=nats_reconnected url=%s", self.url)

    async def _on_error(self, exc: Exception) -> None:
        log.debug("event=nats_error error=%r", str(exc))

    async def close(self) -> None:
        self._closing = True
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 5)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass

    async def _on_ack(self, msg: Msg) -> None:
        entry = self._waiting.pop(msg.subject[self._reply_prefix_len:], None)
        if entry is None:
            return   # the batch stopped waiting (ack_timeout): too late
        batch, i = entry
        batch.outcomes[i] = self._outcome(msg)
        batch.waiting -= 1
        if batch.waiting == 0 and not batch.done.done():
            batch.done.set_result(None)

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
        assert self.js is not None and self.nc is not None, "NatsPublisher.start() was not awaited"
        outcomes: list[BaseException | None] = [None] * len(events)
        batch = _Batch(outcomes, asyncio.get_running_loop().create_future())
        tokens: list[str] = []
        waiting = self._waiting
        prefix = self._reply_prefix
        publish = self.nc.publish
        max_payload = self.nc.max_payload
        # One count for the sending loop itself: acks read while it yields (nats-py flushes
        # inline once its pending buffer is full) cannot finish the batch before it is all sent.
        batch.waiting = 1
        try:
            for i, event in enumerate(events):
                payload = event.payload
                if max_payload and len(payload) > max_payload:
                    outcomes[i] = PermanentError(
                        f"payload of {len(payload)} bytes exceeds the NATS server's max_payload of {max_payload}")
                    continue
                row_headers = event.headers
                # The values that can hold a line break, looked at in one string (the id and
                # the attempt are numbers).
                text = event.msg_id + event.event_type + event.aggregate_type + event.aggregate_id
                if row_headers:
                    text += "".join(row_headers.values())
                if "\n" in text or "\r" in text:
                    outcomes[i] = PermanentError("a header value contains a line break, which NATS headers cannot carry")
                    continue
                headers = {"Nats-Msg-Id": event.msg_id, "Outbox-Id": str(event.id),
                           "Outbox-Event-Type": event.event_type, "Outbox-Aggregate-Type": event.aggregate_type,
                           "Outbox-Aggregate-Id": event.aggregate_id, "Outbox-Attempt": str(event.attempt)}
                if row_headers:
                    headers = {**row_headers, **headers}
                self._token += 1
                token = str(self._token)
                waiting[token] = (batch, i)
                batch.waiting += 1
                try:
                    # nats-py queues the message and writes the whole batch at once, when its
                    # flusher task runs after this loop yields.
                    await publish(event.subject, payload, reply=prefix + token, headers=headers)
                except (nats.errors.MaxPayloadError, nats.errors.BadSubjectError, nats.errors.BadHeaderError) as exc:
                    waiting.pop(token, None)
                    batch.waiting -= 1
                    outcomes[i] = PermanentError(f"{type(exc).__name__}: {exc}")
                    continue
                except Exception as exc:  # noqa: BLE001 - connection trouble: an ordinary failure
                    waiting.pop(token, None)
                    batch.waiting -= 1
                    outcomes[i] = exc
                    continue
                tokens.append(token)
            batch.waiting -= 1
            if batch.waiting:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.ack_timeout):
                        await batch.done
        finally:
            if batch.waiting:
                # Unanswered (timed out, or this task was cancelled): stop waiting for them.
                for token in tokens:
                    entry = waiting.pop(token, None)
                    if entry is not None:
                        outcomes[entry[1]] = TimeoutError(f"no ack from JetStream within {self.ack_timeout:g}s")
        return outcomes


async def check_stream(js: JetStreamContext, subject: str, needed_window: timedelta) -> list[str]:
    """Problems with the stream that would capture ``subject``, as human-readable lines."""
    try:
        name = await js.find_stream_name_by_subject(subject)
    except nats.js.errors.NotFoundError:
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


async def ensure_stream(js: JetStreamContext, name: str, subjects: list[str], window: timedelta) -> str:
    """Create stream ``name`` capturing ``subjects``, or update it to capture them with at least
    ``window`` of deduplication. Returns what it did."""
    try:
        info = await js.stream_info(name)
    except nats.js.errors.NotFoundError:
        await js.add_stream(StreamConfig(name=name, subjects=subjects,
                                         duplicate_window=window.total_seconds()))
        return f"created stream {name} subjects={subjects} duplicate_window={window.total_seconds():g}s"
    config = info.config
    want_subjects = sorted(set(config.subjects or []) | set(subjects))
    want_window = max(config.duplicate_window or 0, window.total_seconds())
    if want_subjects == sorted(config.subjects or []) and want_window == (config.duplicate_window or 0):
        return f"stream {name} already captures {subjects} with duplicate_window={want_window:g}s"
    config.subjects = want_subjects
    config.duplicate_window = want_window
    await js.update_stream(config)
    return f"updated stream {name} subjects={want_subjects} duplicate_window={want_window:g}s"
