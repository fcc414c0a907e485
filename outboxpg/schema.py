"""Installing the outbox schema: yoyo-migrations over the versioned SQL in ``migrations/``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict
from yoyo import get_backend, read_migrations

from outboxpg import statements
from outboxpg.errors import HandInstalled

__all__ = ["HandInstalled", "MigrationStep", "migrations_dir", "step_ids", "step_paths", "yoyo_uri", "migrate",
           "rollback", "pending", "recorded", "adopt", "install_sql"]

# Called with each NOTICE or WARNING the server sends while steps are applied or rolled back
# (0012's rollback says which roles it keeps, and why).
OnNotice = Callable[[psycopg.errors.Diagnostic], None]


@dataclass(frozen=True)
class MigrationStep:
    id: str
    applied: bool


def migrations_dir() -> Path:
    """The directory holding the versioned SQL files (shipped inside the package)."""
    return Path(str(resources.files("outboxpg") / "migrations"))


def yoyo_uri(dsn: str) -> str:
    """Turn any libpq connection string (URI or ``key=value``) into a yoyo URI for psycopg 3.

    Every parameter except the database name travels as a query argument, which yoyo hands to
    ``psycopg.connect`` unchanged, so socket directories, sslmode and the like survive.
    """
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params.setdefault("fallback_application_name", "outboxpg")
    dbname = params.pop("dbname", "")
    query = urlencode(params)
    return f"postgresql+psycopg:///{quote(dbname, safe='')}" + (f"?{query}" if query else "")


def _steps(dsn: str, on_notice: OnNotice | None = None):  # type: ignore[no-untyped-def]
    backend = get_backend(yoyo_uri(dsn))
    if on_notice is not None:
        # yoyo runs each step on a copy of the backend, with a connection of its own.
        backend.connection.add_notice_handler(on_notice)
        copy = backend.copy

        def copy_with_notices():  # type: ignore[no-untyped-def]
            other = copy()
            other.connection.add_notice_handler(on_notice)
            return other

        backend.copy = copy_with_notices
    return backend, read_migrations(str(migrations_dir()))


def step_paths() -> list[Path]:
    """The files of the migration steps this version of outboxpg ships, in order (no rollbacks)."""
    return sorted(p for p in migrations_dir().glob("[0-9]*.sql") if not p.name.endswith(".rollback.sql"))


def step_ids() -> list[str]:
    """The migration steps this version of outboxpg ships, in order."""
    return [p.name.removesuffix(".sql") for p in step_paths()]


@dataclass(frozen=True)
class Recorded:
    installed: bool          # the outbox schema's first object (outbox_settings) is there
    bookkeeping: bool        # yoyo's table is there and readable
    applied: frozenset[str]  # the steps yoyo recorded as applied

    @property
    def hand_installed(self) -> bool:
        return self.installed and not (self.applied & set(step_ids()))


def recorded(conn: psycopg.Connection[Any]) -> Recorded:
    """What is installed and what yoyo recorded, read only (no lock, nothing created)."""
    row = conn.execute(statements.INSTALLED).fetchone()
    assert row is not None
    installed, bookkeeping = row
    applied: frozenset[str] = frozenset()
    if bookkeeping:
        applied = frozenset(r[0] for r in conn.execute(statements.APPLIED_STEPS).fetchall())
    return Recorded(installed, bookkeeping, applied)


def _recorded(dsn: str) -> Recorded:
    with psycopg.connect(dsn, autocommit=True, fallback_application_name="outboxpg") as conn:
        return recorded(conn)


def pending(dsn: str) -> list[MigrationStep]:
    """Every migration step, and whether yoyo recorded it as applied in the database behind
    ``dsn``. Read only: an outbox_operator login (no write access to yoyo_lock) may ask."""
    applied = _recorded(dsn).applied
    return [MigrationStep(s, s in applied) for s in step_ids()]


def migrate(dsn: str, on_notice: OnNotice | None = None) -> list[str]:
    """Apply every step not yet applied; returns their ids (empty when already up to date).
    A database installed by hand (no yoyo record of it) is refused with HandInstalled: the
    steps would fail on the objects already there."""
    if _recorded(dsn).hand_installed:
        raise HandInstalled("the outbox schema is installed but yoyo has no record of it")
    backend, steps = _steps(dsn, on_notice)
    try:
        with backend.lock():
            todo = backend.to_apply(steps)
            backend.apply_migrations(todo)
        return [m.id for m in todo]
    finally:
        backend.connection.close()


def rollback(dsn: str, count: int = 1, on_notice: OnNotice | None = None) -> list[str]:
    """Roll back the last ``count`` applied steps; returns their ids, newest first."""
    backend, steps = _steps(dsn, on_notice)
    try:
        with backend.lock():
            todo = backend.to_rollback(steps)[:count]
            backend.rollback_migrations(todo)
        return [m.id for m in todo]
    finally:
        backend.connection.close()


def adopt(dsn: str) -> tuple[list[str], list[str]]:
    """Record a hand-installed schema in yoyo's bookkeeping (yoyo's mark_migrations), after
    checking it against the files (outboxpg.adopt). Returns (steps recorded, differences): the
    longest prefix of steps the install matches is recorded; nothing is when it matches none."""
    from outboxpg.adopt import check_install

    check = check_install(dsn)
    if not check.matched:
        return [], check.differences
    backend, steps = _steps(dsn)
    try:
        with backend.lock():
            todo = [m for m in steps if m.id in check.steps[:check.matched]]
            backend.mark_migrations(todo)
        return [m.id for m in todo], check.differences
    finally:
        backend.connection.close()


_DEPENDS = re.compile(r"^--\s*depends:.*$\n?", re.MULTILINE)


def install_sql() -> str:
    """The whole install as one psql script, in order, for DBAs who apply SQL by hand.

    It is the migration files concatenated (their yoyo ``depends`` headers dropped), in one
    transaction. A database installed this way has no yoyo bookkeeping: keep applying by hand.
    """
    parts = ["-- outboxpg install script: the files of migrations/ in order, in one transaction.",
             "\\set ON_ERROR_STOP on", "BEGIN;"]
    for path in step_paths():
        parts.append(f"\n-- ==== {path.name} ====")
        parts.append(_DEPENDS.sub("", path.read_text(encoding="utf-8")).rstrip())
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"
