"""The package's import structure: one import path per thing means no import circles, and the
relay never imports the command lines. Read from the sources (every import statement, also those
inside functions), nothing imported; but for what the operator CLI loads as it starts, run in a
process of its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "outboxpg"
KNOWN_CIRCLES: list[set[str]] = []


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str) -> set[str]:
    """The outboxpg modules ``name`` imports (``from outboxpg.cli import dead``: outboxpg.cli.dead; a
    package's own __init__, run before any of its modules, is not counted as imported)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def circles() -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_sources_are_read() -> None:
    assert "outboxpg.relay.nats.publisher" in MODULES
    assert "outboxpg.relay.nats.connection" in GRAPH["outboxpg.relay.nats.publisher"]
    assert "outboxpg.cli.dead" in GRAPH["outboxpg.cli.outboxpg"]   # from outboxpg.cli import dead


def test_no_import_circles() -> None:
    assert [c for c in circles() if c not in KNOWN_CIRCLES] == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("outboxpg.relay")))
def test_the_relay_never_imports_the_command_lines(module: str) -> None:
    assert not [m for m in GRAPH[module] if m == "outboxpg.cli" or m.startswith("outboxpg.cli.")]


def test_no_class_of_the_nats_publisher_is_longer_than_250_lines() -> None:
    for path in (PACKAGE / "relay" / "nats").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None and node.end_lineno - node.lineno < 250, (path.name, node.name)


@pytest.mark.parametrize("cli", ["outboxpg.cli.outboxpg", "outboxpg.cli.outboxpg_worker"])
def test_the_command_lines_start_without_the_nats_client(cli: str) -> None:
    """`outboxpg` (status, dead, replay, migrate...) talks to PostgreSQL; nats-py (and the aiohttp
    it loads) is imported only when `status --nats-url` looks at the streams. At module level
    they took about a third of every command's start (0.64 against 0.40 s for `outboxpg status`).
    `outboxpg-worker` imports them on its way to a NATS server: a refused flag, --help, a
    --publisher or another --sink start without them. Neither loads yoyo until it applies or
    rolls back migration steps."""
    loaded = subprocess.run(
        [sys.executable, "-c", f"import sys, {cli}; "
                               "print(sorted(m for m in ('nats', 'aiohttp', 'yoyo') if m in sys.modules))"],
        capture_output=True, text=True, check=True, cwd=PACKAGE.parent).stdout.strip()
    assert loaded == "[]"
