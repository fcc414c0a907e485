"""Writing events inside the caller's own transaction (psycopg 3, sync or async).

The helpers never commit: the events become visible exactly when the caller's business
transaction commits, and vanish with it if it rolls back.

    with conn.transaction():
        conn.execute("INSERT INTO orders ...")
        outboxpg.enqueue(conn, "order", order_id, "created", {"total": 42})

Trace context: with opentelemetry-api installed (the ``otel`` extra) and a span current, each
event's headers get that span's W3C ``traceparent`` (and ``tracestate``), unless the caller's
headers already hold a traceparent (outboxpg.tracecontext).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import orjson
from psycopg import AsyncConnection, Connection, sql

from outboxpg.tracecontext import current_headers, with_current

__all__ = ["Event", "enqueue", "enqueue_many", "encode_payload"]

Payload = Mapping[str, Any] | list[Any] | bytes | bytearray | memoryview | str


@dataclass(frozen=True, slots=True)
class Event:
    """One event to write. ``payload`` is a dict/list (serialised with orjson) or raw JSON."""

    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Payload
    subject: str | None = None
    headers: Mapping[str, str] | None = field(default=None)
    msg_id: str | None = None


def encode_payload(payload: Payload) -> str:
    """Return the payload as JSON text: dicts and lists through orjson, raw JSON as it is."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload).decode("utf-8")
    if isinstance(payload, str):
        return payload
    if isinstance(payload, (Mapping, list)):
        return orjson.dumps(payload).decode("utf-8")
    raise TypeError(
        f"payload must be a dict, a list or raw JSON (bytes or str), not {type(payload).__name__}"
    )


def _key(name: str, value: Any) -> str:
    """aggregate_type, aggregate_id or event_type as text. Numbers, UUIDs and the like become
    their str(); None and bytes are refused, which str() would turn into 'None' and "b'...'"."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be a str (or a value whose str() is the key), not {type(value).__name__}")
    return str(value)


def _encode_headers(headers: Mapping[str, str] | None) -> str | None:
    return None if headers is None else orjson.dumps(dict(headers)).decode("utf-8")


_INSERT_ONE = sql.SQL(
    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, subject, headers, msg_id) "
    "VALUES (%s, %s, %s, %s::jsonb, %s, coalesce(%s::jsonb, '{}'), coalesce(%s, gen_random_uuid()::text)) "
    "RETURNING id"
)


def _one_params(event: Event) -> tuple[Any, ...]:
    return (
        _key("aggregate_type", event.aggregate_type),
        _key("aggregate_id", event.aggregate_id),
        _key("event_type", event.event_type),
        encode_payload(event.payload),
        event.subject,
        _encode_headers(with_current(event.headers, current_headers())),
        event.msg_id,
    )


@overload
def enqueue(conn: Connection[Any], aggregate_type: str, aggregate_id: str, event_type: str,
            payload: Payload, *, subject: str | None = ..., headers: Mapping[str, str] | None = ...,
            msg_id: str | None = ...) -> int: ...
@overload
def enqueue(conn: AsyncConnection[Any], aggregate_type: str, aggregate_id: str, event_type: str,
            payload: Payload, *, subject: str | None = ..., headers: Mapping[str, str] | None = ...,
            msg_id: str | None = ...) -> Awaitable[int]: ...


def enqueue(conn: Connection[Any] | AsyncConnection[Any], aggregate_type: str, aggregate_id: str,
            event_type: str, payload: Payload, *, subject: str | None = None,
            headers: Mapping[str, str] | None = None, msg_id: str | None = None) -> int | Awaitable[int]:
    """Write one event in the connection's current transaction; returns its id.

    On an ``AsyncConnection`` it returns an awaitable: ``await enqueue(aconn, ...)``.
    """
    params = _one_params(Event(aggregate_type, aggregate_id, event_type, payload, subject, headers, msg_id))
    if isinstance(conn, AsyncConnection):
        return _enqueue_async(conn, params)
    row = conn.execute(_INSERT_ONE, params).fetchone()
    assert row is not None
    return int(row[0])


async def _enqueue_async(conn: AsyncConnection[Any], params: tuple[Any, ...]) -> int:
    cur = await conn.execute(_INSERT_ONE, params)
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def _as_event(item: Event | Mapping[str, Any]) -> Event:
    return item if isinstance(item, Event) else Event(**item)


def _copy_plan(events: Iterable[Event | Mapping[str, Any]]) -> tuple[sql.Composed, list[tuple[Any, ...]]]:
    """The COPY statement and its rows. Optional columns nobody filled in are left out, so the
    table's own defaults apply; a msg_id missing beside others' explicit ones is made here,
    in the same form as the table's default (a random UUID)."""
    batch = [_as_event(e) for e in events]
    trace = current_headers()   # one context for the whole call
    with_subject = any(e.subject is not None for e in batch)
    with_headers = trace is not None or any(e.headers is not None for e in batch)
    with_msg_id = any(e.msg_id is not None for e in batch)
    columns = ["aggregate_type", "aggregate_id", "event_type", "payload"]
    columns += ["subject"] * with_subject + ["headers"] * with_headers + ["msg_id"] * with_msg_id
    rows = []
    for e in batch:
        row: list[Any] = [_key("aggregate_type", e.aggregate_type), _key("aggregate_id", e.aggregate_id),
                          _key("event_type", e.event_type), encode_payload(e.payload)]
        if with_subject:
            row.append(e.subject)
        if with_headers:
            row.append(_encode_headers(with_current(e.headers, trace)) or "{}")
        if with_msg_id:
            row.append(e.msg_id if e.msg_id is not None else str(uuid.uuid4()))
        rows.append(tuple(row))
    stmt = sql.SQL("COPY outbox ({}) FROM STDIN").format(sql.SQL(", ").join(map(sql.Identifier, columns)))
    return stmt, rows


@overload
def enqueue_many(conn: Connection[Any], events: Iterable[Event | Mapping[str, Any]]) -> int: ...
@overload
def enqueue_many(conn: AsyncConnection[Any], events: Iterable[Event | Mapping[str, Any]]) -> Awaitable[int]: ...


def enqueue_many(conn: Connection[Any] | AsyncConnection[Any],
                 events: Iterable[Event | Mapping[str, Any]]) -> int | Awaitable[int]:
    """Write many events with one COPY in the connection's current transaction; returns the count.

    Events are ``Event`` objects or mappings with the same keys. The insert trigger runs once for
    the whole COPY, so idle workers get at most one wakeup.
    """
    stmt, rows = _copy_plan(events)
    if isinstance(conn, AsyncConnection):
        return _enqueue_many_async(conn, stmt, rows)
    if not rows:
        return 0
    with conn.cursor() as cur:
        with cur.copy(stmt) as copy:
            for row in rows:
                copy.write_row(row)
    return len(rows)


async def _enqueue_many_async(conn: AsyncConnection[Any], stmt: sql.Composed, rows: list[tuple[Any, ...]]) -> int:
    if not rows:
        return 0
    async with conn.cursor() as cur:
        async with cur.copy(stmt) as copy:
            for row in rows:
                await copy.write_row(row)
    return len(rows)
