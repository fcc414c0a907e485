"""Installing the outbox schema: yoyo-migrations over the versioned SQL in ``migrations/``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import quote, urlencode

from psycopg.conninfo import conninfo_to_dict
from yoyo import get_backend, read_migrations

__all__ = ["MigrationStep", "migrations_dir", "yoyo_uri", "migrate", "rollback", "pending", "install_sql"]


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
    dbname = params.pop("dbname", "")
    query = urlencode(params)
    return f"postgresql+psycopg:///{quote(dbname, safe='')}" + (f"?{query}" if query else "")


def _steps(dsn: str):  # type: ignore[no-untyped-def]
    backend = get_backend(yoyo_uri(dsn))
    return backend, read_migrations(str(migrations_dir()))


def pending(dsn: str) -> list[MigrationStep]:
    """Every migration step, and whether it is applied in the database behind ``dsn``."""
    backend, steps = _steps(dsn)
    try:
        with backend.lock():
            todo = {m.id for m in backend.to_apply(steps)}
        return [MigrationStep(m.id, m.id not in todo) for m in steps]
    finally:
        backend.connection.close()


def migrate(dsn: str) -> list[str]:
    """Apply every step not yet applied; returns their ids (empty when already up to date)."""
    backend, steps = _steps(dsn)
    try:
        with backend.lock():
            todo = backend.to_apply(steps)
            backend.apply_migrations(todo)
        return [m.id for m in todo]
    finally:
        backend.connection.close()


def rollback(dsn: str, count: int = 1) -> list[str]:
    """Roll back the last ``count`` applied steps; returns their ids, newest first."""
    backend, steps = _steps(dsn)
    try:
        with backend.lock():
            todo = backend.to_rollback(steps)[:count]
            backend.rollback_migrations(todo)
        return [m.id for m in todo]
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
    for path in sorted(migrations_dir().glob("[0-9]*.sql")):
        if path.name.endswith(".rollback.sql"):
            continue
        parts.append(f"\n-- ==== {path.name} ====")
        parts.append(_DEPENDS.sub("", path.read_text(encoding="utf-8")).rstrip())
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"
