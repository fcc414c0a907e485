"""Replaying published events from Python: ``outbox_replay`` (migration 0018), sync or async.

    n = outboxpg.replay(conn, aggregate_type="order", aggregate_id="o-7")    # the copies keep their msg_id
    n = await outboxpg.replay(aconn, since=an_hour_ago, new_msg_id=True)     # a forced redelivery

Copies made by earlier replays are left out unless ``include_replays=True``: replaying an
aggregate twice sends its events twice, not its events and the first copies.

Like the producer helpers it never commits: the copies go out when the caller's transaction
commits. Runs as a member of ``outbox_operator`` (or the owner). The rules (filters combined with
AND, at least one; ids that are not published left out; original order; at most ``max_events``
a call, all or nothing) are the SQL function's: docs/how-to/replay.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from datetime import datetime
from typing import Any, overload

from psycopg import AsyncConnection, Connection, sql

from outboxpg import statements

__all__ = ["DEFAULT_MAX_EVENTS", "PARAMETERS", "FILTERS", "arguments", "replay"]

# outbox_replay's parameters, in its order, with their SQL types: the helper and `outboxpg replay`
# build their calls from this. outbox_replay_candidates takes the filters and include_replays
# (all but new_msg_id and max_events).
PARAMETERS = {"ids": "bigint[]", "aggregate_type": "text", "aggregate_id": "text", "event_type": "text",
              "since": "timestamptz", "until": "timestamptz", "new_msg_id": "boolean", "max_events": "integer",
              "include_replays": "boolean"}
FILTERS = tuple(name for name in PARAMETERS if name not in ("new_msg_id", "max_events", "include_replays"))
# outbox_replay's default: more matches than this, and it copies none (InvalidParameterValue).
DEFAULT_MAX_EVENTS = 10_000


def arguments(values: Mapping[str, Any]) -> sql.Composed:
    """``ids => %(ids)s::bigint[], ...``: ``values`` (parameter names) as named SQL arguments."""
    return sql.SQL(", ").join(statements.NAMED_ARGUMENT.format(sql.Identifier(name), sql.Placeholder(name),
                                                             sql.SQL(PARAMETERS[name]))
                              for name in values)


@overload
def replay(conn: Connection[Any], *, ids: Sequence[int] | None = ..., aggregate_type: str | None = ...,
           aggregate_id: str | None = ..., event_type: str | None = ..., since: datetime | None = ...,
           until: datetime | None = ..., new_msg_id: bool = ..., max_events: int = ...,
           include_replays: bool = ...) -> int: ...
@overload
def replay(conn: AsyncConnection[Any], *, ids: Sequence[int] | None = ..., aggregate_type: str | None = ...,
           aggregate_id: str | None = ..., event_type: str | None = ..., since: datetime | None = ...,
           until: datetime | None = ..., new_msg_id: bool = ..., max_events: int = ...,
           include_replays: bool = ...) -> Awaitable[int]: ...


def replay(conn: Connection[Any] | AsyncConnection[Any], *, ids: Sequence[int] | None = None,
           aggregate_type: str | None = None, aggregate_id: str | None = None, event_type: str | None = None,
           since: datetime | None = None, until: datetime | None = None,
           new_msg_id: bool = False, max_events: int = DEFAULT_MAX_EVENTS,
           include_replays: bool = False) -> int | Awaitable[int]:
    """Copy the published events the filters match as new events (``outbox_replay``); returns how
    many; copies made by earlier replays only with ``include_replays``. PostgreSQL refuses
    (psycopg.errors.InvalidParameterValue, nothing copied) no filter at all, and more than
    ``max_events`` matching events (the message names max_events).

    On an ``AsyncConnection`` it returns an awaitable: ``await replay(aconn, ...)``.
    """
    given = {"ids": list(ids) if ids is not None else None, "aggregate_type": aggregate_type,
             "aggregate_id": aggregate_id, "event_type": event_type, "since": since, "until": until}
    values = {**{k: v for k, v in given.items() if v is not None}, "new_msg_id": new_msg_id,
              "max_events": max_events, "include_replays": include_replays}
    query = statements.REPLAY.format(arguments(values))
    if isinstance(conn, AsyncConnection):
        return _replay_async(conn, query, values)
    row = conn.execute(query, values).fetchone()
    assert row is not None
    return int(row[0])


async def _replay_async(conn: AsyncConnection[Any], query: sql.Composed, values: dict[str, Any]) -> int:
    cur = await conn.execute(query, values)
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])
