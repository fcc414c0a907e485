"""docs/sql-api.md: an index of every object of the outbox schema, generated from a fresh install.

Each table (with its columns), view, function, trigger, sequence, type and domain, with its
signature, who may use it, and the file and line of schema/ where it is written: schema/ holds
each definition once, with why; this page says where, so a reader goes from a name to its source
in one step. The test fails while the page is not what a fresh install and schema/ give:
OUTBOXPG_DOCS_UPDATE=1 bin/test tests/sql/test_sql_api_doc.py rewrites it (review the diff).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import psycopg

from outboxpg import sql_files

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reference" / "sql-api.md"
UPDATE = os.environ.get("OUTBOXPG_DOCS_UPDATE") == "1"

# Who may do what, per object: the grantees of its ACL other than its owner, by privilege.
_ACL = """
SELECT string_agg(DISTINCT CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE pg_get_userbyid(g.grantee) END
                  || CASE WHEN %(detail)s THEN ' (' || g.privilege_type || ')' ELSE '' END, ', ')
  FROM aclexplode(%(acl)s) g
 WHERE g.grantee <> %(owner)s
"""


def _acl(acl: str, owner: str, detail: str = "true") -> str:
    return _ACL.replace("%(acl)s", acl).replace("%(owner)s", owner).replace("%(detail)s", detail)


_RELATION_ACL = """coalesce(c.relacl, acldefault(CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner))"""
_RELATIONS = f"""
SELECT c.relname, c.relkind::text, obj_description(c.oid, 'pg_class'),
       ({_acl(_RELATION_ACL, "c.relowner")}),
       (SELECT string_agg(x.who || ' ' || x.what || ' (' || x.cols || ')', '; ' ORDER BY x.who, x.what)
          FROM (SELECT pg_get_userbyid(g.grantee) AS who, lower(g.privilege_type) AS what,
                       string_agg(a.attname, ', ' ORDER BY a.attnum) AS cols
                  FROM pg_attribute a, aclexplode(a.attacl) g
                 WHERE a.attrelid = c.oid AND a.attacl IS NOT NULL AND a.attnum > 0
                 GROUP BY 1, 2) x)
  FROM pg_class c
 WHERE c.relnamespace = current_schema()::regnamespace AND NOT c.relispartition AND c.relkind IN ('r', 'p', 'v', 'S')
   AND c.relname NOT LIKE '%%yoyo%%'
 ORDER BY c.relkind, c.relname
"""
_COLUMNS = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, pg_get_expr(d.adbin, d.adrelid),
       a.attgenerated <> '', col_description(a.attrelid, a.attnum)
  FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum
"""
_FUNCTIONS = f"""
SELECT p.proname, p.oid::regprocedure::text, pg_get_function_result(p.oid), p.prosecdef,
       p.prorettype = 'trigger'::regtype, obj_description(p.oid, 'pg_proc'),
       ({_acl("coalesce(p.proacl, acldefault('f', p.proowner))", "p.proowner", "false")})
  FROM pg_proc p
 WHERE p.pronamespace = current_schema()::regnamespace
 ORDER BY p.proname
"""
_TRIGGERS = """
SELECT t.tgname, c.relname, pg_get_triggerdef(t.oid, true), t.tgfoid::regproc::text
  FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
 WHERE c.relnamespace = current_schema()::regnamespace AND NOT c.relispartition AND NOT t.tgisinternal
 ORDER BY c.relname, t.tgname
"""
_TYPES = """
SELECT t.typname, CASE t.typtype WHEN 'e' THEN 'enum (' || (SELECT string_agg(e.enumlabel, ', ' ORDER BY e.enumsortorder)
                                                            FROM pg_enum e WHERE e.enumtypid = t.oid) || ')'
                                 ELSE 'domain over ' || format_type(t.typbasetype, t.typtypmod) END,
       (SELECT string_agg(k.conname, ', ' ORDER BY k.conname) FROM pg_constraint k WHERE k.contypid = t.oid)
  FROM pg_type t
 WHERE t.typnamespace = current_schema()::regnamespace AND t.typtype IN ('d', 'e')
 ORDER BY 1
"""


def sources() -> dict[tuple[str, str], str]:
    """(kind, name) -> 'file:line' of the statement of schema/ that defines it."""
    out: dict[tuple[str, str], str] = {}
    for path in sql_files.source_paths():
        for s in sql_files.statements(path.read_text(encoding="utf-8"), path.name):
            if s.kind in ("table", "view", "function", "trigger", "sequence", "type", "domain"):
                out.setdefault((s.kind, s.name), f"{s.file}:{s.line}")
    return out


def _link(where: str | None) -> str:
    if where is None:
        return "(not in schema/)"
    file, line = where.split(":")
    return f"[{file}:{line}](../../schema/{file}#L{line})"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def render(conn: psycopg.Connection[Any]) -> str:
    """docs/reference/sql-api.md as a fresh install in ``conn``'s database and schema/ give it."""
    where = sources()
    relations = conn.execute(_RELATIONS).fetchall()
    out = [
        "# The SQL API: an index",
        "",
        "<!-- Generated by tests/sql/test_sql_api_doc.py from a fresh install and schema/: do not edit by hand.",
        "     OUTBOXPG_DOCS_UPDATE=1 bin/test tests/sql/test_sql_api_doc.py rewrites it. -->",
        "",
        "Every object of the outbox schema, with the file and line of [schema/](../../schema/) where it is",
        "written (each object once, with the why of it in the comments above it), its signature and who may",
        "use it. The roles are the three group roles of [privileges](../privileges.md); an object with none",
        "listed is its owner's alone. How a change to these files reaches a database: [migrations](../migrations.md).",
        "",
        "## Tables",
        "",
    ]
    for name, kind, comment, acl, column_acl in relations:
        if kind not in ("r", "p"):
            continue
        out += [f"### {name}", "", f"{_link(where.get(('table', name)))}. {_cell(comment)}", ""]
        if acl or column_acl:
            out += [f"Granted: {', '.join(x for x in (acl, column_acl) if x)}.", ""]
        out += ["| column | type | default | |", "|---|---|---|---|"]
        for col, type_, notnull, default, generated, col_comment in conn.execute(_COLUMNS, (name,)).fetchall():
            kind_ = f"{type_}{' not null' if notnull else ''}"
            shown = f"generated: `{_cell(default)}`" if generated else (f"`{_cell(default)}`" if default else "")
            out.append(f"| `{col}` | {kind_} | {shown} | {_cell(col_comment)} |")
        out.append("")
    out += ["## Views", "", "| view | source | readable by | what it shows |", "|---|---|---|---|"]
    for name, kind, comment, acl, _ in relations:
        if kind == "v":
            out.append(f"| `{name}` | {_link(where.get(('view', name)))} | {_cell(acl) or 'owner'} | {_cell(comment)} |")
    out += ["", "## Functions", "",
            "Runs as: *owner* for SECURITY DEFINER functions (they pin their search_path), *caller* otherwise.",
            "", "| function | returns | runs as | callable by | source | what it does |", "|---|---|---|---|---|---|"]
    for name, signature, result, definer, trigger, comment, callers in conn.execute(_FUNCTIONS).fetchall():
        if trigger:
            continue
        out.append(f"| `{signature}` | {_cell(result)} | {'owner' if definer else 'caller'} | "
                   f"{_cell(callers) or 'owner only'} | {_link(where.get(('function', name)))} | {_cell(comment)} |")
    out += ["", "## Triggers", "", "Triggers fire for every role that may write the table; their functions need no",
            "EXECUTE grant.", "", "| trigger | fires | its function (source) |", "|---|---|---|"]
    for name, _table, definition, function in conn.execute(_TRIGGERS).fetchall():
        fires = definition.split(" EXECUTE ")[0].removeprefix(f"CREATE TRIGGER {name} ")
        out.append(f"| `{name}` | {_cell(fires)} | `{function}` ({_link(where.get(('function', function)))}) |")
    out += ["", "## Sequences", "", "| sequence | source | what it holds |", "|---|---|---|"]
    for name, kind, comment, _, _ in relations:
        if kind == "S":
            out.append(f"| `{name}` | {_link(where.get(('sequence', name)))} | {_cell(comment)} |")
    out += ["", "## Types and domains", "", "| type | what | its rules | source |", "|---|---|---|---|"]
    for name, what, rules in conn.execute(_TYPES).fetchall():
        link = _link(where.get(("domain", name)) or where.get(("type", name)))
        out.append(f"| `{name}` | {_cell(what)} | {_cell(rules)} | {link} |")
    return "\n".join(out).rstrip() + "\n"


def test_every_object_of_a_fresh_install_is_written_in_schema(conn: psycopg.Connection[Any]) -> None:
    """Each table, view, function, trigger, sequence and type has its one definition in schema/."""
    where = sources()
    rows = conn.execute(
        """SELECT 'function', proname FROM pg_proc WHERE pronamespace = current_schema()::regnamespace
           UNION ALL SELECT CASE relkind WHEN 'v' THEN 'view' WHEN 'S' THEN 'sequence' ELSE 'table' END, relname
             FROM pg_class WHERE relnamespace = current_schema()::regnamespace AND relkind IN ('r', 'p', 'v', 'S')
              AND NOT relispartition AND relname NOT LIKE '%%yoyo%%'
           UNION ALL SELECT 'trigger', t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
            WHERE c.relnamespace = current_schema()::regnamespace AND NOT c.relispartition AND NOT t.tgisinternal
           UNION ALL SELECT CASE typtype WHEN 'd' THEN 'domain' ELSE 'type' END, typname FROM pg_type
            WHERE typnamespace = current_schema()::regnamespace AND typtype IN ('d', 'e')""").fetchall()
    missing = sorted(f"{kind} {name}" for kind, name in rows if (kind, name) not in where)
    assert not missing, f"not written in schema/: {missing}"
    defined = [(s.kind, s.name) for p in sql_files.source_paths()
               for s in sql_files.statements(p.read_text(encoding="utf-8"), p.name)
               if s.kind in ("table", "view", "function", "trigger", "sequence", "type", "domain")]
    twice = sorted({f"{k} {n}" for k, n in defined if defined.count((k, n)) > 1})
    assert not twice, f"written more than once in schema/: {twice}"


def test_sql_api_doc_is_what_a_fresh_install_prints(conn: psycopg.Connection[Any]) -> None:
    want = render(conn)
    have = DOC.read_text(encoding="utf-8") if DOC.exists() else ""
    if have != want and UPDATE:
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(want, encoding="utf-8")
        return
    diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(DOC.relative_to(ROOT)),
                                             "a fresh install", n=1))[:60])
    assert have == want, (f"{DOC.relative_to(ROOT)} is not what a fresh install and schema/ give: "
                          "OUTBOXPG_DOCS_UPDATE=1 bin/test tests/sql/test_sql_api_doc.py rewrites it\n" + diff)
