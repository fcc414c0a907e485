"""The SQL files outboxpg ships, and reading them statement by statement.

- ``schema/``: the current definition of every SQL object, written once, one file per concern
  (``source_paths``). What people read and edit; ``outboxpg sql`` prints it as one script.
- ``migrations/``: the release steps that yoyo applies (``step_paths``): the frozen steps of each
  release, each produced from ``schema/`` when it was released (tools/schema_step.py).
- ``schema/inbox/`` and ``migrations/inbox/``: the same two for the transactional inbox, which
  installs alone into a consumer's database (``inbox_source_paths``, ``inbox_step_paths``,
  ``inbox_install_sql``; docs/how-to/inbox.md).

``statements`` splits a file into its statements, each with the comment written above it, the
line it starts on and the object it defines, so that tools can compare two versions of the
schema object by object (tools/schema_step.py) and index it (docs/sql-api.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

__all__ = ["INBOX_FIRST_STEP", "Release", "Statement", "inbox_first_step", "inbox_install_sql",
           "inbox_migrations_dir", "inbox_source_paths", "inbox_step_ids", "inbox_step_paths", "install_sql",
           "migrations_dir", "released_steps", "releases", "schema_dir", "source_paths", "statements", "step_ids",
           "step_paths"]


def migrations_dir() -> Path:
    """The release steps yoyo applies (shipped inside the package)."""
    return Path(str(resources.files("outboxpg") / "migrations"))


def schema_dir() -> Path:
    """The current schema, one file per concern (shipped inside the package)."""
    return Path(str(resources.files("outboxpg") / "schema_source"))


def source_paths() -> list[Path]:
    """The files of the current schema, in the order they are applied."""
    return sorted(schema_dir().glob("[0-9]*.sql"))


def step_paths() -> list[Path]:
    """The files of the migration steps this version of outboxpg ships, in order (no rollbacks)."""
    return sorted(p for p in migrations_dir().glob("[0-9]*.sql") if not p.name.endswith(".rollback.sql"))


def step_ids() -> list[str]:
    """The migration steps this version of outboxpg ships, in order."""
    return [p.name.removesuffix(".sql") for p in step_paths()]


@dataclass
class Release:
    name: str                 # the annotated tag, e.g. schema-1
    commit: str               # the commit the tag points at (for clones without the tag)
    files: dict[str, str] = field(default_factory=dict)   # file name -> sha256


def releases() -> list[Release]:
    """migrations/RELEASED: '# ...' comments, one 'release NAME COMMIT' line per release, then one
    'NAME SHA256 FILE' line per released file (the checksum first, as sha256sum prints it)."""
    out: dict[str, Release] = {}
    for n, line in enumerate((migrations_dir() / "RELEASED").read_text(encoding="utf-8").splitlines(), 1):
        words = line.split()
        if not words or line.startswith("#"):
            continue
        if words[0] == "release" and len(words) == 3 and words[1] not in out:
            out[words[1]] = Release(words[1], words[2])
        elif len(words) == 3 and words[0] in out and re.fullmatch(r"[0-9a-f]{64}", words[1]) \
                and not any(words[2] in r.files for r in out.values()):
            out[words[0]].files[words[2]] = words[1]
        else:
            raise ValueError(f"migrations/RELEASED:{n}: not 'release NAME COMMIT' (once per name) nor "
                             f"'NAME SHA256 FILE' (once per file) of a release named above: {line!r}")
    return list(out.values())


def released_steps() -> list[str]:
    """The ids of the released steps, in order (their rollbacks left out)."""
    return sorted(f.removesuffix(".sql") for r in releases() for f in r.files if not f.endswith(".rollback.sql"))


def install_sql() -> str:
    """The current schema as one psql script, in one transaction, for DBAs who apply SQL by hand.

    It is the files of schema/ in order. A database installed this way has no yoyo bookkeeping:
    ``outboxpg migrate --adopt`` records it (it is checked against the release steps first).
    """
    return _script("outboxpg install script", "schema/", source_paths())


def _script(title: str, folder: str, paths: list[Path]) -> str:
    """The files ``paths`` (of ``folder``) in order, as one psql script in one transaction."""
    parts = [f"-- {title}: the files of {folder} in order, in one transaction.", "\\set ON_ERROR_STOP on", "BEGIN;"]
    for path in paths:
        parts.append(f"\n-- ==== {folder}{path.name} ====")
        parts.append(path.read_text(encoding="utf-8").rstrip())
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


# -- the inbox ----------------------------------------------------------------------------------

def inbox_migrations_dir() -> Path:
    """The inbox's steps, which yoyo applies apart from the outbox's (outboxpg migrate --inbox)."""
    return migrations_dir() / "inbox"


def inbox_source_paths() -> list[Path]:
    """The files of the inbox's current schema, in the order they are applied."""
    return sorted((schema_dir() / "inbox").glob("[0-9]*.sql"))


def inbox_step_paths() -> list[Path]:
    return sorted(p for p in inbox_migrations_dir().glob("[0-9]*.sql") if not p.name.endswith(".rollback.sql"))


def inbox_step_ids() -> list[str]:
    return [p.name.removesuffix(".sql") for p in inbox_step_paths()]


def inbox_install_sql() -> str:
    """The inbox as one psql script, in one transaction (outboxpg sql --inbox): schema/inbox/ in order.
    It needs no outbox in the database."""
    return _script("outboxpg inbox install script", "schema/inbox/", inbox_source_paths())


# The inbox's first step, until it is released: the files of schema/inbox/ as they are
# (tools/inbox_step.py writes it; tests/sql/test_inbox.py checks it is up to date). A later
# change of schema/inbox/ gets a step of its own, like the outbox's (docs/migrations.md).
INBOX_FIRST_STEP = "0001_inbox_1"
_INBOX_ROLLBACK = """\
-- outboxpg inbox: rolls back its first step (0001_inbox_1.sql). The role outbox_consumer stays:
-- roles belong to the cluster, and other databases may use it.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;
DROP FUNCTION outbox_inbox_maintain(boolean);
DROP VIEW outbox_inbox_partitions;
DROP FUNCTION outbox_inbox_receive(text, text);
DROP TABLE outbox_inbox;
DROP TABLE outbox_inbox_settings;
"""


def inbox_first_step() -> tuple[str, str]:
    """What migrations/inbox/0001_inbox_1.sql and its .rollback.sql hold: (upgrade, rollback)."""
    parts = ["-- outboxpg inbox, step 1: the files of schema/inbox/ in order.",
             "--",
             "-- Produced by tools/inbox_step.py from schema/inbox/: do not edit it. Once released, frozen."]
    for path in inbox_source_paths():
        parts.append(f"\n-- ==== schema/inbox/{path.name} ====")
        parts.append(path.read_text(encoding="utf-8").rstrip())
    return "\n".join(parts) + "\n", _INBOX_ROLLBACK


# -- statements ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Statement:
    file: str        # the file's name
    line: int        # the line its SQL starts on (1-based)
    comment: str     # the comment lines right above it (blank lines end a comment)
    text: str        # the statement, from its first word to its semicolon
    kind: str        # what it defines or does: function, view, trigger, table, index, comment, grant, ...
    name: str        # the object's name (for a comment: "function outbox_claim"); '' when it names none

    @property
    def key(self) -> tuple[str, str]:
        """What the statement is about: the same for every version of one object's definition.
        Statements that define nothing by name (GRANT, REVOKE, DO, INSERT) are their own text."""
        return (self.kind, self.name or " ".join(self.text.split()))

    @property
    def end_line(self) -> int:
        return self.line + self.text.count("\n")


_NAME = r'("(?:[^"]|"")+"|[\w$]+)'
_QUALIFIED = rf"{_NAME}(?:\s*\.\s*{_NAME})?"
# First matching pattern wins: (kind, regex on the statement's text; group 'name' is the object).
_KINDS: list[tuple[str, re.Pattern[str]]] = [(kind, re.compile(pattern, re.I | re.S)) for kind, pattern in [
    ("function", rf"CREATE\s+(?:OR\s+REPLACE\s+)?(?:FUNCTION|PROCEDURE)\s+(?P<name>{_QUALIFIED})"),
    ("view", rf"CREATE\s+(?:OR\s+REPLACE\s+)?(?:MATERIALIZED\s+)?VIEW\s+(?P<name>{_QUALIFIED})"),
    ("trigger", rf"CREATE\s+(?:OR\s+REPLACE\s+)?(?:CONSTRAINT\s+)?TRIGGER\s+(?P<name>{_NAME})"),
    ("table", rf"CREATE\s+(?:UNLOGGED\s+)?TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(?P<name>{_QUALIFIED})"),
    ("index", rf"CREATE\s+(?:UNIQUE\s+)?INDEX\s+(?:CONCURRENTLY\s+)?(?:IF\s+NOT\s+EXISTS\s+)?(?P<name>{_NAME})"),
    ("sequence", rf"CREATE\s+SEQUENCE\s+(?:IF\s+NOT\s+EXISTS\s+)?(?P<name>{_QUALIFIED})"),
    ("type", rf"CREATE\s+TYPE\s+(?P<name>{_QUALIFIED})"),
    ("domain", rf"CREATE\s+DOMAIN\s+(?P<name>{_QUALIFIED})"),
    ("comment", r"COMMENT\s+ON\s+(?P<name>(?:MATERIALIZED\s+VIEW|[A-Z]+)\s+"
                rf"{_QUALIFIED}(?:\s*\.\s*{_NAME})?(?:\s+ON\s+{_QUALIFIED})?)"),
    ("alter function", rf"ALTER\s+(?:FUNCTION|PROCEDURE)\s+(?P<name>{_QUALIFIED})"),
    ("alter", rf"ALTER\s+\w+\s+(?:IF\s+EXISTS\s+)?(?P<name>{_QUALIFIED})"),
    ("drop", r"DROP\s+"),
    ("grant", r"GRANT\s+"),
    ("revoke", r"REVOKE\s+"),
    ("do", r"DO\s+"),
    ("insert", r"INSERT\s+"),
    ("select", r"SELECT\s+"),
]]


def _classify(text: str) -> tuple[str, str]:
    for kind, pattern in _KINDS:
        m = pattern.match(text)
        if m:
            name = m.groupdict().get("name") or ""
            name = " ".join(name.lower().split()).replace('"', "") if kind == "comment" else name.replace('"', "")
            return kind, name
    return "other", ""


_TOKEN = re.compile(r"""
      (?P<line_comment>--[^\n]*)
    | (?P<block_comment>/\*)
    | (?P<dollar>\$(?:[A-Za-z_][\w]*)?\$)
    | (?P<estring>[Ee]'(?:[^'\\]|\\.|'')*')
    | (?P<string>'(?:[^']|'')*')
    | (?P<ident>"(?:[^"]|"")*")
    | (?P<semicolon>;)
    | (?P<newline>\n)
    | (?P<word>[\w$]+)
    | (?P<other>.)
""", re.X | re.S)


def statements(text: str, file: str = "") -> list[Statement]:
    """The statements of a SQL file, in order. A statement's comment is the run of whole-line
    ``--`` comments directly above it (a blank line ends it); comments inside it stay in its text.
    Dollar quotes, strings, quoted names and nested block comments are skipped over whole."""
    out: list[Statement] = []
    comment: list[str] = []
    start: int | None = None        # offset where the current statement's SQL starts
    start_line = 0
    line = 1
    pos = 0
    line_start = 0                  # offset of the current line's start
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        assert m is not None
        kind, token = m.lastgroup, m.group()
        if kind == "newline":
            if start is None and not text[line_start:pos].strip():
                comment = []        # a blank line outside a statement ends the comment above
            line += 1
            pos = m.end()
            line_start = pos
            continue
        if kind == "line_comment":
            if start is None:
                whole_line = not text[line_start:pos].strip()
                comment = [*comment, token] if whole_line else []
            pos = m.end()
            continue
        if kind == "block_comment":
            depth, end = 1, m.end()
            while depth and end < len(text):
                if text.startswith("/*", end):
                    depth, end = depth + 1, end + 2
                elif text.startswith("*/", end):
                    depth, end = depth - 1, end + 2
                else:
                    end += 1
            line += text.count("\n", pos, end)
            pos = end
            continue
        if kind == "dollar":
            end = text.find(token, m.end())
            if end < 0:
                raise ValueError(f"{file}:{line}: unterminated dollar quote {token}")
            end += len(token)
        else:
            end = m.end()
        if start is None and kind not in ("semicolon",) and not token.isspace():
            start, start_line = pos, line
        if kind == "semicolon" and start is not None:
            body = text[start:end]
            stmt_kind, name = _classify(body)
            out.append(Statement(file, start_line, "\n".join(comment), body, stmt_kind, name))
            start, comment = None, []
        line += text.count("\n", pos, end)
        pos = end
    if start is not None and text[start:].strip():
        raise ValueError(f"{file}:{start_line}: a statement without its closing semicolon")
    return out
