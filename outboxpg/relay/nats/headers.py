"""An event's NATS message headers, and whether the message fits the server's limits.

Headers: Nats-Msg-Id (the row's msg_id: JetStream drops a re-publish of the same event within the
stream's duplicate window) and the Outbox-* ones first; with ``cloudevents``, the CloudEvents
binary-mode attributes (outboxpg.cloudevents); then the row's own, less any named like one of
those in any case (``outbox-id`` beside ``Outbox-Id`` would leave a consumer to guess which one
is the outbox's). Ours come first because a server that looks a header up by searching the
block for its name (nats-server 2.9 did, for Nats-Msg-Id) would otherwise find it inside a row
header's value first. Everything is counted in the size checks.

Never sendable (a PermanentError: dead-lettered at once, never retried): a message over the
server's max_payload, headers over JetStream's 64 KiB, a header value containing a line break.
(A message over the stream's max message size is refused by JetStream, see acks.py; a subject
or header the client refuses, by nats-py.) The sizes are counted as the server counts them
(measured against nats-server 2.15: payload plus the header block as nats-py writes it, values
trimmed; the subject and the reply subject do not count), and checked before anything is sent: a
message over max_payload makes the server answer -ERR and close the connection, which nats-py
then closes for good.
"""

from __future__ import annotations

from outboxpg.cloudevents import HEADER_NAMES, CloudEvents
from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import PermanentError

__all__ = ["BATCH_HEADER_BYTES", "JS_MAX_HEADER_BYTES", "header_block_bytes", "message_headers"]

# JetStream refuses a message whose header block is longer than this (10097).
JS_MAX_HEADER_BYTES = 65535
# Header bytes an atomic batch adds to a message, at most: "Nats-Batch-Id: <32 hex>\r\n",
# "Nats-Batch-Sequence: <up to 4 digits>\r\n", "Nats-Batch-Commit: 1\r\n".
BATCH_HEADER_BYTES = (15 + 32 + 2) + (21 + 4 + 2) + 22

# Header bytes besides the values: "NATS/1.0\r\n", "<name>: " and "\r\n" per header, the closing "\r\n".
_OUTBOX_HEADERS = ("Nats-Msg-Id", "Outbox-Id", "Outbox-Event-Type", "Outbox-Aggregate-Type", "Outbox-Aggregate-Id",
                   "Outbox-Attempt")
_FIXED_HEADER_BYTES = len("NATS/1.0\r\n") + sum(len(name) + 4 for name in _OUTBOX_HEADERS) + 2
_CE_HEADERS = frozenset(HEADER_NAMES)
_CE_NAME_BYTES = sum(len(name) + 4 for name in HEADER_NAMES)
# The names a row header may not have, lower-cased: the outbox's own, and with CloudEvents theirs.
_TAKEN = frozenset(name.lower() for name in _OUTBOX_HEADERS)
_TAKEN_CE = _TAKEN | _CE_HEADERS


def message_headers(event: OutboxEvent, cloudevents: CloudEvents | None, max_payload: int,
                    extra: int = 0) -> dict[str, str] | PermanentError:
    """The event's message headers, or why it can never be sent. ``max_payload``: the server's
    (0: unknown, not checked); ``extra``: header bytes still to be added (an atomic batch's)."""
    payload = event.payload
    row_headers = event.headers
    if row_headers:
        # A row header named like one of ours, in any case, gives way.
        taken = _TAKEN if cloudevents is None else _TAKEN_CE
        if any(k.lower() in taken for k in row_headers):
            row_headers = {k: v for k, v in row_headers.items() if k.lower() not in taken}
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
    if cloudevents is not None:
        # Binary content mode: the attributes come from the columns.
        ce = cloudevents.headers(event)
        ce_bytes = _CE_NAME_BYTES + sum(map(len, ce.values()))   # the values are ASCII (encoded)
        headers.update(ce)
    if row_headers:
        headers.update(row_headers)
    # NATS counts the header block in max_payload: a message over it would make the server
    # answer -ERR and close the connection (for good, in nats-py); JetStream refuses a header
    # block over 64 KiB. First a bound computed without a loop: at least the real size (the
    # values untrimmed).
    header_bytes = _FIXED_HEADER_BYTES + len(text.encode()) + len(outbox_id) + len(attempt) + extra + ce_bytes
    if row_headers:
        header_bytes += sum(len(k) + 4 for k in row_headers)
    if (max_payload and header_bytes + len(payload) > max_payload) or header_bytes > JS_MAX_HEADER_BYTES:
        # Near a limit: count exactly what goes on the wire.
        header_bytes = header_block_bytes(headers) + extra
        size = header_bytes + len(payload)
        if max_payload and size > max_payload:
            return PermanentError(
                f"message of {size} bytes (payload {len(payload)}, headers {header_bytes}) exceeds "
                f"the NATS server's max_payload of {max_payload}")
        if header_bytes > JS_MAX_HEADER_BYTES:
            return PermanentError(f"headers of {header_bytes} bytes exceed JetStream's limit of "
                                  f"{JS_MAX_HEADER_BYTES} (64 KiB)")
    return headers


def header_block_bytes(headers: dict[str, str]) -> int:
    """The header block as nats-py writes it ("NATS/1.0\r\n", "<name>: <value>\r\n" with the
    value trimmed, "\r\n"): what NATS counts in max_payload and JetStream in its 64 KiB."""
    return 12 + sum(len(k) + 4 + len(v.strip().encode()) for k, v in headers.items())
