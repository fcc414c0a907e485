"""What a schema holds of the outbox, object by object, in a form two installs compare by.

- ``snapshot``: everything (statements.CATALOG) in the schema first on the search_path, with the
  schema's name taken out: what the tests compare a fresh install, a psql install, an upgrade
  and a rollback by, and what tools/schema_step.py checks a generated step with.
- ``fingerprint``: one line per object, leaving out what a DBA may change (comments, grants,
  the settings' values): what ``outboxpg migrate --adopt`` checks a hand-made install with.
- ``code_objects``: the functions, views, triggers and comments, which a release step restates
  whole when they change.
- ``scratch``: run SQL files into a schema of their own inside the caller's transaction, which
  the caller rolls back.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg import sql

from outboxpg import statements

__all__ = ["Snapshot", "code_objects", "fingerprint", "run_in", "scratch", "snapshot"]

Snapshot = dict[str, list[tuple[Any, ...]]]


def _unqualifier(conn: psycopg.Connection[Any], schema: str) -> re.Pattern[str]:
    """Where the schema's name appears in a definition: 'name.' before an object, and the pinned
    search_path (SET search_path FROM CURRENT records the schema it was installed in), as
    pg_proc.proconfig holds it (search_path=name, pg_temp) and as pg_get_functiondef prints it
    (SET search_path TO 'name', 'pg_temp')."""
    quoted = conn.execute(statements.QUOTE_IDENT, (schema,)).fetchone()[0]  # type: ignore[index]
    return re.compile(rf"(?<![\w\"]){re.escape(quoted)}\."
                      rf"|(?<=search_path=){re.escape(quoted)}(?=,|$|\s)"
                      rf"|(?<=search_path TO '){re.escape(schema)}(?=')")


def _clean(value: Any, pattern: re.Pattern[str]) -> Any:
    if isinstance(value, str):
        return pattern.sub(lambda m: "" if m.group().endswith(".") else "<schema>", value)
    if isinstance(value, list):
        return [_clean(v, pattern) for v in value]
    if isinstance(value, tuple):
        return tuple(_clean(v, pattern) for v in value)
    return value


def snapshot(conn: psycopg.Connection[Any]) -> Snapshot:
    """statements.CATALOG in the schema first on the search_path, its name taken out."""
    row = conn.execute(statements.CURRENT_SCHEMA).fetchone()
    assert row is not None and row[0] is not None, "no schema on the search_path"
    pattern = _unqualifier(conn, row[0])
    return {key: [tuple(_clean(v, pattern) for v in r) for r in conn.execute(query).fetchall()]
            for key, query in statements.CATALOG.items()}


def fingerprint(conn: psycopg.Connection[Any], schema: str) -> dict[str, str]:
    """The objects of ``schema`` (statements.FINGERPRINT), run inside the caller's transaction."""
    conn.execute(statements.SET_LOCAL_SEARCH_PATH.format(sql.Identifier(schema)))
    rows = conn.execute(statements.FINGERPRINT, {"schema": schema}).fetchall()
    pattern = _unqualifier(conn, schema)
    return {name: _clean(definition or "", pattern) for name, definition in rows}


def code_objects(conn: psycopg.Connection[Any], schema: str) -> dict[tuple[str, str], str]:
    """(kind, name) -> definition of every function, view, trigger and comment of ``schema``."""
    pattern = _unqualifier(conn, schema)
    return {(kind, name): _clean(definition, pattern)
            for kind, name, definition in conn.execute(statements.CODE_OBJECTS, {"schema": schema}).fetchall()}


def run_in(conn: psycopg.Connection[Any], schema: str, text: str) -> None:
    """Run a SQL file's text in ``schema`` (each file pins its search_path to current_schema()
    first, as every file of schema/ and migrations/ does), inside the caller's transaction."""
    conn.execute(statements.SET_LOCAL_SEARCH_PATH.format(sql.Identifier(schema)))
    conn.execute(text)  # the file's own SQL, several statements
    conn.execute(statements.SET_LOCAL_SEARCH_PATH.format(sql.Identifier(schema)))


def scratch(conn: psycopg.Connection[Any], texts: Iterable[str] = (), prefix: str = "outboxpg_scratch") -> str:
    """Make a schema of its own and run each SQL text in it, in order, inside the caller's
    transaction, which the caller rolls back. Returns the schema's name (first on the
    search_path afterwards)."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    conn.execute(statements.CREATE_SCHEMA.format(sql.Identifier(name)))
    conn.execute(statements.SET_LOCAL_SEARCH_PATH.format(sql.Identifier(name)))
    for text in texts:
        run_in(conn, name, text)
    return name
