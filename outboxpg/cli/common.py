"""What every ``outboxpg`` command shares: the DSN, connecting, the schema check, one-line
errors that never show a password, confirmation prompts, JSON output."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, unquote

import orjson
import psycopg
from psycopg.conninfo import conninfo_to_dict

from outboxpg import schema, sql_files, statements
from outboxpg.cli.errors import EXIT_CONNECT, EXIT_SCHEMA, EXIT_USAGE, CliError
from outboxpg.text import first_line

DSN_HELP = "libpq connection string or URI (default: $OUTBOXPG_DSN, else libpq's PG* variables)"

NOT_INSTALLED = "the outbox schema is not installed in this database: run outboxpg migrate --dsn ..."

N = TypeVar("N", int, float)

# The login and database of the last connect(): messages about them name them.
SESSION: dict[str, Any] = {}


def not_installed(where: dict[str, Any] | None = None) -> str:
    """'the outbox schema is not installed in database shop on db:5432: run outboxpg migrate ...'."""
    where = where if where is not None else SESSION
    if not where.get("dbname"):
        return NOT_INSTALLED
    return f"the outbox schema is not installed in {where_text(where)}: run outboxpg migrate --dsn ..."


_DENIED = re.compile(r"permission denied for (view|table|relation|function|sequence|schema) (\S+)")


def permission_hint(exc: psycopg.Error) -> str:
    """A login without the operator's rights (a producer's, a worker's): what it may not do, and
    the grant that would let it."""
    text = first_line(exc)
    user = SESSION.get("user") or "?"
    m = _DENIED.search(text)
    verb = "execute" if m and m.group(1) == "function" else "read" if m and m.group(1) != "schema" else "use"
    what = f"{verb} {m.group(2)}" if m else "do this"
    return (f"role '{user}' may not {what} ({text}): log in as a member of outbox_operator "
            f"(GRANT outbox_operator TO \"{user}\"; see docs/privileges.md)")


def package_version() -> str:
    """The installed outboxpg version (--version of both tools)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outboxpg")
    except PackageNotFoundError:   # run from a source tree that is not installed
        from outboxpg import __version__

        return __version__


def add_dsn(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dsn", help=DSN_HELP)


def add_yes(parser: argparse.ArgumentParser) -> None:
    """--yes / -y: the rule of every command that changes several events (see confirm)."""
    parser.add_argument("--yes", "-y", action="store_true",
                        help="do not ask for confirmation (needed without a terminal when touching several events)")


def untrusted_creators_text(who: str, schema: str) -> str:
    """What the worker's refusal and outboxpg status say when roles besides the owners' may create
    objects in the install schema (outbox_untrusted_creators()): who, where, why, and the REVOKE."""
    return (f"{who} may CREATE in schema {schema}, where the outbox's SECURITY DEFINER functions look up names "
            f"(whoever may create there can run code as the owner): REVOKE CREATE ON SCHEMA {schema} FROM {who} "
            "(docs/privileges.md)")


def point_in_time(conn: psycopg.Connection[Any], text: str, flag: str) -> Any:
    """``flag``'s value as a timestamptz: a timestamp, else an interval ago (PostgreSQL reads both).
    One a datetime cannot hold ('-infinity', before year 1) comes back as PostgreSQL's text."""
    for query, as_text in zip(statements.SINCE, statements.SINCE_TEXT):
        try:
            with conn.transaction():
                row = conn.execute(query, (text,)).fetchone()
            assert row is not None
            return row[0]
        except psycopg.DataError as exc:
            if exc.sqlstate is not None:   # PostgreSQL could not read it as this kind
                continue
            # PostgreSQL read it, psycopg cannot hold it as a datetime.
            with conn.transaction():
                row = conn.execute(as_text, (text,)).fetchone()
            assert row is not None
            return row[0]
        except psycopg.errors.SyntaxError:
            continue
    raise CliError(f"{flag}: neither a timestamp nor an interval: {text!r}", EXIT_USAGE)


def number_type(kind: Callable[[str], N], not_one: str, ok: Callable[[N], bool],
                out_of_range: str | None = None) -> Callable[[str], N]:
    """An argparse ``type=``: the text read as ``kind``; ``not_one`` (or ``out_of_range``
    when the number is there but ``ok`` refuses it) is the error, ``{!r}`` the text."""
    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(not_one.format(text)) from None
        if not ok(value):
            raise argparse.ArgumentTypeError((out_of_range or not_one).format(text))
        return value
    return parse


def restore_double_dash(args: argparse.Namespace, names: Iterable[str]) -> None:
    """Undo an argparse quirk (seen on CPython 3.11): in ``--opt=--`` it drops the ``--`` and
    leaves the option an empty list, which a query would then send as the array literal '{}'
    (so ``--event-type=--`` matched the events whose type is "{}"). [] is what ``--`` was."""
    for name in names:
        if getattr(args, name, None) == []:
            setattr(args, name, "--")


def require_target(args: argparse.Namespace, what: str) -> None:
    """A command that writes needs its database named, by --dsn or $OUTBOXPG_DSN (an empty
    string is a name too: libpq's PG* variables, asked for). Without one, libpq would pick a
    database by itself (the local socket, a database named after the OS user), and the schema or
    a repair would land where nobody meant it to: a usage error, before connecting."""
    if getattr(args, "dsn", None) is None and "OUTBOXPG_DSN" not in os.environ:
        raise CliError(f"{what} writes to a database: name it with --dsn or OUTBOXPG_DSN "
                       "(--dsn '' takes libpq's PG* variables)", EXIT_USAGE)


def announce_target(conn: psycopg.Connection[Any], doing: str) -> None:
    """'outboxpg: migrating database shop on 127.0.0.1:5432 as alice', on stderr, before a
    command writes: what it writes to is never a guess (never the password)."""
    print(f"outboxpg: {doing} {where_text(where_am_i(conn))} as {conn.info.user}", file=sys.stderr, flush=True)


def resolve_dsn(args: argparse.Namespace) -> str:
    """--dsn, else $OUTBOXPG_DSN, else '' (libpq then reads PGHOST, PGDATABASE, ...)."""
    dsn = getattr(args, "dsn", None)
    return dsn if dsn is not None else os.environ.get("OUTBOXPG_DSN", "")


# -- never show a password ------------------------------------------------------------------

_PASSWORD_KV = re.compile(r"password\s*=\s*('(?:[^'\\]|\\.)*'|[^\s]+)", re.IGNORECASE)
_PASSWORD_URI = re.compile(r"://[^/@?#]*?:([^/@?#]*)@")
_PASSWORD_QUERY = re.compile(r"[?&]password=([^&#]*)", re.IGNORECASE)


def secrets_of(dsn: str | Sequence[str] | None) -> list[str]:
    """Every form in which a password of ``dsn`` (or of each of several; or $PGPASSWORD) could
    show up in a message."""
    if dsn is None or not isinstance(dsn, str):
        return sorted({s for one in dsn or () if isinstance(one, str) for s in secrets_of(one)} |
                      set(secrets_of("")), key=len, reverse=True)
    found: set[str] = set()
    try:
        pw = conninfo_to_dict(dsn).get("password")
        if pw:
            found.add(str(pw))
    except psycopg.Error:
        pass
    for rx in (_PASSWORD_KV, _PASSWORD_URI, _PASSWORD_QUERY):
        for m in rx.finditer(dsn):
            raw = m.group(1).strip("'")
            if raw:
                found.add(raw)
    if os.environ.get("PGPASSWORD"):
        found.add(os.environ["PGPASSWORD"])
    forms = set(found)
    for s in found:
        forms.update({quote(s, safe=""), unquote(s)})
    # Longest first, so that a password containing another one is replaced whole.
    return sorted((f for f in forms if f), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        text = text.replace(s, "***")
    return text


def _has_password_part(dsn: str) -> bool:
    return bool(re.search(r"password", dsn, re.IGNORECASE) or _PASSWORD_URI.search(dsn))


def describe_connection_error(exc: psycopg.Error) -> str:
    # libpq's message names host and port but never the password; its first line is enough
    # ("connection failed: connection to server at ..., port ... failed: Connection refused").
    return f"cannot connect to PostgreSQL: {first_line(exc)}"


# -- connecting and checking the schema -----------------------------------------------------

def parse_dsn(dsn: str) -> dict[str, Any]:
    """The DSN's parameters; a string libpq cannot parse is a usage error (exit 2)."""
    try:
        return conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        if _has_password_part(dsn):
            # libpq quotes the part it could not parse, which may be (part of) the password.
            raise CliError("invalid connection string "
                           "(libpq's message is withheld because the string holds a password)",
                           EXIT_USAGE) from None
        raise CliError(f"invalid connection string: {first_line(exc)}", EXIT_USAGE) from None


def connect(dsn: str) -> psycopg.Connection[Any]:
    """An autocommit connection; a malformed DSN is a usage error (exit 2), an unreachable
    server or a refused login a CliError with exit 3."""
    params = parse_dsn(dsn)
    extra: dict[str, Any] = {}
    if "connect_timeout" not in params and not os.environ.get("PGCONNECT_TIMEOUT"):
        extra["connect_timeout"] = 10
    if "application_name" not in params and not os.environ.get("PGAPPNAME"):
        extra["application_name"] = "outboxpg"
    try:
        conn = psycopg.connect(dsn, autocommit=True, **extra)
    except psycopg.Error as exc:
        raise CliError(describe_connection_error(exc), EXIT_CONNECT) from None
    SESSION.update(user=conn.info.user, **where_am_i(conn))
    return conn


def require_schema(conn: psycopg.Connection[Any]) -> None:
    """Refuse (exit 4) a database without the outbox schema, or with an older one than ours."""
    # yoyo's bookkeeping, when this role may read it (an outbox_operator login may not).
    rec = schema.recorded(conn)
    if not rec.installed:
        raise CliError(not_installed(where_am_i(conn)), EXIT_SCHEMA)
    if rec.unknown:
        raise CliError(f"the outbox schema in {where_text(where_am_i(conn))} has steps this version does not "
                       f"ship ({schema.describe_steps(rec.unknown)}): outboxpg migrate says what to do", EXIT_SCHEMA)
    ours = sql_files.step_ids()
    applied = rec.applied
    if applied & set(ours):
        missing = [s for s in ours if s not in applied]
        if missing:
            steps = "1 step" if len(missing) == 1 else f"{len(missing)} steps"
            raise CliError(f"the outbox schema is not up to date ({steps} pending): run outboxpg migrate --dsn ...",
                           EXIT_SCHEMA)
        return
    # Installed by hand (psql), without yoyo's bookkeeping (or it is not readable): look for
    # the objects we use (statements.REQUIRED_OBJECTS, the newest first).
    found = conn.execute(statements.REQUIRED).fetchone()
    assert found is not None
    for (name, _), there in zip(statements.REQUIRED_OBJECTS, found):
        if not there:
            raise CliError(f"the outbox schema is not up to date ({name} is missing): run outboxpg migrate "
                           "--dsn ... (or apply the newer files of migrations/ with psql)", EXIT_SCHEMA)


def open_outbox(args: argparse.Namespace) -> psycopg.Connection[Any]:
    """Connect with the command's DSN and check the schema; the caller closes the connection."""
    conn = connect(resolve_dsn(args))
    try:
        require_schema(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def where_am_i(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Database name, host and port of the connection (never the password)."""
    info = conn.info
    return {"dbname": info.dbname, "host": info.host, "port": info.port}


def where_text(where: dict[str, Any]) -> str:
    """'database shop on 127.0.0.1:5432'."""
    return f"database {where['dbname']} on {where['host'] or 'local socket'}:{where['port']}"


# -- output and prompts ---------------------------------------------------------------------

def _json_default(value: Any) -> Any:
    import datetime as dt
    from decimal import Decimal

    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, Decimal):
        return float(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


# What JSON leaves raw in its strings but a terminal may act on: DEL, the C1 controls (U+009B is
# a CSI on some terminals), the line and paragraph separators. (JSON escapes the C0 ones.)
_JSON_RAW_CONTROLS = re.compile("[\x7f-\x9f\u2028\u2029]")


def print_json(obj: Any, indent: bool = False) -> None:
    option = orjson.OPT_INDENT_2 if indent else 0
    text = orjson.dumps(obj, default=_json_default, option=option).decode()
    # They occur only inside strings, where \uXXXX is the same character to a JSON reader.
    text = _JSON_RAW_CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def confirm(question: str, details: list[str], what: str, yes: bool) -> None:
    """Ask ``question`` on the terminal (details first) unless ``yes``. Without a terminal on stdin
    and without --yes: refuse, in one line. A 'no' ends the command (exit 1, nothing changed)."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise CliError(f"refusing to {what} without confirmation: stdin is not a terminal (pass --yes)")
    if SESSION.get("dbname"):
        details = [f"Database: {where_text(SESSION)}, as {SESSION.get('user')}", *details]
    for line in details:
        print(line, file=sys.stderr)
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    if answer.strip().lower() not in ("y", "yes"):
        raise CliError("cancelled: nothing changed")
