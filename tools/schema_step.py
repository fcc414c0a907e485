"""Produce the next release's migration step, and its rollback, from schema/.

    bin/schema-step                 # write migrations/NNNN_schema_N.sql and .rollback.sql
    bin/schema-step --check         # exit 1, saying why, when those files are not what it writes
    bin/schema-step --dsn DSN       # on that server; otherwise on a throwaway PostgreSQL

schema/ is the current schema, written once. The released steps (migrations/RELEASED) are
frozen. The next release is one step that takes a database of the last release to schema/:

  * migrations/next/upgrade.sql, by hand: what no CREATE OR REPLACE can do (tables, columns,
    indexes, sequences, data, and DROPs of objects that go or change their signature);
  * then every function, view, trigger and comment of schema/ that differs from the released
    steps (or that upgrade.sql drops), each as schema/ writes it, and the GRANT, REVOKE and DO
    statements of schema/'s code files that no released step holds word for word (all of them
    run again harmlessly).

Its rollback: migrations/next/rollback.sql, by hand (drops of what the release added, tables
back), then the released definition of every object the step replaced or dropped, with the
released comments and grants of the objects that rollback.sql drops and makes again.

What to include is decided on a database: the released steps and schema/ are installed into
scratch schemas inside one transaction, which is rolled back, and compared object by object.
Both files are then checked there: the released steps plus the step give schema/'s catalog
(outboxpg.catalog.snapshot: tables, columns, indexes, storage, functions, views, triggers,
comments, grants), and the rollback after them gives the released catalog again. A difference
is an error naming the objects: usually a table change that upgrade.sql or rollback.sql lacks.
With nothing to release, there is no unreleased step.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from outboxpg import catalog, sql_files
from outboxpg.sql_files import Statement

ROOT = Path(__file__).resolve().parent.parent
NEXT = ROOT / "migrations" / "next"
PIN = ("DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); "
       "END $$;")
CODE = ("function", "view", "trigger")
STRUCTURE = ("table", "index", "sequence", "type", "domain", "alter", "insert", "select")


class StepError(Exception):
    """What keeps the step from being produced, in a few lines."""


@dataclass
class Step:
    step_id: str
    release: str
    upgrade: str
    rollback: str


def _words(text: str) -> str:
    return " ".join(text.split())


def _object(stmt: Statement) -> tuple[str, str] | None:
    """The catalog key (outboxpg.catalog.code_objects) of what a statement defines or comments."""
    if stmt.kind in CODE:
        return (stmt.kind, stmt.name)
    if stmt.kind == "comment":
        target, _, name = stmt.name.partition(" ")
        name = name.split(" on ")[0].strip()
        if target in ("view", "table", "sequence", "materialized"):
            return ("comment", "relation " + name.split()[-1])
        if target == "domain":
            return ("comment", "type " + name)
        if target == "trigger":
            return None   # comments on triggers are not compared
        return ("comment", f"{target} {name}")
    return None


_DROP = re.compile(r"\bDROP\s+(?:FUNCTION|VIEW|TRIGGER|TABLE|SEQUENCE|PROCEDURE)\s+(?:IF\s+EXISTS\s+)?(\w+)", re.I)


def _dropped(text: str) -> set[str]:
    """The objects a hand-written part drops (to make them again, or for good)."""
    return {m.group(1) for s in sql_files.statements(text) if s.kind == "drop" for m in [_DROP.match(s.text)] if m}


def _names(text: str) -> set[str]:
    return set(re.findall(r"\boutbox\w*\b", re.sub(r"--[^\n]*", "", text)))


def _or_replace(text: str) -> str:
    return re.sub(r"^CREATE\s+(?!OR\s+REPLACE\b)(FUNCTION|VIEW|TRIGGER|PROCEDURE)\b", r"CREATE OR REPLACE \1", text,
                  count=1, flags=re.I)


def _block(stmt: Statement, text: str | None = None) -> str:
    return (stmt.comment + "\n" if stmt.comment else "") + (text or stmt.text)


@dataclass
class Released:
    """The released steps, object by object: the last definition of each (with the ALTER
    FUNCTION statements after it), and every statement's text."""
    definitions: dict[tuple[str, str], list[Statement]]
    order: list[tuple[str, str]]            # functions, views, triggers, comments; each by last definition
    texts: set[str]                         # every statement, words only
    grants: list[Statement]                 # GRANT, REVOKE and DO statements, in order


def _released(texts: list[tuple[str, str]]) -> Released:
    out = Released({}, [], set(), [])
    for file, text in texts:
        for s in sql_files.statements(text, file):
            out.texts.add(_words(s.text))
            key = _object(s)
            if key is not None:
                if key in out.order:
                    out.order.remove(key)
                out.order.append(key)
                out.definitions[key] = [s]
            elif s.kind == "alter function" and ("function", s.name) in out.definitions:
                out.definitions[("function", s.name)].append(s)
            elif s.kind in ("grant", "revoke", "do"):
                out.grants.append(s)
    # Made again in this order: a view or a trigger needs its functions, a comment its object;
    # functions are made before the views they read (no SQL function here reads a view).
    kinds = ("function", "view", "trigger", "comment")
    out.order.sort(key=lambda k: kinds.index(k[0]))
    return out


def _upgrade_body(source: list[Statement], old: dict[tuple[str, str], str], new: dict[tuple[str, str], str],
                  released: Released, dropped: set[str]) -> tuple[list[str], set[tuple[str, str]]]:
    parts: list[str] = []
    replaced: set[tuple[str, str]] = set()
    for s in source:
        key = _object(s)
        if key is not None:
            owner = key[1].split()[-1].split(".")[0]
            if old.get(key) != new.get(key) or key[1] in dropped or owner in dropped:
                parts.append(_block(s))
                replaced.add(key)
        elif s.kind in ("grant", "revoke", "do") and not s.file.startswith("10_"):
            if _words(s.text) not in released.texts or _names(s.text) & dropped:
                parts.append(_block(s))
        elif s.kind not in STRUCTURE and s.kind != "do":
            raise StepError(f"schema/{s.file}:{s.line}: a {s.kind} statement in a code file: only "
                            "CREATE OR REPLACE, COMMENT, GRANT, REVOKE and DO statements can be run again")
        elif s.kind in STRUCTURE and not s.file.startswith("10_"):
            raise StepError(f"schema/{s.file}:{s.line}: tables, indexes, sequences, types and their data belong "
                            "in schema/10_tables.sql (migrations/next/upgrade.sql changes them)")
    return parts, replaced


def _commented(key: tuple[str, str], code: dict[tuple[str, str], str], snap: catalog.Snapshot) -> bool:
    """Does the object a comment key names exist in the install that ``code`` and ``snap`` describe?"""
    target, _, name = key[1].partition(" ")
    if target == "function":
        return ("function", name) in code
    if target == "relation":
        return any(r[0] == name for r in snap["relations"])
    if target == "column":
        return any(f"{r[0]}.{r[1]}" == name for r in snap["column_details"])
    return any(r[0] == name for r in snap["domains"])


def _rollback_body(released: Released, replaced: set[tuple[str, str]], old: dict[tuple[str, str], str],
                   new: dict[tuple[str, str], str], old_snap: catalog.Snapshot, source: list[Statement],
                   dropped: set[str]) -> list[str]:
    parts: list[str] = []
    for key in released.order:
        owner = key[1].split()[-1].split(".")[0]
        back = key in replaced or key not in new or key[1] in dropped or owner in dropped
        if back and key in old:
            first, *alters = released.definitions[key]
            parts.append("\n".join([_block(first, _or_replace(first.text)), *(a.text for a in alters)]))
    # Comments the step gave objects that the release had without one: taken off again.
    for s in source:
        added = _object(s)
        if added is not None and added[0] == "comment" and added in replaced and added not in old \
                and _commented(added, old, old_snap):
            parts.append(re.sub(r"\bIS\s+'(?:[^']|'')*'\s*;\s*$", "IS NULL;", s.text, flags=re.S))
    for g in released.grants:
        if _names(g.text) & dropped and "set_config('search_path'" not in g.text:
            parts.append(_block(g))
    return parts


def _header(kind: str, release: str, last_release: str, last_step: str, depends: list[str]) -> str:
    what = (f"takes a database of release {last_release} (its last step: {last_step}) to schema/"
            if kind == "upgrade" else f"takes a database of release {release} back to {last_release}")
    return "\n".join([
        f"-- outboxpg release {release}{'' if kind == 'upgrade' else ', rolled back'}: {what}.",
        "--",
        "-- Produced by tools/schema_step.py (bin/schema-step) from schema/ and migrations/next/: do not",
        "-- edit it. schema/ holds each object's definition and why; docs/migrations.md says how a",
        "-- release is made. Once released (migrations/RELEASED) it is frozen.",
        f"-- depends: {' '.join(depends)}",
        PIN,
    ])


def _hand(text: str) -> list[str]:
    """A hand-written part, when it holds any statement (its header comment alone is left out)."""
    return [text.strip()] if sql_files.statements(text) else []


def _leaves(step_texts: list[tuple[str, str]]) -> list[str]:
    """The released steps no other released step depends on: their closure is all of them."""
    depends = {file.removesuffix(".sql"): (re.findall(r"^--\s*depends:(.*)$", text, re.M) or [""])[0].split()
               for file, text in step_texts}
    named = {d for ds in depends.values() for d in ds}
    return sorted(s for s in depends if s not in named)


def _differences(want: catalog.Snapshot, have: catalog.Snapshot, limit: int = 8) -> list[str]:
    out = []
    for key in want:
        for row in want[key]:
            if row not in have[key]:
                out.append(f"{key}: missing or different {str(row)[:160]}")
        for row in have[key]:
            if row not in want[key]:
                out.append(f"{key}: unexpected {str(row)[:160]}")
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def produce(conn: psycopg.Connection[Any]) -> Step | None:
    """The next release's step, checked on ``conn`` (in a transaction that is rolled back);
    None when schema/ is what the released steps make."""
    rel = sql_files.releases()
    released_ids = sql_files.released_steps()
    step_texts = [(f"{s}.sql", (sql_files.migrations_dir() / f"{s}.sql").read_text(encoding="utf-8"))
                  for s in released_ids]
    number = max(int(s[:4]) for s in released_ids) + 1
    release = f"schema-{len(rel) + 1}"
    step_id = f"{number:04d}_{release.replace('-', '_')}"
    up_hand = (NEXT / "upgrade.sql").read_text(encoding="utf-8") if (NEXT / "upgrade.sql").exists() else ""
    down_hand = (NEXT / "rollback.sql").read_text(encoding="utf-8") if (NEXT / "rollback.sql").exists() else ""
    source = [s for p in sql_files.source_paths() for s in sql_files.statements(p.read_text(encoding="utf-8"), p.name)]
    released = _released(step_texts)
    try:
        base = catalog.scratch(conn, [t for _, t in step_texts], prefix="outboxpg_released")
        old, old_snap = catalog.code_objects(conn, base), catalog.snapshot(conn)
        head = catalog.scratch(conn, [p.read_text(encoding="utf-8") for p in sql_files.source_paths()],
                               prefix="outboxpg_source")
        new, new_snap = catalog.code_objects(conn, head), catalog.snapshot(conn)
        if old_snap == new_snap and not sql_files.statements(up_hand):
            return None
        dropped_up = _dropped(up_hand)
        up_parts, replaced = _upgrade_body(source, old, new, released, dropped_up)
        depends = _leaves(step_texts)
        upgrade = "\n\n".join([_header("upgrade", release, rel[-1].name, released_ids[-1], depends),
                               *_hand(up_hand), *up_parts]) + "\n"
        down_parts = _rollback_body(released, replaced, old, new, old_snap, source, _dropped(down_hand) | dropped_up)
        rollback = "\n\n".join([_header("rollback", release, rel[-1].name, released_ids[-1], depends),
                                *_hand(down_hand), *down_parts]) + "\n"
        _check(conn, [t for _, t in step_texts] + [upgrade], new_snap,
               f"{step_id}.sql does not give schema/'s catalog (a table change migrations/next/upgrade.sql lacks?)")
        _check(conn, [t for _, t in step_texts] + [upgrade, rollback], old_snap,
               f"{step_id}.rollback.sql does not give {rel[-1].name}'s catalog back "
               "(a change migrations/next/rollback.sql lacks?)")
        return Step(step_id, release, upgrade, rollback)
    finally:
        conn.rollback()


def _check(conn: psycopg.Connection[Any], texts: list[str], want: catalog.Snapshot, what: str) -> None:
    try:
        with conn.transaction():   # a savepoint: an error here leaves the outer transaction usable
            catalog.scratch(conn, texts, prefix="outboxpg_step")
            have = catalog.snapshot(conn)
    except psycopg.Error as exc:
        raise StepError(f"{what}: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from exc
    if have != want:
        raise StepError(what + ":\n  " + "\n  ".join(_differences(want, have)))


@contextmanager
def _server(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    from outboxpg.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        yield pg.dsn


def _unreleased() -> list[Path]:
    released = set(sql_files.released_steps())
    return [p for p in sorted(sql_files.migrations_dir().glob("[0-9]*.sql"))
            if p.name.removesuffix(".sql").removesuffix(".rollback") not in released]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bin/schema-step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when the files differ")
    parser.add_argument("--dsn", help="a PostgreSQL to work on (in a transaction, rolled back); "
                                      "default: a throwaway one")
    args = parser.parse_args(argv)
    try:
        with _server(args.dsn) as dsn, psycopg.connect(dsn) as conn:
            step = produce(conn)
    except StepError as exc:
        print(f"schema-step: {exc}", file=sys.stderr)
        return 2
    except (psycopg.Error, FileNotFoundError, ValueError) as exc:
        print(f"schema-step: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    want = {} if step is None else {sql_files.migrations_dir() / f"{step.step_id}.sql": step.upgrade,
                                    sql_files.migrations_dir() / f"{step.step_id}.rollback.sql": step.rollback}
    stale = [p for p in _unreleased() if p not in want]
    wrong = [p for p, text in want.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"schema-step: {p.name} is not what schema/ needs now: run bin/schema-step", file=sys.stderr)
        for p in wrong:
            print(f"schema-step: {p.name} is missing or stale: run bin/schema-step", file=sys.stderr)
        return 1 if stale or wrong else 0
    for p in stale:
        p.unlink()
        print(f"removed {p.name}")
    for p, text in want.items():
        if p in wrong:
            p.write_text(text, encoding="utf-8")
            print(f"wrote {p.name}")
    if step is None:
        print("nothing to release: schema/ is what the released steps make")
    elif not wrong:
        print(f"{step.step_id} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
