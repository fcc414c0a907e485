"""psycopg2: a connection (also under SQLAlchemy's psycopg2 dialect and Django's psycopg2 backend).
Bulk: COPY ... FROM STDIN in text format through ``copy_expert``."""

from __future__ import annotations

import io
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from psycopg import sql

from outboxpg import statements
from outboxpg.drivers.protocol import Failure, Row, loaded

_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"})


def accepts(conn: object) -> bool:
    extensions = loaded("psycopg2.extensions")
    return extensions is not None and isinstance(conn, extensions.connection)


def _field(value: Any) -> str:
    """One value in COPY's text format: None as \\N, backslash and the separators escaped."""
    if value is None:
        return "\\N"
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value).translate(_ESCAPES)


def copy_text(rows: Sequence[Row]) -> str:
    return "".join("\t".join(map(_field, row)) + "\n" for row in rows)


class Psycopg2Driver:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def fetch_one(self, query: str, params: Sequence[Any]) -> Row | None:
        with self.conn.cursor() as cur:
            cur.execute(query, tuple(params))
            if cur.description is None:
                return None
            row = cur.fetchone()
            return None if row is None else tuple(row)

    def execute(self, query: str) -> None:
        with self.conn.cursor() as cur:
            cur.execute(query)

    def copy(self, columns: Sequence[str], rows: Sequence[Row]) -> int:
        stmt = statements.COPY_EVENTS.format(sql.SQL(", ").join(map(sql.Identifier, columns))).as_string()
        with self.conn.cursor() as cur:
            cur.copy_expert(stmt, io.StringIO(copy_text(rows)))
            return int(cur.rowcount)

    def failure(self, exc: BaseException) -> Failure | None:
        pg = loaded("psycopg2")
        if pg is None or not isinstance(exc, pg.Error) or exc.diag is None:
            return None
        errors = loaded("psycopg2.errors")
        kind = ("undefined_table" if errors is not None and isinstance(exc, errors.UndefinedTable)
                else "undefined_function" if errors is not None and isinstance(exc, errors.UndefinedFunction)
                else "invalid_text" if errors is not None and isinstance(exc, errors.InvalidTextRepresentation)
                else "other")
        return Failure(kind, exc.diag.message_primary, exc.diag.message_detail, exc.diag.context)

    def rebuild(self, exc: BaseException, cls: type[BaseException], message: str) -> BaseException:
        return cls(message)

    def where(self) -> str:
        info = self.conn.info
        return f"database {info.dbname} on {info.host}:{info.port}"
