"""What a worker hands to a publisher: the events of a claim, and the runs they form. How a
publisher answers (PermanentError, NotSent) is the publisher protocol's: outboxpg.relay.publishers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import orjson

__all__ = ["OutboxEvent", "CLAIM_COLUMNS", "CLAIM_COLUMN_NAMES", "LEASE_TOKEN", "event_from_row", "runs_of"]


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
    # When the event was first due: its deliver_at, or created_at when that came later (None:
    # created_at). The worker's lag counts from it: a scheduled event is no lag before its time.
    due_at: datetime | None = None

    def json(self) -> Any:
        """The payload parsed (orjson)."""
        return orjson.loads(self.payload)


# The columns of outbox_claim() the worker reads, in this order. Rows are read by position (this
# runs for every event), at the positions named here.
CLAIM_COLUMN_NAMES = ("id", "subject", "aggregate_type", "aggregate_id", "event_type", "payload", "headers",
                      "msg_id", "attempts", "created_at", "lease_token", "due_at")
CLAIM_COLUMNS = ", ".join(CLAIM_COLUMN_NAMES)
LEASE_TOKEN = CLAIM_COLUMN_NAMES.index("lease_token")

_EMPTY = b"{}"

# event_from_row runs for every event. A frozen dataclass's generated __init__ sets each field
# through object.__setattr__ (about 1.7 us for these ten); the slots' own setters, called
# directly, do the same in about half that.
_FIELDS = ("id", "subject", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "msg_id",
           "attempt", "created_at", "due_at")
assert tuple(f.name for f in fields(OutboxEvent)) == _FIELDS, "event_from_row must set every field"
assert CLAIM_COLUMN_NAMES[:10] == _FIELDS[:8] + ("attempts", "created_at"), "event_from_row reads by position"
assert CLAIM_COLUMN_NAMES.index("due_at") == 11, "event_from_row reads by position"
(_set_id, _set_subject, _set_aggregate_type, _set_aggregate_id, _set_event_type, _set_payload, _set_headers,
 _set_msg_id, _set_attempt, _set_created_at, _set_due_at) = (OutboxEvent.__dict__[name].__set__ for name in _FIELDS)
_new = object.__new__


def event_from_row(row: tuple[Any, ...]) -> OutboxEvent:
    """Build an event from a claim row whose jsonb columns were loaded as raw bytes."""
    event = _new(OutboxEvent)
    _set_id(event, row[0])
    _set_subject(event, row[1])
    _set_aggregate_type(event, row[2])
    _set_aggregate_id(event, row[3])
    _set_event_type(event, row[4])
    _set_payload(event, row[5])
    _set_headers(event, {} if row[6] == _EMPTY else orjson.loads(row[6]))
    _set_msg_id(event, row[7])
    _set_attempt(event, row[8])
    _set_created_at(event, row[9])
    _set_due_at(event, row[11])
    return event


def runs_of(events: Sequence[OutboxEvent]) -> list[list[int]]:
    """The runs of a claimed batch: the positions of each aggregate's events, grouped by
    (aggregate_type, aggregate_id) in order of first appearance, each group in batch order.

    outbox_claim returns its rows ORDER BY id, so each group is in id order: the order in which
    that aggregate's events must reach the broker. Events of different aggregates may interleave
    in the batch; their runs are independent of each other.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for i, event in enumerate(events):
        key = (event.aggregate_type, event.aggregate_id)
        group = groups.get(key)
        if group is None:
            groups[key] = [i]
        else:
            group.append(i)
    return list(groups.values())

