"""Writing events inside the caller's own transaction (psycopg 3, psycopg2, asyncpg, SQLAlchemy 2,
Django; sync or async: outboxpg.drivers).

The helpers never commit: the events become visible exactly when the caller's business
transaction commits, and vanish with it if it rolls back.

    with conn.transaction():
        conn.execute("INSERT INTO orders ...")
        outboxpg.enqueue(conn, "order", order_id, "created", {"total": 42})

Trace context: with opentelemetry-api installed (the ``otel`` extra) and a span current, each
event's headers get that span's W3C ``traceparent`` (and ``tracestate``), unless the caller's
headers already hold a traceparent (outboxpg.tracecontext).

Payloads: dicts, lists, dataclasses and Pydantic models are written with orjson
(``PAYLOAD_OPTIONS``, and ``json_default`` for what orjson does not know: a ``Decimal`` becomes a
JSON string, every digit kept); a ``str`` or ``bytes`` is raw JSON text, stored as PostgreSQL
parses it. A value none of them can write is refused before anything is sent.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, overload

import orjson
from psycopg import AsyncConnection, Connection, errors

from outboxpg import drivers, statements
from outboxpg.tracecontext import current_headers, with_current

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["Event", "Enqueued", "NotInstalled", "enqueue", "enqueue_many", "encode_payload", "json_default",
           "PAYLOAD_OPTIONS"]


class SupportsModelDump(Protocol):
    """A Pydantic (v2) model, or anything else with the same ``model_dump(mode="json")``."""

    def model_dump(self, *, mode: str) -> Any: ...


Payload: TypeAlias = ("Mapping[Any, Any] | list[Any] | DataclassInstance | SupportsModelDump"
                      " | bytes | bytearray | memoryview | str")


class NotInstalled(errors.UndefinedTable):
    """The producer helpers' insert found no outbox table: the schema is not installed in this
    database (or not on the session's search_path). An ``UndefinedTable``, so ``except
    psycopg.Error`` (or ``psycopg.ProgrammingError``, ``UndefinedTable``) still catches it; ``diag``
    and ``sqlstate`` (42P01) are the server's."""

    __module__ = "outboxpg"   # where it is imported from (as psycopg's errors say psycopg.errors)


@dataclass(frozen=True, slots=True)
class Event:
    """One event to write. ``payload``: a dict, list, dataclass or Pydantic model (written with
    orjson, see ``encode_payload``) or raw JSON text (str or bytes)."""

    aggregate_type: str
    aggregate_id: str
    event_type: str
    payload: Payload
    subject: str | None = None
    headers: Mapping[str, str] | None = field(default=None)
    msg_id: str | None = None
    #: Not handed out before this time (a timezone-aware datetime); None: at once.
    deliver_at: datetime | None = None
    #: While an unfinished event holds this key, an event with the same key is not written.
    idempotency_key: str | None = None
    #: Discarded (reason 'expired') if not handed out by this time (timezone-aware); None: never.
    expires_at: datetime | None = None


class Enqueued(int):
    """The id ``enqueue`` returns (an int). ``duplicate``: true when the event was not written
    because an unfinished event holds its idempotency_key; the id is then that event's."""

    duplicate: bool

    def __new__(cls, event_id: int, duplicate: bool = False) -> Enqueued:
        self = super().__new__(cls, event_id)
        self.duplicate = duplicate
        return self

    # As text it is the id, as any int (str(), f-strings, SQL parameters); repr says the rest.
    __str__ = int.__repr__

    def __repr__(self) -> str:
        return f"Enqueued({int(self)}, duplicate={self.duplicate})"


#: The orjson options payloads are written with: keys may be ints, floats, bools, None, UUIDs,
#: dates, times, datetimes and enums too (Python's own json module takes int keys); they become
#: their JSON text. (dataclasses, datetimes, UUIDs, enums, tuples: orjson writes them natively.)
PAYLOAD_OPTIONS = orjson.OPT_NON_STR_KEYS


def json_default(value: Any) -> Any:
    """orjson's ``default`` for payloads: what orjson does not write itself.

    - ``Decimal`` (what psycopg returns for ``numeric``): a JSON string, ``str(value)``
      (``"12.30"``, ``"1E-30"``), so every digit reaches the consumer; as a JSON number it would
      be read as a binary float by most JSON readers (JavaScript's, orjson's, Go's into
      ``float64``). ``Decimal(text)`` gives it back.
    - an object with ``model_dump`` (a Pydantic v2 model): ``value.model_dump(mode="json")``.
    - any other mapping (``MappingProxyType``, ...): as a dict.

    Anything else raises ``TypeError`` naming the type and what to do.
    """
    if isinstance(value, Decimal):
        return str(value)
    dump = getattr(value, "model_dump", None)
    if callable(dump) and not isinstance(value, type):
        return dump(mode="json")
    if isinstance(value, Mapping):
        return dict(value)
    raise _Unencodable(
        f"payload holds a value of type {_type_name(value)}, which outboxpg cannot write as JSON: convert it "
        "to a dict, list, str, number, Decimal, datetime, UUID, enum or dataclass first, or pass the payload "
        "as raw JSON text (str or bytes)")


class _Unencodable(TypeError):
    """json_default's refusal, told apart from orjson's own errors (integers over 64 bits, ...)."""


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def encode_payload(payload: Payload) -> str:
    """Return the payload as JSON text: raw JSON (str, bytes) as it is; dicts, lists, dataclasses and
    Pydantic models through orjson (``PAYLOAD_OPTIONS``, ``json_default``). Raises ``TypeError``
    (one line, naming the type) for what cannot be written, before anything is sent."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload).decode("utf-8")
    if isinstance(payload, str):
        return payload
    if (isinstance(payload, (Mapping, list)) or _is_dataclass_instance(payload)
            or (callable(getattr(payload, "model_dump", None)) and not isinstance(payload, type))):
        try:
            return orjson.dumps(payload, default=json_default, option=PAYLOAD_OPTIONS).decode("utf-8")
        except orjson.JSONEncodeError as exc:
            if isinstance(exc.__cause__, _Unencodable):
                raise TypeError(str(exc.__cause__)) from None
            raise TypeError(f"payload cannot be written as JSON: {exc}") from exc
    raise TypeError(
        "payload must be a dict, a list, a dataclass, a Pydantic model or raw JSON text (str or bytes), "
        f"not {_type_name(payload)}")


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _is_raw(payload: Any) -> bool:
    return isinstance(payload, (str, bytes, bytearray, memoryview))


def _not_installed(driver: drivers.Driver | drivers.AsyncDriver, exc: BaseException,
                   failure: drivers.Failure) -> BaseException:
    said = failure.primary or "undefined table"
    return driver.rebuild(exc, NotInstalled, f"the outbox schema is not installed in {driver.where()} ({said}): "
                          "run outboxpg migrate --dsn ... against it first")


_COPY_LINE = re.compile(r"COPY outbox, line (\d+)")


def _not_json(driver: drivers.Driver | drivers.AsyncDriver, exc: BaseException,
              failure: drivers.Failure) -> BaseException:
    """PostgreSQL refused a raw payload as JSON: say so in one line, in the driver's own error class
    (psycopg's InvalidTextRepresentation, psycopg2's, asyncpg's InvalidTextRepresentationError)."""
    line = _COPY_LINE.search(failure.context or "")
    which = f"event {line.group(1)} of the batch: " if line else ""
    detail = failure.detail or failure.primary or "invalid JSON"
    return driver.rebuild(exc, type(exc),
                          f"{which}payload is not JSON ({detail.rstrip('.')}): a str or bytes payload is taken as raw "
                          "JSON text; pass a dict or list, or a str as JSON (orjson.dumps(text))")


def _translated(driver: drivers.Driver | drivers.AsyncDriver, exc: BaseException, raw: bool) -> BaseException | None:
    """The one-line error to raise instead of ``exc``, or None to let ``exc`` through."""
    failure = driver.failure(exc)
    if failure is None:
        return None
    if failure.kind == "undefined_table":
        return _not_installed(driver, exc, failure)
    if failure.kind == "invalid_text" and raw:
        return _not_json(driver, exc, failure)
    return None


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


def _moment(name: str, value: datetime | None) -> datetime | None:
    """A naive datetime would be read in the session's time zone, which the caller may not know."""
    if value is not None and (not isinstance(value, datetime) or value.utcoffset() is None):
        raise TypeError(f"{name} must be a timezone-aware datetime, not {value!r}")
    return value


def _one_params(event: Event) -> tuple[Any, ...]:
    return (
        _key("aggregate_type", event.aggregate_type),
        _key("aggregate_id", event.aggregate_id),
        _key("event_type", event.event_type),
        encode_payload(event.payload),
        event.subject,
        _encode_headers(with_current(event.headers, current_headers())),
        event.msg_id,
        _moment("deliver_at", event.deliver_at),
        event.idempotency_key,
        _moment("expires_at", event.expires_at),
    )


#: What the helpers take as ``conn``: a psycopg 3 Connection or AsyncConnection (typed), or any
#: connection outboxpg.drivers recognises: psycopg2, asyncpg (also from a pool), SQLAlchemy 2
#: Connection, Session, AsyncConnection, AsyncSession, Django's connection.
AnyConnection: TypeAlias = Any


@overload
def enqueue(conn: Connection[Any], aggregate_type: str, aggregate_id: str, event_type: str,
            payload: Payload, *, subject: str | None = ..., headers: Mapping[str, str] | None = ...,
            msg_id: str | None = ..., deliver_at: datetime | None = ...,
            idempotency_key: str | None = ..., expires_at: datetime | None = ...,
            savepoint: bool = ...) -> Enqueued: ...
@overload
def enqueue(conn: AsyncConnection[Any], aggregate_type: str, aggregate_id: str, event_type: str,
            payload: Payload, *, subject: str | None = ..., headers: Mapping[str, str] | None = ...,
            msg_id: str | None = ..., deliver_at: datetime | None = ...,
            idempotency_key: str | None = ..., expires_at: datetime | None = ...,
            savepoint: bool = ...) -> Awaitable[Enqueued]: ...
@overload
def enqueue(conn: AnyConnection, aggregate_type: str, aggregate_id: str, event_type: str,
            payload: Payload, *, subject: str | None = ..., headers: Mapping[str, str] | None = ...,
            msg_id: str | None = ..., deliver_at: datetime | None = ...,
            idempotency_key: str | None = ..., expires_at: datetime | None = ...,
            savepoint: bool = ...) -> Any: ...


def enqueue(conn: AnyConnection, aggregate_type: str, aggregate_id: str,
            event_type: str, payload: Payload, *, subject: str | None = None,
            headers: Mapping[str, str] | None = None, msg_id: str | None = None,
            deliver_at: datetime | None = None, idempotency_key: str | None = None,
            expires_at: datetime | None = None, savepoint: bool = False) -> Enqueued | Awaitable[Enqueued]:
    """Write one event in the connection's current transaction; returns its id (an ``Enqueued``).

    ``conn``: a psycopg 3 or psycopg2 connection, an asyncpg connection (also one from a pool), a
    SQLAlchemy 2 Connection, Session, AsyncConnection or AsyncSession, or a Django connection
    (outboxpg.drivers). ``deliver_at`` (timezone-aware): the event is not handed out before it;
    later events of its aggregate wait behind it. ``idempotency_key``: while an unfinished event
    holds the key, no event is written and the id returned is that event's, with ``.duplicate``
    true. ``expires_at`` (timezone-aware): not handed out by then, it is discarded instead.
    ``savepoint``: write it inside a savepoint, so that an error here (the schema missing, a raw
    payload PostgreSQL refuses) leaves the caller's transaction usable; two more round trips. On
    an async connection it returns an awaitable: ``await enqueue(aconn, ...)``.
    """
    params = _one_params(Event(aggregate_type, aggregate_id, event_type, payload, subject, headers, msg_id,
                               deliver_at, idempotency_key, expires_at))
    raw = _is_raw(payload)
    if drivers.is_async(conn):
        return _enqueue_async(conn, params, idempotency_key, raw, savepoint)
    driver = drivers.sync_driver(conn)
    if savepoint:
        driver.execute(statements.SAVEPOINT)
    try:
        row = driver.fetch_one(statements.INSERT_EVENT, params)
        if row is None:
            row = driver.fetch_one(statements.IDEMPOTENCY_EVENT, (idempotency_key,))
            result = _duplicate_of(row, idempotency_key)
        else:
            result = Enqueued(row[0])
    except Exception as exc:
        if savepoint:
            driver.execute(statements.ROLLBACK_TO_SAVEPOINT)
            driver.execute(statements.RELEASE_SAVEPOINT)
        better = _translated(driver, exc, raw)
        if better is None:
            raise
        raise better from exc
    if savepoint:
        driver.execute(statements.RELEASE_SAVEPOINT)
    return result


async def _enqueue_async(conn: AnyConnection, params: tuple[Any, ...], key: str | None, raw: bool,
                         savepoint: bool) -> Enqueued:
    driver = await drivers.async_driver(conn)
    if savepoint:
        await driver.execute(statements.SAVEPOINT)
    try:
        row = await driver.fetch_one(statements.INSERT_EVENT, params)
        if row is None:
            row = await driver.fetch_one(statements.IDEMPOTENCY_EVENT, (key,))
            result = _duplicate_of(row, key)
        else:
            result = Enqueued(row[0])
    except Exception as exc:
        if savepoint:
            await driver.execute(statements.ROLLBACK_TO_SAVEPOINT)
            await driver.execute(statements.RELEASE_SAVEPOINT)
        better = _translated(driver, exc, raw)
        if better is None:
            raise
        raise better from exc
    if savepoint:
        await driver.execute(statements.RELEASE_SAVEPOINT)
    return result


def _duplicate_of(held: tuple[Any, ...] | None, key: str | None) -> Enqueued:
    if key is None or held is None or held[0] is None:
        # The insert wrote no row and no event holds the key: not outboxpg's trigger at work.
        raise RuntimeError(f"the insert into outbox wrote no row (idempotency_key {key!r} is held by no event)")
    return Enqueued(held[0], duplicate=True)


def _as_event(item: Event | Mapping[str, Any]) -> Event:
    return item if isinstance(item, Event) else Event(**item)


def _copy_plan(events: Iterable[Event | Mapping[str, Any]]) -> tuple[list[str], list[tuple[Any, ...]], bool]:
    """The columns and rows to COPY. Optional columns nobody filled in are left out, so the
    table's own defaults apply; a msg_id missing beside others' explicit ones is made here,
    in the same form as the table's default (a random UUID). The flag: whether any payload is raw
    JSON text (which PostgreSQL may refuse)."""
    batch = [_as_event(e) for e in events]
    trace = current_headers()   # one context for the whole call
    with_subject = any(e.subject is not None for e in batch)
    with_headers = trace is not None or any(e.headers is not None for e in batch)
    with_msg_id = any(e.msg_id is not None for e in batch)
    with_deliver_at = any(e.deliver_at is not None for e in batch)
    with_key = any(e.idempotency_key is not None for e in batch)
    with_expiry = any(e.expires_at is not None for e in batch)
    columns = ["aggregate_type", "aggregate_id", "event_type", "payload"]
    columns += ["subject"] * with_subject + ["headers"] * with_headers + ["msg_id"] * with_msg_id
    columns += ["deliver_at"] * with_deliver_at + ["idempotency_key"] * with_key + ["expires_at"] * with_expiry
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
        if with_deliver_at:
            row.append(_moment("deliver_at", e.deliver_at))
        if with_key:
            row.append(e.idempotency_key)
        if with_expiry:
            row.append(_moment("expires_at", e.expires_at))
        rows.append(tuple(row))
    return columns, rows, any(_is_raw(e.payload) for e in batch)


@overload
def enqueue_many(conn: Connection[Any], events: Iterable[Event | Mapping[str, Any]], *,
                 savepoint: bool = ...) -> int: ...
@overload
def enqueue_many(conn: AsyncConnection[Any], events: Iterable[Event | Mapping[str, Any]], *,
                 savepoint: bool = ...) -> Awaitable[int]: ...
@overload
def enqueue_many(conn: AnyConnection, events: Iterable[Event | Mapping[str, Any]], *,
                 savepoint: bool = ...) -> Any: ...


def enqueue_many(conn: AnyConnection, events: Iterable[Event | Mapping[str, Any]], *,
                 savepoint: bool = False) -> int | Awaitable[int]:
    """Write many events with one COPY in the connection's current transaction; returns how many
    were written (events whose idempotency_key an unfinished event holds are not).

    ``conn``: any connection ``enqueue`` takes; the bulk path is the driver's COPY (psycopg's
    copy, psycopg2's copy_expert, asyncpg's copy_records_to_table). Events are ``Event`` objects
    or mappings with the same keys. The insert trigger runs once for the whole COPY, so idle
    workers get at most one wakeup. ``savepoint``: as for ``enqueue``.
    """
    columns, rows, raw = _copy_plan(events)
    if drivers.is_async(conn):
        return _enqueue_many_async(conn, columns, rows, raw, savepoint)
    if not rows:
        return 0
    driver = drivers.sync_driver(conn)
    if savepoint:
        driver.execute(statements.SAVEPOINT)
    try:
        written = driver.copy(columns, rows)
    except Exception as exc:
        if savepoint:
            driver.execute(statements.ROLLBACK_TO_SAVEPOINT)
            driver.execute(statements.RELEASE_SAVEPOINT)
        better = _translated(driver, exc, raw)
        if better is None:
            raise
        raise better from exc
    if savepoint:
        driver.execute(statements.RELEASE_SAVEPOINT)
    return written


async def _enqueue_many_async(conn: AnyConnection, columns: list[str], rows: list[tuple[Any, ...]], raw: bool,
                              savepoint: bool) -> int:
    if not rows:
        return 0
    driver = await drivers.async_driver(conn)
    if savepoint:
        await driver.execute(statements.SAVEPOINT)
    try:
        written = await driver.copy(columns, rows)
    except Exception as exc:
        if savepoint:
            await driver.execute(statements.ROLLBACK_TO_SAVEPOINT)
            await driver.execute(statements.RELEASE_SAVEPOINT)
        better = _translated(driver, exc, raw)
        if better is None:
            raise
        raise better from exc
    if savepoint:
        await driver.execute(statements.RELEASE_SAVEPOINT)
    return written
