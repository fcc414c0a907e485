"""What an answer on a publish's reply subject says.

A JetStream publish is a core NATS publish with a reply subject, on which the stream answers
with a JSON PubAck (or an error). nats-py's ``JetStreamContext.publish_async`` does that with,
per message, a NUID and an os.urandom() call for the reply token, a semaphore, an
asyncio.Future with a done callback, and a PubAck dataclass built by reflection from stdlib JSON;
together about 40% of the worker's CPU per event. NatsPublisher uses the same nats-py client
calls underneath (``Client.publish`` with a reply subject, ``Client.subscribe`` on one wildcard
inbox; nats-py keeps doing all the protocol work, reconnects and resubscription included) and
keeps, per batch, one future and a counter: a reply token is a counter value, an ack is parsed
here with orjson. That also sees every error answer: publish_async loses those with an
HTTP-like code (400, 404, 500, 503) because ``APIError.from_error`` raises inside its reply
callback, so the publish timed out instead, and "message size exceeds maximum" was retried
until dead instead of dead-lettered at once.

Published means stored: an answer counts as an ack only if it is a JetStream PubAck, a JSON
object naming the stream that stored the message and its sequence number there, from a stream
expected to capture the subject. Anything else on the reply subject (a core NATS service
subscribed on the subject answering ``{"ok": true}``, an empty message) is a failure, retried:
nothing says the message is in a stream. An ack naming a stream outside ``streams`` (the ones
the worker's start check found) is an OtherStream: the publisher asks JetStream whether that
stream captures the subject before it counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import nats.js.errors
import orjson

from outboxpg.relay.publishers import PermanentError

__all__ = ["AckReader", "OtherStream"]

# JetStream API error codes that no retry can fix.
_PERMANENT_API_CODES = {
    10054,  # message size exceeds maximum allowed
    10097,  # header size exceeds maximum allowed of 64k (checked before sending; in case a server counts otherwise)
}

_STATUS = "Status"   # nats.js.api.Header.STATUS: an inline status answer (503: no responders)


class OtherStream(RuntimeError):
    """A PubAck from a stream not known to capture the subject: it counts only once JetStream
    says that stream captures it (NatsPublisher looks it up)."""

    def __init__(self, stream: str, seq: int, duplicate: bool) -> None:
        super().__init__(f"acked by stream {stream!r}, not known to capture the subject")
        self.stream, self.seq, self.duplicate = stream, seq, duplicate


class AckReader:
    """Reads the answers; counts the duplicates (``duplicates``) and calls
    ``on_duplicate(stream_seq)``, if given, for each: an ack that says JetStream already had the
    message (a re-publish dropped by deduplication). ``streams``: the streams whose acks count
    at once; None: any stream's (the answer must still be a PubAck)."""

    def __init__(self, on_duplicate: Callable[[int], None] | None = None,
                 streams: Iterable[str] | None = None) -> None:
        self.on_duplicate = on_duplicate
        self.duplicates = 0
        self.streams: set[str] | None = None if streams is None else set(streams)

    def outcome(self, data: bytes, headers: Mapping[str, str] | None) -> BaseException | None:
        """What an answer (its body and headers) says: None for stored (or already stored), else
        the failure, a PermanentError for one that no retry can fix, an OtherStream for a PubAck
        of a stream outside ``streams``."""
        if not data and headers and _STATUS in headers:
            if headers[_STATUS] == "503":
                return RuntimeError("no JetStream stream captures this subject (no responders)")
            return RuntimeError(f"JetStream answered with status {headers[_STATUS]}")
        try:
            ack: Any = orjson.loads(data)
            error = ack.get("error")
        except (orjson.JSONDecodeError, AttributeError) as exc:
            return RuntimeError(f"unreadable JetStream ack {data[:200]!r}: {exc}")
        if error is None:
            stream, seq = ack.get("stream"), ack.get("seq")
            if not (isinstance(stream, str) and stream and type(seq) is int and seq >= 0):
                return RuntimeError(f"not a JetStream ack (no stream and seq): {data[:200]!r}, so not known stored: "
                                    "does a service other than a JetStream stream answer on this subject?")
            duplicate = bool(ack.get("duplicate"))
            if self.streams is not None and stream not in self.streams:
                return OtherStream(stream, seq, duplicate)
            self.stored(seq, duplicate)
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

    def stored(self, seq: int, duplicate: bool) -> None:
        """An ack that counts: a duplicate is counted (and reported)."""
        if duplicate:
            self.duplicates += 1
            if self.on_duplicate is not None:
                self.on_duplicate(seq)
