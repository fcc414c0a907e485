"""CloudEvents 1.0 in binary content mode: an outbox event's context attributes as ``ce-*``
message headers, its payload as the message body, as it is.

    ce-specversion  1.0
    ce-id           msg_id          (also Nats-Msg-Id: a re-publish is the same CloudEvent)
    ce-source       one value per worker (outboxpg-worker --cloudevents-source), by default
                    outboxpg/<database name>
    ce-type         event_type
    ce-subject      aggregate_id
    ce-time         created_at, RFC 3339 in UTC with microseconds (2026-11-23T18:55:42.123456Z)
    content-type    application/json   (the datacontenttype attribute: payload is jsonb)

The header names and the value encoding are HTTP's binary content mode (CloudEvents HTTP binding
3.1.3: ``ce-`` prefix, values percent-encoded where they hold a space, '"', '%' or anything but
printable ASCII), which is also what binary mode over NATS headers as proposed for the Go
SDK uses (the released NATS binding 1.0.2 predates NATS headers and defines structured mode
only). So a consumer can hand a message's headers and data to any CloudEvents SDK's HTTP
binary-mode reader (in Python: ``cloudevents.core.bindings.http.from_binary_event``).

Why these attributes: id must identify the event uniquely within its source and be the same for a
re-delivery of it, which is msg_id's contract (JetStream deduplicates by it). The source is the
context in which events happen: one outbox, hence by default the database's name, a relative
URI reference; it is stable across failovers and host renames, unlike a host name, and reveals
no address. Source and id together must be unique: msg_id is a random UUID unless the producer
chose it. Set ``--cloudevents-source`` to an absolute URI (what the spec recommends) naming your
service, e.g. ``https://shop.example/orders``.

``CloudEvents(source).headers(event)`` is also what a ``--publisher`` function can call to send
the same attributes over HTTP (binary mode) or any other transport.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import quote

from outboxpg.events import OutboxEvent

__all__ = ["CONTENT_TYPE", "HEADER_NAMES", "SPEC_VERSION", "CloudEvents", "check_source", "default_source"]

SPEC_VERSION = "1.0"
# The payload column is jsonb: always JSON text.
CONTENT_TYPE = "application/json"
HEADER_NAMES = ("ce-specversion", "ce-id", "ce-source", "ce-type", "ce-subject", "ce-time", "content-type")

# HTTP binding 3.1.3.2: printable ASCII (U+0021-U+007E) but '"' and '%' goes as it is; the rest
# (space, '"', '%', controls, non-ASCII as UTF-8 bytes) percent-encoded.
_SAFE_CHARS = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in '"%')
# RFC 3986 URI-reference characters (percent-escapes included): what ce-source may hold.
_URI_REFERENCE = re.compile(r"[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]+")


def _encode(value: str) -> str:
    # isprintable() lets the space through; str methods are cheaper than a regex here (per event).
    if value.isascii() and value.isprintable() and " " not in value and '"' not in value and "%" not in value:
        return value
    return quote(value, safe=_SAFE_CHARS)


def default_source(database: str) -> str:
    """``outboxpg/<database>``, the name percent-encoded where it is not URI material."""
    return "outboxpg/" + quote(database, safe="")


def check_source(source: str) -> str:
    """``source`` if it is a URI reference (RFC 3986), else a ValueError saying so in one line."""
    if not _URI_REFERENCE.fullmatch(source):
        raise ValueError(f"the CloudEvents source must be a non-empty URI reference (RFC 3986: ASCII, no spaces; "
                         f"e.g. https://shop.example/orders or outboxpg/shop), not {source!r}")
    return source


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class CloudEvents:
    """Binary content mode with ``source`` as every event's ce-source (checked: ValueError)."""

    source: str
    _encoded_source: str = field(init=False, repr=False)
    # (whole seconds since the epoch, "YYYY-MM-DDTHH:MM:SS.") of the last ce-time made: a batch's
    # events mostly share their second, and formatting a datetime costs about 3 us, this 0.8.
    # One tuple, replaced whole: safe for a sync publisher's thread too.
    _second: tuple[int, str] = field(default=(-1, ""), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_encoded_source", _encode(check_source(self.source)))

    def headers(self, event: OutboxEvent) -> dict[str, str]:
        """The event's CloudEvents headers (names as in HEADER_NAMES, in that order)."""
        return {"ce-specversion": SPEC_VERSION, "ce-id": _encode(event.msg_id), "ce-source": self._encoded_source,
                "ce-type": _encode(event.event_type), "ce-subject": _encode(event.aggregate_id),
                "ce-time": self.time(event.created_at), "content-type": CONTENT_TYPE}

    def time(self, created_at: datetime) -> str:
        """``created_at`` in RFC 3339, UTC, with microseconds: 2026-11-23T18:55:42.123456Z."""
        delta = created_at - _EPOCH
        seconds = delta.days * 86400 + delta.seconds
        second = self._second
        if second[0] != seconds:
            second = (seconds, time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(seconds)))
            object.__setattr__(self, "_second", second)
        return f"{second[1]}{delta.microseconds:06d}Z"
