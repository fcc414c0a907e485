"""What every driver module shares: the row, the failure, the two protocols, and how an optional
library is looked up (only when it has been imported already). The package (outboxpg.drivers)
picks a driver; the driver modules import this module, never the package."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["AsyncDriver", "Driver", "Failure", "Row", "loaded"]

Row = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Failure:
    """What a driver's exception says, in the terms the helpers' one-line errors need."""

    kind: str   # "undefined_table" (42P01), "undefined_function" (42883), "invalid_text" (22P02) or "other"
    primary: str | None
    detail: str | None
    context: str | None


class Driver(Protocol):
    """A synchronous connection, as outboxpg uses it."""

    def fetch_one(self, query: str, params: Sequence[Any]) -> Row | None:
        """Run ``query`` (``%s`` placeholders) with ``params``; its first row as a tuple, or None."""

    def execute(self, query: str) -> None:
        """Run a statement without parameters (SAVEPOINT ...)."""

    def copy(self, columns: Sequence[str], rows: Sequence[Row]) -> int:
        """Insert ``rows`` into outbox's ``columns`` in bulk; how many rows were written."""

    def failure(self, exc: BaseException) -> Failure | None:
        """What ``exc`` is, when it is this driver's database error; None otherwise."""

    def rebuild(self, exc: BaseException, cls: type[BaseException], message: str) -> BaseException:
        """An exception of ``cls`` saying ``message``, carrying what the driver keeps of ``exc``."""

    def where(self) -> str:
        """'database shop on db:5432' (never the user or the password)."""


class AsyncDriver(Protocol):
    """An asynchronous connection, as outboxpg uses it (the same as Driver, awaited)."""

    async def fetch_one(self, query: str, params: Sequence[Any]) -> Row | None: ...

    async def execute(self, query: str) -> None: ...

    async def copy(self, columns: Sequence[str], rows: Sequence[Row]) -> int: ...

    def failure(self, exc: BaseException) -> Failure | None: ...

    def rebuild(self, exc: BaseException, cls: type[BaseException], message: str) -> BaseException: ...

    def where(self) -> str: ...


def loaded(module: str) -> Any:
    """The module if it has been imported, else None: outboxpg imports no optional library itself."""
    return sys.modules.get(module)
