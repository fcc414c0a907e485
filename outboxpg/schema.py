"""Installing and upgrading the outbox schema: yoyo-migrations over the release steps in ``migrations/``
(outboxpg.sql_files says where the SQL is)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outboxpg import statements
from outboxpg.adopt import check_install
from outboxpg.errors import HandInstalled
from outboxpg.sql_files import inbox_migrations_dir, inbox_step_ids, migrations_dir, step_ids

__all__ = ["HandInstalled", "MigrationStep", "Recorded", "UnknownSteps", "adopt", "describe_steps", "inbox_pending",
           "migrate", "migrate_in", "migrate_inbox", "pending", "recorded", "rollback", "rollback_in", "rollback_inbox",
           "yoyo_uri"]

# Called with each NOTICE or WARNING the server sends while steps are applied or rolled back
# (0012's rollback says which roles it keeps, and why).
OnNotice = Callable[[psycopg.errors.Diagnostic], None]


@dataclass(frozen=True)
class MigrationStep:
    id: str
    applied: bool


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


def _steps(dsn: str, on_notice: OnNotice | None = None, inbox: bool = False):  # type: ignore[no-untyped-def]
    from yoyo import get_backend, read_migrations  # yoyo: only where steps are applied or rolled back

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
    return backend, read_migrations(str(inbox_migrations_dir() if inbox else migrations_dir()))


@dataclass(frozen=True)
class Recorded:
    installed: bool          # the outbox schema's first object (outbox_settings) is there
    bookkeeping: bool        # yoyo's table is there and readable
    applied: frozenset[str]  # the steps yoyo recorded as applied

    @property
    def hand_installed(self) -> bool:
        return self.installed and not (self.applied & set(step_ids()))

    @property
    def unknown(self) -> list[str]:
        """Outbox steps yoyo recorded that this version does not ship: a development database
        that ran steps of a release before it was made (the release squashes them into one)."""
        return sorted(s for s in self.applied - set(step_ids()) if _OUR_STEP.match(s))


_OUR_STEP = re.compile(r"^\d{4}_(outbox|schema)_\w+$")


class UnknownSteps(Exception):
    """yoyo recorded outbox steps that this version does not ship (Recorded.unknown)."""

    def __init__(self, steps: list[str]) -> None:
        super().__init__(f"the database records outbox steps this version does not ship: {describe_steps(steps)}")
        self.steps = steps


def describe_steps(steps: list[str]) -> str:
    """'0016_a, 0017_b' or, for many, '0016_a ... 0031_z (16 steps)'."""
    return ", ".join(steps) if len(steps) <= 3 else f"{steps[0]} ... {steps[-1]} ({len(steps)} steps)"


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
    A database installed by hand (no yoyo record of it) is refused with HandInstalled, and one
    that ran steps this version does not ship with UnknownSteps: the steps would fail on the
    objects already there."""
    rec = _recorded(dsn)
    if rec.hand_installed:
        raise HandInstalled("the outbox schema is installed but yoyo has no record of it")
    if rec.unknown:
        raise UnknownSteps(rec.unknown)
    return _apply(dsn, on_notice, inbox=False)


def migrate_inbox(dsn: str, on_notice: OnNotice | None = None) -> list[str]:
    """Apply every step of the transactional inbox not yet applied (migrations/inbox/); returns their
    ids. Independent of the outbox: a consumer's database needs none. yoyo records the inbox's steps
    in the same bookkeeping table, under ids of their own."""
    return _apply(dsn, on_notice, inbox=True)


def _apply(dsn: str, on_notice: OnNotice | None, inbox: bool) -> list[str]:
    """yoyo applies the steps not applied yet (the outbox's or the inbox's), under its lock."""
    backend, steps = _steps(dsn, on_notice, inbox=inbox)
    try:
        with backend.lock():
            todo = backend.to_apply(steps)
            backend.apply_migrations(todo)
        return [m.id for m in todo]
    finally:
        backend.connection.close()


def inbox_pending(dsn: str) -> list[MigrationStep]:
    """Every inbox step and whether yoyo recorded it as applied (read only)."""
    applied = _recorded(dsn).applied
    return [MigrationStep(s, s in applied) for s in inbox_step_ids()]


def rollback_inbox(dsn: str, count: int = 1, on_notice: OnNotice | None = None) -> list[str]:
    """Roll back the last ``count`` applied inbox steps; returns their ids, newest first."""
    return _roll_back(dsn, count, on_notice, None, inbox=True)


def to_roll_back(rec: Recorded, count: int) -> list[str]:
    """The steps ``rollback(dsn, count)`` would roll back, newest first (what the prompt names)."""
    return [s for s in reversed(step_ids()) if s in rec.applied][:count]


class StepsChanged(Exception):
    """The applied steps changed between the prompt and the rollback (another migrate ran)."""


def rollback(dsn: str, count: int = 1, on_notice: OnNotice | None = None,
             expected: list[str] | None = None) -> list[str]:
    """Roll back the last ``count`` applied steps; returns their ids, newest first. With
    ``expected`` (the steps a user agreed to), anything else to roll back raises StepsChanged
    and nothing is rolled back."""
    return _roll_back(dsn, count, on_notice, expected, inbox=False)


def _roll_back(dsn: str, count: int, on_notice: OnNotice | None, expected: list[str] | None,
               inbox: bool) -> list[str]:
    backend, steps = _steps(dsn, on_notice, inbox=inbox)
    try:
        with backend.lock():
            todo = backend.to_rollback(steps)[:count]
            if expected is not None and [m.id for m in todo] != expected:
                raise StepsChanged(", ".join(m.id for m in todo) or "none")
            backend.rollback_migrations(todo)
        return [m.id for m in todo]
    finally:
        backend.connection.close()


def adopt(dsn: str) -> tuple[list[str], list[str]]:
    """Record a hand-installed schema in yoyo's bookkeeping (yoyo's mark_migrations), after
    checking it against the files (outboxpg.adopt). Returns (steps recorded, differences): the
    longest prefix of steps the install matches is recorded; nothing is when it matches none."""
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


# -- inside an application's own migration (Alembic, Django) ------------------------------------

def _in_transaction_backend(connection: Any) -> Any:
    """A yoyo backend on ``connection`` (a psycopg 3 or psycopg2 DB-API connection, inside the
    caller's transaction) that never begins, commits or closes it: yoyo's transactions become
    savepoints, and a step's work commits or rolls back with the caller's transaction."""
    from yoyo import internalmigrations
    from yoyo.backends.core.postgresql import PostgresqlBackend, PostgresqlPsycopgBackend
    from yoyo.connections import default_migration_table, parse_uri

    driver = type(connection).__module__.split(".")[0]
    bases = {"psycopg": PostgresqlPsycopgBackend, "psycopg2": PostgresqlBackend}
    if driver not in bases:
        raise TypeError(f"not a psycopg or psycopg2 connection: {type(connection).__module__}."
                        f"{type(connection).__qualname__}")

    class InTransaction(bases[driver]):  # type: ignore[valid-type,misc]
        def connect(self, dburi: Any) -> Any:
            return connection

        def copy(self) -> Any:          # yoyo runs each step on a copy: here, on the same connection
            return self

        def __exit__(self, *exc: object) -> None:   # ... and closes the copy afterwards: not this one
            pass

        def ensure_internal_schema_updated(self) -> None:
            # yoyo's own tables, made (or brought to its current version) in a savepoint, not
            # under its lock with a commit.
            if internalmigrations.needs_upgrading(self):
                internalmigrations.upgrade(self)

    backend = InTransaction(parse_uri(f"postgresql:///{quote(connection.info.dbname, safe='')}"),
                            default_migration_table)
    backend._in_transaction = True     # every yoyo transaction is a savepoint of the caller's
    backend.has_transactional_ddl = True
    # yoyo's lock row, inserted (and deleted) in this transaction: an `outboxpg migrate` that
    # starts meanwhile waits on it until this transaction ends, and this one on its.
    backend.create_lock_table()
    return backend


def _recorded_on(backend: Any) -> Recorded:
    installed, bookkeeping = backend.execute(statements.INSTALLED).fetchone()
    applied: frozenset[str] = frozenset()
    if bookkeeping:
        applied = frozenset(r[0] for r in backend.execute(statements.APPLIED_STEPS).fetchall())
    return Recorded(installed, bookkeeping, applied)


def _known_step(step: str | None) -> None:
    if step is not None and step not in step_ids():
        raise ValueError(f"{step!r} is not a step this version of outboxpg ships ({describe_steps(step_ids())})")


def migrate_in(connection: Any, through: str | None = None) -> list[str]:
    """Apply the steps not yet applied (every step this version ships, or those up to and
    including ``through``) on ``connection``, a psycopg 3 or psycopg2 DB-API connection, in its
    open transaction: nothing is committed here. Recorded in yoyo's bookkeeping as `outboxpg
    migrate` records them, so either can take over. Returns the ids applied. Refuses a hand
    install (HandInstalled) and unknown steps (UnknownSteps), as migrate() does."""
    from yoyo import read_migrations

    _known_step(through)
    backend = _in_transaction_backend(connection)
    rec = _recorded_on(backend)
    if rec.hand_installed:
        raise HandInstalled("the outbox schema is installed but yoyo has no record of it")
    if rec.unknown:
        raise UnknownSteps(rec.unknown)
    wanted = set(step_ids()[:step_ids().index(through) + 1] if through else step_ids())
    steps = read_migrations(str(migrations_dir()))
    with backend.lock():
        todo = backend.to_apply(steps.__class__([m for m in steps if m.id in wanted], steps.post_apply))
        backend.apply_migrations(todo)
    return [m.id for m in todo]


def rollback_in(connection: Any, to: str | None = None) -> list[str]:
    """Roll back, on ``connection`` in its open transaction, every applied step after ``to``
    (None: every step); returns their ids, newest first."""
    from yoyo import read_migrations

    _known_step(to)
    backend = _in_transaction_backend(connection)
    keep = set(step_ids()[:step_ids().index(to) + 1] if to else [])
    steps = read_migrations(str(migrations_dir()))
    with backend.lock():
        todo = backend.to_rollback(steps.__class__([m for m in steps if m.id not in keep], steps.post_apply))
        backend.rollback_migrations(todo)
    return [m.id for m in todo]
