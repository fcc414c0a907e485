"""The driver boundary: what outboxpg asks of a database connection, whatever its library.

outboxpg's producer helpers (and any other helper that runs its SQL inside the caller's
transaction) talk to a ``Driver`` (sync) or an ``AsyncDriver`` (async): one statement with
parameters and at most one row back, a statement without parameters, and a bulk insert into
``outbox`` (COPY where the library has it). One module per library says how:

    psycopg3   psycopg 3 Connection / AsyncConnection (the core dependency)
    psycopg2   a psycopg2 connection
    asyncpg    an asyncpg Connection, or one acquired from a pool
    sqlalchemy SQLAlchemy 2 Connection, Session, AsyncConnection, AsyncSession: their own
               connection's driver (psycopg 3, psycopg2 or asyncpg) after SQLAlchemy's autobegin
    django     django.db.connection / connections[alias] (PostgreSQL backend): its psycopg 3 or
               psycopg2 connection

A library is recognised by the type of the object, and only when it has been imported already
(sys.modules): outboxpg imports none of the optional ones itself.

Statements are written with ``%s`` placeholders (psycopg's); the asyncpg driver turns them into
``$1, $2, ...``. None of the drivers commits or rolls back: the statements run in whatever
transaction the connection is in.

The documented internal entry point for one statement is ``fetch_one(conn, query, params)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any

import psycopg

from outboxpg.drivers import psycopg3 as pg3
from outboxpg.drivers.protocol import AsyncDriver, Driver, Failure, Row

__all__ = ["Row", "Failure", "Driver", "AsyncDriver", "is_async", "sync_driver", "async_driver", "fetch_one"]


def is_async(conn: object) -> bool:
    """Whether ``conn`` is one of the asynchronous connections (its helpers return awaitables)."""
    if isinstance(conn, psycopg.AsyncConnection):
        return True
    if isinstance(conn, psycopg.Connection):
        return False
    from outboxpg.drivers import asyncpg, sqlalchemy
    return asyncpg.accepts(conn) or sqlalchemy.accepts_async(conn)


def sync_driver(conn: object) -> Driver:
    """The Driver for a synchronous connection; TypeError naming the type for anything else."""
    if isinstance(conn, psycopg.Connection):   # the core one first: every enqueue comes here
        return pg3.PsycopgDriver(conn)
    from outboxpg.drivers import django, psycopg2, sqlalchemy

    if psycopg2.accepts(conn):
        return psycopg2.Psycopg2Driver(conn)
    if sqlalchemy.accepts(conn):
        return raw_driver(sqlalchemy.driver_connection(conn), f"a SQLAlchemy {type(conn).__name__}")
    if django.accepts(conn):
        return raw_driver(django.driver_connection(conn), "a Django connection")
    raise _unsupported(conn)


def raw_driver(raw: object, what: str) -> Driver:
    """The Driver for the DB-API connection under a SQLAlchemy or Django one."""
    from outboxpg.drivers import psycopg2

    if isinstance(raw, psycopg.Connection):
        return pg3.PsycopgDriver(raw)
    if psycopg2.accepts(raw):
        return psycopg2.Psycopg2Driver(raw)
    raise TypeError(f"{what} on {_type_name(raw)}: outboxpg takes PostgreSQL through psycopg 3 or psycopg2 here")


async def async_driver(conn: object) -> AsyncDriver:
    """The AsyncDriver for an asynchronous connection (SQLAlchemy's autobegin included)."""
    if isinstance(conn, psycopg.AsyncConnection):
        return pg3.AsyncPsycopgDriver(conn)
    from outboxpg.drivers import asyncpg, sqlalchemy

    if asyncpg.accepts(conn):
        return asyncpg.AsyncpgDriver(conn)
    if sqlalchemy.accepts_async(conn):
        raw = await sqlalchemy.async_driver_connection(conn)
        if isinstance(raw, psycopg.AsyncConnection):
            return pg3.AsyncPsycopgDriver(raw)
        if asyncpg.accepts(raw):
            return asyncpg.AsyncpgDriver(raw)
        raise TypeError(f"a SQLAlchemy {type(conn).__name__} on {_type_name(raw)}: outboxpg takes PostgreSQL "
                        "through psycopg 3 or asyncpg here")
    raise _unsupported(conn)


def fetch_one(conn: object, query: str, params: Sequence[Any] = ()) -> Row | None | Awaitable[Row | None]:
    """Run one statement (``%s`` placeholders) with ``params`` on any connection the producer
    helpers take, in its current transaction; its first row as a tuple, or None. On an async
    connection it returns an awaitable. The driver's own errors come through as they are.

        row = fetch_one(session, "SELECT outbox_inbox_receive(%s, %s)", (consumer, msg_id))
    """
    if is_async(conn):
        return _fetch_one_async(conn, query, params)
    return sync_driver(conn).fetch_one(query, params)


async def _fetch_one_async(conn: object, query: str, params: Sequence[Any]) -> Row | None:
    return await (await async_driver(conn)).fetch_one(query, params)


def _type_name(value: object) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def _unsupported(conn: object) -> TypeError:
    return TypeError(
        f"outboxpg cannot write through a {_type_name(conn)}: pass a psycopg 3 or psycopg2 connection, an asyncpg "
        "connection, a SQLAlchemy 2 Connection, Session, AsyncConnection or AsyncSession, or a Django connection")
