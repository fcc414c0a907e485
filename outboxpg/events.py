"""What a worker hands to a publisher, and how a publisher says "never retry this"."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

__all__ = ["OutboxEvent", "PermanentError", "CLAIM_COLUMNS", "event_from_row"]


class PermanentError(Exception):
    """Raise (or return) this from a publisher for an event that can never be published:
    the event is dead-lettered at once with the message as its reason, instead of retried."""


@dataclass(frozen=True, slots=True)
class OutboxEvent:
    """One leased event. ``payload`` is the JSON document exactly as stored (bytes)."""

    id: int
    subject: str
    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: bytes
    headers: dict[str, str]
    msg_id: str
    attempt: int
    created_at: datetime

    def json(self) -> Any:
        """The payload parsed (orjson)."""
        return orjson.loads(self.payload)


# The columns of outbox_claim() the worker reads, in this order.
CLAIM_COLUMNS = ("id, subject, aggregate_type, aggregate_id, event_type, payload, headers, "
                 "msg_id, attempts, created_at, lease_token")

_EMPTY = b"{}"


def event_from_row(row: tuple[Any, ...]) -> OutboxEvent:
    """Build an event from a claim row whose jsonb columns were loaded as raw bytes."""
    headers_raw: bytes = row[6]
    return OutboxEvent(
        id=row[0], subject=row[1], aggregate_type=row[2], aggregate_id=row[3], event_type=row[4],
        payload=row[5], headers={} if headers_raw == _EMPTY else orjson.loads(headers_raw),
        msg_id=row[7], attempt=row[8], created_at=row[9],
    )
