"""psycopg 3: Connection and AsyncConnection (also under SQLAlchemy and Django)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psycopg import AsyncConnection, Connection, errors, sql
from psycopg.rows import tuple_row

from outboxpg import statements
from outboxpg.drivers.protocol import Failure, Row


def _copy_statement(columns: Sequence[str]) -> sql.Composed:
    return statements.COPY_EVENTS.format(sql.SQL(", ").join(map(sql.Identifier, columns)))


def failure(exc: BaseException) -> Failure | None:
    if not isinstance(exc, errors.Error) or exc.diag is None:
        return None
    kind = ("undefined_table" if isinstance(exc, errors.UndefinedTable)
            else "undefined_function" if isinstance(exc, errors.UndefinedFunction)
            else "invalid_text" if isinstance(exc, errors.InvalidTextRepresentation) else "other")
    return Failure(kind, exc.diag.message_primary, exc.diag.message_detail, exc.diag.context)


def _where(conn: Connection[Any] | AsyncConnection[Any]) -> str:
    info = conn.info
    return f"database {info.dbname} on {info.host}:{info.port}"


class PsycopgDriver:
    def __init__(self, conn: Connection[Any]) -> None:
        self.conn = conn

    def fetch_one(self, query: str, params: Sequence[Any]) -> Row | None:
        with self.conn.cursor(row_factory=tuple_row) as cur:
            return cur.execute(query, params).fetchone()

    def execute(self, query: str) -> None:
        self.conn.execute(query)

    def copy(self, columns: Sequence[str], rows: Sequence[Row]) -> int:
        with self.conn.cursor() as cur:
            with cur.copy(_copy_statement(columns)) as copy:
                for row in rows:
                    copy.write_row(row)
            return cur.rowcount

    def failure(self, exc: BaseException) -> Failure | None:
        return failure(exc)

    def rebuild(self, exc: BaseException, cls: type[BaseException], message: str) -> BaseException:
        if isinstance(exc, errors.Error) and issubclass(cls, errors.Error):
            return cls(message, info=exc.pgresult, encoding=self.conn.info.encoding)
        return cls(message)

    def where(self) -> str:
        return _where(self.conn)


class AsyncPsycopgDriver:
    def __init__(self, conn: AsyncConnection[Any]) -> None:
        self.conn = conn

    async def fetch_one(self, query: str, params: Sequence[Any]) -> Row | None:
        async with self.conn.cursor(row_factory=tuple_row) as cur:
            return await (await cur.execute(query, params)).fetchone()

    async def execute(self, query: str) -> None:
        await self.conn.execute(query)

    async def copy(self, columns: Sequence[str], rows: Sequence[Row]) -> int:
        async with self.conn.cursor() as cur:
            async with cur.copy(_copy_statement(columns)) as copy:
                for row in rows:
                    await copy.write_row(row)
            return cur.rowcount

    def failure(self, exc: BaseException) -> Failure | None:
        return failure(exc)

    def rebuild(self, exc: BaseException, cls: type[BaseException], message: str) -> BaseException:
        if isinstance(exc, errors.Error) and issubclass(cls, errors.Error):
            return cls(message, info=exc.pgresult, encoding=self.conn.info.encoding)
        return cls(message)

    def where(self) -> str:
        return _where(self.conn)
