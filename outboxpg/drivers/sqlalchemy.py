"""SQLAlchemy 2: Connection, Session, AsyncConnection, AsyncSession. The statements run on the
connection's own driver connection (psycopg 3, psycopg2, asyncpg), in the transaction SQLAlchemy
has begun: a Connection or Session that has not begun one yet begins it (SQLAlchemy's autobegin,
as its own execute would), so the event commits or rolls back with what the caller does next."""

from __future__ import annotations

from typing import Any

from outboxpg import statements
from outboxpg.drivers.protocol import loaded


def accepts(conn: object) -> bool:
    engine, orm = loaded("sqlalchemy.engine"), loaded("sqlalchemy.orm")
    return ((engine is not None and isinstance(conn, engine.Connection))
            or (orm is not None and isinstance(conn, orm.Session)))


def accepts_async(conn: object) -> bool:
    ext = loaded("sqlalchemy.ext.asyncio")
    return ext is not None and isinstance(conn, (ext.AsyncConnection, ext.AsyncSession))


def driver_connection(conn: Any) -> Any:
    """The DB-API connection under a Connection or Session, in a begun transaction."""
    orm = loaded("sqlalchemy.orm")
    if orm is not None and isinstance(conn, orm.Session):
        conn = conn.connection()        # begins the session's transaction if need be
    if not conn.in_transaction():
        conn.begin()
    return conn.connection.driver_connection


async def async_driver_connection(conn: Any) -> Any:
    """The driver connection under an AsyncConnection or AsyncSession, in a begun transaction.

    SQLAlchemy's asyncpg adapter starts the asyncpg transaction only with its first statement:
    when it has not yet, it is started here, so the event cannot commit on its own."""
    ext = loaded("sqlalchemy.ext.asyncio")
    if isinstance(conn, ext.AsyncSession):
        conn = await conn.connection()
    if not conn.in_transaction():
        await conn.begin()
    raw = await conn.get_raw_connection()
    adapted = raw.dbapi_connection
    if getattr(adapted, "_transaction", False) is None and not getattr(adapted, "autocommit", True):
        start = getattr(adapted, "_start_transaction", None)
        if start is not None:
            await start()
        else:                           # another SQLAlchemy version: let its own execute begin
            await conn.exec_driver_sql(statements.NOTHING)
    return raw.driver_connection
