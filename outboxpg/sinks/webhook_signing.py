"""What a webhook request carries besides its body: the Standard Webhooks signature and the
outbox's headers, as HTTP header values that cannot break the request. No I/O, no HTTP client.

Standard Webhooks (https://www.standardwebhooks.com/, the spec's "Signature scheme"):

    webhook-id         the event's msg_id: the same on every retry, so receivers de-duplicate on it
    webhook-timestamp  seconds since the epoch when this request was signed (each try anew)
    webhook-signature  "v1," + base64(HMAC-SHA256(key, "<webhook-id>.<webhook-timestamp>.<body>"))

The key: a secret written ``whsec_<base64>`` (the spec's form, what receivers' libraries take) is
the base64 text decoded; any other secret is used as its bytes (a "raw" secret: a receiver then
needs those same bytes as its key, e.g. ``Webhook(raw_bytes)`` in the Python library, or
``whsec_`` + base64 of them). Blanks around the secret are not part of it.

Header values are percent-encoded (UTF-8) wherever a byte is not visible ASCII, and ``%`` itself:
a value with a line break, a NUL, a space at an end or non-ASCII text arrives as one intact token
that ``urllib.parse.unquote`` (``decodeURIComponent``) gives back; an ASCII id without ``%`` is
sent as it is. The row's own headers go as ``Outbox-Header-<name>`` (the name encoded the same
way, and where it is not an HTTP token character): a producer's header can never become another
HTTP header (``Authorization``, ``Host``, ``webhook-signature``). Except the W3C trace context,
``traceparent`` and ``tracestate``, which go under their own names so that the receiver's tracing
finds them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from urllib.parse import quote

from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import PermanentError

__all__ = ["ROW_HEADER_PREFIX", "TRACE_HEADERS", "header_value", "request_headers", "signature", "signing_key"]

SECRET_PREFIX = "whsec_"
ROW_HEADER_PREFIX = "Outbox-Header-"
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})

# Visible ASCII but "%": what a header value keeps as it is.
_VALUE_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "%" and not chr(c).isalnum())
# RFC 9110 tchar but "%": what a header name keeps as it is.
_NAME_SAFE = "!#$&'*+-.^_`|~"
_PLAIN_VALUE = re.compile(r"[!-$&-~]*")   # visible ASCII but "%", possibly empty


def signing_key(secret: bytes) -> bytes:
    """The HMAC key of a secret: ``whsec_<base64>`` decoded, any other secret as it is.
    ValueError (one line, without the secret) for an empty secret or bad base64 after whsec_."""
    secret = secret.strip()
    if secret.startswith(SECRET_PREFIX.encode()):
        text = secret[len(SECRET_PREFIX):]
        try:
            # Padding optional, as the spec's libraries accept it.
            key = base64.b64decode(text + b"=" * (-len(text) % 4), validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the webhook secret starts with whsec_ but what follows is not base64") from None
    else:
        key = secret
    if not key:
        raise ValueError("the webhook secret is empty")
    return key


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode("ascii")


def header_value(text: str) -> str:
    """``text`` as an HTTP header value: unchanged when it is visible ASCII without ``%``,
    else percent-encoded (UTF-8)."""
    if _PLAIN_VALUE.fullmatch(text):
        return text
    return quote(text, safe=_VALUE_SAFE)


def _header_name(name: str) -> str:
    return quote(name, safe=_NAME_SAFE)


def request_headers(event: OutboxEvent, key: bytes, timestamp: int) -> dict[str, str] | PermanentError:
    """Every header of the event's request, signed at ``timestamp``; a PermanentError for row
    headers HTTP cannot carry apart (two names that differ only in case)."""
    msg_id = header_value(event.msg_id)
    headers = {
        "Content-Type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(key, msg_id, timestamp, event.payload),
        "Outbox-Id": str(event.id),
        "Outbox-Subject": header_value(event.subject),
        "Outbox-Event-Type": header_value(event.event_type),
        "Outbox-Aggregate-Type": header_value(event.aggregate_type),
        "Outbox-Aggregate-Id": header_value(event.aggregate_id),
        "Outbox-Attempt": str(event.attempt),
    }
    if event.headers:
        seen: dict[str, str] = {}
        for name, value in event.headers.items():
            lower = name.lower()
            if lower in seen:
                return PermanentError(f"row headers {seen[lower]!r} and {name!r} differ only in case, "
                                      "which HTTP header names do not tell apart")
            seen[lower] = name
            http_name = lower if lower in TRACE_HEADERS else ROW_HEADER_PREFIX + _header_name(name)
            headers[http_name] = header_value(str(value))
    return headers
