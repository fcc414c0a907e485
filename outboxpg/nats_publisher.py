"""Publishing to NATS JetStream with nats-py.

Every event goes to its row's subject with ``Nats-Msg-Id`` = the row's msg_id, so JetStream
drops a re-publish of the same event (after a crash or a lost ack) within the stream's
duplicate window. Publishes are pipelined (``publish_async``) and their acks awaited together,
bounded by ``ack_timeout``: nats-py's ack futures never time out by themselves.

Permanent errors (dead-lettered at once, never retried): a payload over the server's
max_payload or the stream's max message size, a header value containing a line break, and a
subject or header the client refuses. Everything else (no ack in time, no stream answering,
connection down) is an ordinary failure, retried with backoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from outboxpg.events import OutboxEvent, PermanentError

__all__ = ["NatsPublisher", "check_stream", "ensure_stream"]

log = logging.getLogger("outboxpg.nats")

# JetStream API error codes that no retry can fix.
_PERMANENT_API_CODES = {
    10054,  # message size exceeds maximum allowed
}


class NatsPublisher:
    """JetStream publisher. ``await start()`` connects (retrying until ``connect_deadline``)."""

    def __init__(self, url: str = "nats://127.0.0.1:4222", *, ack_timeout: float = 5.0,
                 max_pending: int = 10_000, connect_deadline: float | None = None) -> None:
        self.url = url
        self.ack_timeout = ack_timeout
        self.max_pending = max_pending
        self.connect_deadline = connect_deadline
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self._closing = False

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

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        assert self.js is not None and self.nc is not None, "NatsPublisher.start() was not awaited"
        outcomes: list[BaseException | None] = [None] * len(events)
        futures: dict[asyncio.Future[Any], int] = {}
        max_payload = self.nc.max_payload
        for i, event in enumerate(events):
            if max_payload and len(event.payload) > max_payload:
                outcomes[i] = PermanentError(
                    f"payload of {len(event.payload)} bytes exceeds the NATS server's max_payload of {max_payload}")
                continue
            headers = {**event.headers, "Nats-Msg-Id": event.msg_id, "Outbox-Id": str(event.id),
                       "Outbox-Event-Type": event.event_type, "Outbox-Aggregate-Type": event.aggregate_type,
                       "Outbox-Aggregate-Id": event.aggregate_id, "Outbox-Attempt": str(event.attempt)}
            if any("\n" in v or "\r" in v for v in headers.values()):
                outcomes[i] = PermanentError("a header value contains a line break, which NATS headers cannot carry")
                continue
            try:
                # No wait_stall: with a timeout, nats-py waits through asyncio.wait_for, which
                # yields to the event loop on every message, so the batch leaves as one small
                # write per message instead of one large write. The pending-ack limit cannot
                # stall us for long anyway: unacked futures are cancelled after ack_timeout.
                fut = await self.js.publish_async(event.subject, event.payload, headers=headers)
            except (nats.errors.MaxPayloadError, nats.errors.BadSubjectError, nats.errors.BadHeaderError) as exc:
                outcomes[i] = PermanentError(f"{type(exc).__name__}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - connection trouble: an ordinary failure
                outcomes[i] = exc
                continue
            futures[fut] = i
        if futures:
            done, pending = await asyncio.wait(futures, timeout=self.ack_timeout)
            for fut in pending:
                fut.cancel()
                outcomes[futures[fut]] = TimeoutError(f"no ack from JetStream within {self.ack_timeout:g}s")
            for fut in done:
                exc = fut.exception()
                if exc is None:
                    continue  # PubAck, including duplicate=True: already in the stream
                if isinstance(exc, nats.js.errors.APIError) and exc.err_code in _PERMANENT_API_CODES:
                    exc = PermanentError(f"JetStream refused the message: {exc.description}")
                elif isinstance(exc, nats.js.errors.NoStreamResponseError):
                    exc = RuntimeError("no JetStream stream captures this subject (no responders)")
                outcomes[futures[fut]] = exc
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
