"""``outboxpg migrate --adopt``: record a schema installed by hand (``outboxpg sql | psql``, or
the files of migrations/ run one by one) in yoyo's bookkeeping, once it is checked against the
files.

The check installs the files this version ships, one by one, into a scratch schema inside one
transaction that is rolled back, and after each step compares what is there with the install
schema: tables and their columns, defaults and constraints, indexes, views, sequences,
triggers, functions (arguments, result, body, SECURITY DEFINER, volatility, settings), types and
domains. Partitions are left out (their names carry the date they were made), and so are the
settings row's values, comments and grants (a DBA may tune and grant), and objects the files do
not make (the application's own tables in the same schema, yoyo's). The longest prefix of
steps the install matches is what gets recorded, with yoyo's own ``mark_migrations``; the
steps after it are then applied by ``outboxpg migrate`` as usual.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outboxpg.schema import step_paths

__all__ = ["AdoptCheck", "check_install", "fingerprint"]


@dataclass
class AdoptCheck:
    steps: list[str]                 # every step this version ships, in order
    matched: int                     # how many of them the install matches (a prefix)
    differences: list[str]           # against the full install, when it does not match it


# One row per object, as text that does not depend on the schema's name (search_path is the
# schema while it runs, so names in it print unqualified). Partitions and their indexes and
# cloned triggers are left out.
_FINGERPRINT = """
WITH s AS (SELECT %(schema)s::regnamespace AS oid),
rel AS (SELECT c.* FROM pg_class c, s WHERE c.relnamespace = s.oid AND NOT c.relispartition
          AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'i', 'I', 'c', 'f'))
SELECT 'relation ' || relname, relkind::text FROM rel
UNION ALL
SELECT 'column ' || rel.relname || '.' || a.attname,
       concat_ws(' ', format_type(a.atttypid, a.atttypmod), CASE WHEN a.attnotnull THEN 'NOT NULL' END,
                 CASE WHEN a.attgenerated <> '' THEN 'GENERATED ' || a.attgenerated::text END,
                 'DEFAULT ' || pg_get_expr(d.adbin, d.adrelid))
  FROM rel JOIN pg_attribute a ON a.attrelid = rel.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE rel.relkind IN ('r', 'p', 'v', 'm', 'c', 'f')
UNION ALL
SELECT 'constraint ' || rel.relname || '.' || co.conname, pg_get_constraintdef(co.oid)
  FROM rel JOIN pg_constraint co ON co.conrelid = rel.oid
UNION ALL
SELECT 'index ' || i.relname, pg_get_indexdef(i.oid) FROM rel i WHERE i.relkind IN ('i', 'I')
UNION ALL
SELECT 'view ' || relname, pg_get_viewdef(oid) FROM rel WHERE relkind IN ('v', 'm')
UNION ALL
SELECT 'trigger ' || rel.relname || '.' || t.tgname, pg_get_triggerdef(t.oid)
  FROM rel JOIN pg_trigger t ON t.tgrelid = rel.oid AND NOT t.tgisinternal
UNION ALL
SELECT 'function ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
       concat_ws(' | ', p.prokind::text, pg_get_function_result(p.oid), l.lanname, p.provolatile::text,
                 CASE WHEN p.prosecdef THEN 'SECURITY DEFINER' END, CASE WHEN p.proisstrict THEN 'STRICT' END,
                 p.prorows::text, array_to_string(p.proconfig, ', '), md5(p.prosrc))
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang, s WHERE p.pronamespace = s.oid
UNION ALL
SELECT 'type ' || t.typname,
       concat_ws(' ', t.typtype::text, CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod) END,
                 CASE WHEN t.typnotnull THEN 'NOT NULL' END, 'DEFAULT ' || pg_get_expr(t.typdefaultbin, 0),
                 (SELECT string_agg(co.conname || ' ' || pg_get_constraintdef(co.oid), ', ' ORDER BY co.conname)
                    FROM pg_constraint co WHERE co.contypid = t.oid),
                 (SELECT string_agg(e.enumlabel, ', ' ORDER BY e.enumsortorder)
                    FROM pg_enum e WHERE e.enumtypid = t.oid))
  FROM pg_type t, s
 WHERE t.typnamespace = s.oid AND t.typtype IN ('d', 'e')
"""


def fingerprint(conn: psycopg.Connection[Any], schema: str) -> dict[str, str]:
    """The objects of ``schema`` (see _FINGERPRINT), run inside the caller's transaction."""
    conn.execute(sql.SQL("SET LOCAL search_path = {}, pg_temp").format(sql.Identifier(schema)))
    rows = conn.execute(_FINGERPRINT, {"schema": schema}).fetchall()
    # The functions pin their search_path to the schema they were installed in, and some
    # definitions (pg_get_indexdef) name it whatever the search_path.
    pinned = re.compile(rf"search_path=(\"?){re.escape(schema)}\1(?=,|$)")
    quoted = conn.execute("SELECT quote_ident(%s)", (schema,)).fetchone()[0]  # type: ignore[index]
    qualified = re.compile(rf"(?<![\w\"]){re.escape(quoted)}\.")
    return {name: qualified.sub("<schema>.", pinned.sub("search_path=<schema>", definition or ""))
            for name, definition in rows}


def _step_files() -> list[tuple[str, str]]:
    return [(p.name.removesuffix(".sql"), p.read_text(encoding="utf-8")) for p in step_paths()]


def _differences(want: dict[str, str], have: dict[str, str], limit: int = 5) -> list[str]:
    out = [f"missing {k}" for k in sorted(want.keys() - have.keys())]
    out += [f"different {k}" for k in sorted(want.keys() & have.keys()) if want[k] != have[k]]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def check_install(dsn: str) -> AdoptCheck:
    """Compare the install schema (the first of search_path) with the files, step by step.
    Nothing is changed: the scratch schema goes with the rolled-back transaction."""
    files = _step_files()
    scratch = f"outboxpg_adopt_{secrets.token_hex(4)}"
    with psycopg.connect(dsn, fallback_application_name="outboxpg") as conn:
        row = conn.execute("SELECT current_schema()").fetchone()
        if row is None or row[0] is None:
            raise RuntimeError("no schema on the search_path to check")
        target = row[0]
        have = fingerprint(conn, target)
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(scratch)))
        prints: list[dict[str, str]] = []
        for _, text in files:
            # Each file sets search_path to current_schema() first: the scratch schema.
            conn.execute(sql.SQL("SET LOCAL search_path = {}, pg_temp").format(sql.Identifier(scratch)))
            conn.execute(text)  # the file's own SQL, several statements
            prints.append(fingerprint(conn, scratch))
        conn.rollback()
    # Objects of others in the same schema (the application's tables, yoyo's own) do not count:
    # a step matches when every object it leaves behind is there, defined as in the files.
    matched = 0
    for k, fp in enumerate(prints, 1):
        if all(have.get(name) == definition for name, definition in fp.items()):
            matched = k
    if matched < len(files):
        # Objects that later steps make are there too (a function changed by hand, say): the
        # install is not the first steps of this version, and nothing can be recorded.
        later = prints[-1].keys() - (prints[matched - 1].keys() if matched else set())
        if later & have.keys():
            matched = 0
        return AdoptCheck([step for step, _ in files], matched, _differences(prints[-1], have))
    return AdoptCheck([step for step, _ in files], matched, [])
