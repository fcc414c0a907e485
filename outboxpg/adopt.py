"""``outboxpg migrate --adopt``: record a schema installed by hand (``outboxpg sql | psql``, or
the files of migrations/ run one by one) in yoyo's bookkeeping, once it is checked against the
files.

The check installs the steps this version ships, one by one, into a scratch schema inside one
transaction that is rolled back, and after each step compares what is there with the install
schema: tables and their columns, defaults and constraints, indexes, views, sequences,
triggers, functions (arguments, result, body, SECURITY DEFINER, volatility, settings), types and
domains (outboxpg.catalog.fingerprint). Partitions are left out (their names carry the date they
were made), and so are the settings row's values, comments and grants (a DBA may tune and
grant), and objects the files do not make (the application's own tables in the same schema,
yoyo's). The longest prefix of steps the install matches is what gets recorded, with yoyo's own
``mark_migrations``; the steps after it are then applied by ``outboxpg migrate`` as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from outboxpg import statements
from outboxpg.catalog import fingerprint, run_in, scratch
from outboxpg.sql_files import step_paths

__all__ = ["AdoptCheck", "check_install"]


@dataclass
class AdoptCheck:
    steps: list[str]                 # every step this version ships, in order
    matched: int                     # how many of them the install matches (a prefix)
    differences: list[str]           # against the full install, when it does not match it


def _differences(want: dict[str, str], have: dict[str, str], limit: int = 5) -> list[str]:
    out = [f"missing {k}" for k in sorted(want.keys() - have.keys())]
    out += [f"different {k}" for k in sorted(want.keys() & have.keys()) if want[k] != have[k]]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def check_install(dsn: str) -> AdoptCheck:
    """Compare the install schema (the first of search_path) with the steps, one by one.
    Nothing is changed: the scratch schema goes with the rolled-back transaction."""
    files = [(p.name.removesuffix(".sql"), p.read_text(encoding="utf-8")) for p in step_paths()]
    with psycopg.connect(dsn, fallback_application_name="outboxpg") as conn:
        row = conn.execute(statements.CURRENT_SCHEMA).fetchone()
        if row is None or row[0] is None:
            raise RuntimeError("no schema on the search_path to check")
        target = row[0]
        have = fingerprint(conn, target)
        prints: list[dict[str, str]] = []
        into = scratch(conn, prefix="outboxpg_adopt")
        for _, text in files:
            run_in(conn, into, text)
            prints.append(fingerprint(conn, into))
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
