"""Every SQL statement the package sends is in outboxpg/statements.py or, for the worker's claim
and report path, outboxpg/relay/gateway.py: no SQL literal anywhere else in outboxpg/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import outboxpg

PACKAGE = Path(outboxpg.__file__).parent
HOMES = {PACKAGE / "statements.py", PACKAGE / "relay" / "gateway.py"}

# A string that starts like a statement (what psycopg would send; the package writes SQL keywords
# in capitals).
_STATEMENT = re.compile(r"^\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP|GRANT|REVOKE|SET|RESET|LISTEN|"
                        r"UNLISTEN|NOTIFY|COPY|BEGIN|COMMIT|ROLLBACK|TRUNCATE|LOCK|CALL|DO|EXPLAIN)\s")
# ... and not English that happens to start with one of those words (messages, help texts).
_SQL_WORDS = re.compile(r"\b(FROM|INTO|VALUES|TABLE|SCHEMA|FUNCTION|search_path|outbox_\w+\(|pg_\w+\(|%s)\b|%s")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def sql_literals(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):   # an f-string: its text parts, the values as {}
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            skip.update(id(v) for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
        else:
            continue
        if _STATEMENT.match(text) and (_SQL_WORDS.search(text) or text.split()[0] in ("LISTEN", "NOTIFY")):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {text.strip()[:60]!r}")
    return found


def test_no_sql_outside_the_two_modules() -> None:
    stray = [hit for path in sorted(PACKAGE.rglob("*.py")) if path not in HOMES for hit in sql_literals(path)]
    assert not stray, "SQL statements outside outboxpg/statements.py and outboxpg/relay/gateway.py: " + "; ".join(stray)


def test_the_check_finds_statements() -> None:
    """The scan sees what it looks for (in the two modules that may hold them)."""
    hits = sql_literals(PACKAGE / "statements.py")
    assert any("outbox_dead_letters" in h for h in hits) and any("INSERT INTO outbox" in h for h in hits)
    assert any("outbox_claim" in h for h in sql_literals(PACKAGE / "relay" / "gateway.py"))
