"""asyncpg: a Connection, or one acquired from a pool (also under SQLAlchemy's asyncpg dialect).
Bulk: ``copy_records_to_table`` (binary COPY). Placeholders: ``%s`` becomes ``$1, $2, ...``."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from outboxpg.drivers.protocol import Failure, Row, loaded

_PLACEHOLDER = re.compile(r"%s|%%")


def accepts(conn: object) -> bool:
    module = loaded("asyncpg")
    # A pool's PoolConnectionProxy is an instance of asyncpg.Connection too (asyncpg's metaclass).
    return module is not None and isinstance(conn, module.Connection)


@functools.lru_cache(maxsize=64)
def numbered(query: str) -> str:
    """``%s`` placeholders as asyncpg's ``$1, $2, ...``; ``%%`` as ``%``."""
    counter = iter(range(1, 1 << 16))
    return _PLACEHOLDER.sub(lambda m: "%" if m.group() == "%%" else f"${next(counter)}", query)


class AsyncpgDriver:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def fetch_one(self, query: str, params: Sequence[Any]) -> Row | None:
        row = await self.conn.fetchrow(numbered(query), *params)
        return None if row is None else tuple(row)

    async def execute(self, query: str) -> None:
        await self.conn.execute(query)

    async def copy(self, columns: Sequence[str], rows: Sequence[Row]) -> int:
        status = await self.conn.copy_records_to_table("outbox", columns=list(columns), records=rows)
        return int(status.rsplit(" ", 1)[-1])

    def failure(self, exc: BaseException) -> Failure | None:
        module = loaded("asyncpg")
        if module is None or not isinstance(exc, module.PostgresError):
            return None
        kind = ("undefined_table" if isinstance(exc, module.UndefinedTableError)
                else "undefined_function" if isinstance(exc, module.UndefinedFunctionError)
                else "invalid_text" if isinstance(exc, module.InvalidTextRepresentationError) else "other")
        return Failure(kind, getattr(exc, "message", None), getattr(exc, "detail", None),
                       getattr(exc, "context", None))

    def rebuild(self, exc: BaseException, cls: type[BaseException], message: str) -> BaseException:
        return cls(message)

    def where(self) -> str:
        params, addr = getattr(self.conn, "_params", None), getattr(self.conn, "_addr", None)
        if isinstance(self.conn, loaded("asyncpg").pool.PoolConnectionProxy):
            inner = getattr(self.conn, "_con", None)
            params, addr = getattr(inner, "_params", None), getattr(inner, "_addr", None)
        database = getattr(params, "database", "?")
        where = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        return f"database {database} on {where}"
