"""The ``outboxpg`` command line: install the schema, inspect and operate the outbox, run the demo.

  outboxpg migrate [--status | --rollback | --adopt]  install or upgrade the schema (yoyo-migrations)
  outboxpg migrate --inbox [--status | --rollback]    the transactional inbox alone (a consumer's database)
  outboxpg sql [--inbox]                         the whole install as one psql script
  outboxpg status [--json] [--watch [S]]         is it healthy? (outbox_health, events per state)
  outboxpg dead list | show | requeue | discard  dead letters
  outboxpg maintain [--dry-run]                  outbox_maintain(): partitions ahead, expired ones dropped
  outboxpg replay FILTERS [--dry-run]            re-send published events as new events (outbox_replay)
  outboxpg demo                                  the whole flow on throwaway servers

Every command that talks to a database takes --dsn, else $OUTBOXPG_DSN; one that only reads
also falls back on libpq's PG* variables, one that writes needs the database named (--dsn '' asks
for the PG* variables) and says which it writes to before it does. Errors are one line on stderr
and an exit code of the table in outboxpg.cli.errors, never a traceback, and never show a
password.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import psycopg

from outboxpg import schema, sql_files, statements
from outboxpg.cli import dead as cli_dead
from outboxpg.cli import replay as cli_replay
from outboxpg.cli import status as cli_status
from outboxpg.cli.common import (
    SESSION,
    add_dsn,
    add_yes,
    announce_target,
    confirm,
    connect,
    describe_connection_error,
    not_installed,
    package_version,
    permission_hint,
    redact,
    require_target,
    resolve_dsn,
    restore_double_dash,
    secrets_of,
    where_am_i,
    where_text,
)
from outboxpg.cli.errors import (
    EXIT_CODES,
    EXIT_CONNECT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_SCHEMA,
    EXIT_USAGE,
    CliError,
)
from outboxpg.cli.options import OneLineParser
from outboxpg.text import describe, first_line, printable

__all__ = ["build_parser", "main"]


def _print_notice(diag: psycopg.errors.Diagnostic) -> None:
    """A NOTICE or WARNING of a migration step, as psql shows it (on stderr)."""
    print(f"{diag.severity}:  {diag.message_primary}", file=sys.stderr, flush=True)


def _hand_installed_hint(where: str) -> str:
    return (f"the outbox schema is already installed in {where}, but yoyo has no record of it (installed "
            "with psql?): run outboxpg migrate --adopt to check it against the migration files and record it, "
            "then outboxpg migrate")


# The install's refusal when roles other than the owner's may create objects in its schema
# (schema/90_privileges.sql).
_OTHERS_MAY_CREATE = "OBX01"


def _unknown_steps_hint(where: str, steps: list[str]) -> str:
    return (f"{where} records outbox steps this version does not ship ({schema.describe_steps(steps)}): steps "
            "of a release in the making, since squashed into one step; roll them back with the outboxpg that "
            "made them (outboxpg migrate --rollback --steps N), or migrate a new database")


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise CliError(f"--steps must be 1 or more, got {args.steps}", EXIT_USAGE)
    if args.steps != 1 and not args.rollback:
        raise CliError("--steps applies to --rollback only", EXIT_USAGE)
    if args.inbox:
        return _migrate_inbox(args)
    if not args.status:
        flag = " --rollback" if args.rollback else " --adopt" if args.adopt else ""
        require_target(args, f"outboxpg migrate{flag}")
    dsn = resolve_dsn(args)
    with connect(dsn) as conn:     # one-line errors for a bad DSN; what is installed, read only
        where = where_text(where_am_i(conn))
        rec = schema.recorded(conn)
        exposed = conn.execute(statements.UNTRUSTED_CREATORS).fetchone()
        # Said before writing; not before a refusal that writes nothing (the checks below).
        if exposed is None and (rec.hand_installed if args.adopt else not (args.status or args.rollback
                                                                             or rec.unknown or rec.hand_installed)):
            announce_target(conn, "adopting the schema in" if args.adopt else "migrating")
    if exposed is not None and not (args.rollback or args.status):
        name, who = exposed
        raise CliError(f"{who} may CREATE in schema {name} of {where}, where the outbox's SECURITY DEFINER functions "
                       f"look up names (whoever may create there can run code as the owner): refusing to install; "
                       f"REVOKE CREATE ON SCHEMA {name} FROM {who}, then migrate again (docs/privileges.md)")
    if args.rollback:
        return _rollback(dsn, where, rec, args)
    elif args.status:
        if rec.hand_installed:
            print(f"the outbox schema is installed in {where} but yoyo has no record of it (installed with psql?): "
                  "outboxpg migrate --adopt checks it against the files and records it")
        for step in schema.pending(dsn):
            print(f"{'applied' if step.applied else 'not recorded' if rec.hand_installed else 'pending'}  {step.id}")
    elif args.adopt:
        return _adopt(dsn, where, rec)
    else:
        try:
            done = schema.migrate(dsn, on_notice=_print_notice)
        except psycopg.Error as exc:
            if exc.sqlstate == _OTHERS_MAY_CREATE and exc.diag.message_primary:   # a grant made meanwhile
                raise CliError(f"{exc.diag.message_primary.removeprefix('outboxpg: ')}: "
                               f"{exc.diag.message_hint or ''}".rstrip(": ")) from None
            raise
        except schema.HandInstalled:
            raise CliError(_hand_installed_hint(where)) from None
        except schema.UnknownSteps as exc:
            raise CliError(_unknown_steps_hint(where, exc.steps), EXIT_SCHEMA) from None
        print("\n".join(f"applied {m}" for m in done) if done else "schema is up to date")
    return 0


def _migrate_inbox(args: argparse.Namespace) -> int:
    """The transactional inbox's own steps (migrations/inbox/), apart from the outbox's."""
    if args.adopt:
        raise CliError("--adopt applies to the outbox schema only", EXIT_USAGE)
    if not args.status:
        require_target(args, "outboxpg migrate --inbox" + (" --rollback" if args.rollback else ""))
    dsn = resolve_dsn(args)
    with connect(dsn) as conn:
        where = where_text(where_am_i(conn))
        exposed = conn.execute(statements.UNTRUSTED_CREATORS).fetchone()
        if exposed is not None and not (args.rollback or args.status):
            name, who = exposed
            raise CliError(f"{who} may CREATE in schema {name} of {where}, where outbox_inbox_maintain (SECURITY "
                           f"DEFINER) looks up names: refusing to install; REVOKE CREATE ON SCHEMA {name} FROM "
                           f"{who}, then migrate again")
        if not args.status:
            announce_target(conn, "rolling back the inbox in" if args.rollback else "migrating the inbox in")
    if args.status:
        for step in schema.inbox_pending(dsn):
            print(f"{'applied' if step.applied else 'pending'}  {step.id}")
    elif args.rollback:
        confirm(f"Roll back {args.steps} inbox step(s) in {where}?",
                [f"About to roll back the inbox in {where}: its table and every id it remembers go."],
                f"roll back the inbox of {where}", args.yes)
        done = schema.rollback_inbox(dsn, args.steps, on_notice=_print_notice)
        print("\n".join(f"rolled back {m}" for m in done) if done else "nothing to roll back")
    else:
        done = schema.migrate_inbox(dsn, on_notice=_print_notice)
        print("\n".join(f"applied {m}" for m in done) if done else "inbox is up to date")
    return 0


def _rollback(dsn: str, where: str, rec: schema.Recorded, args: argparse.Namespace) -> int:
    """Roll back after naming the database and the steps, and asking (or --yes)."""
    todo = schema.to_roll_back(rec, args.steps)
    if not todo:
        print(f"nothing to roll back in {where}")
        return 0
    confirm(f"Roll back {'this step' if len(todo) == 1 else f'these {len(todo)} steps'} in {where}?",
            [f"About to roll back in {where} (user {SESSION.get('user')}), newest first:",
             *(f"  {step}" for step in todo),
             "Its functions, views and columns go back to the step before; events stay."],
            f"roll back {len(todo)} step{'s' if len(todo) != 1 else ''} of {where}", args.yes)
    print(f"outboxpg: rolling back {where}", file=sys.stderr, flush=True)
    try:
        done = schema.rollback(dsn, args.steps, on_notice=_print_notice, expected=todo)
    except schema.StepsChanged as exc:
        raise CliError(f"the applied steps changed meanwhile (now: {exc}): nothing rolled back; run it again") from None
    print("\n".join(f"rolled back {m}" for m in done) if done else "nothing to roll back")
    return 0


def _adopt(dsn: str, where: str, rec: schema.Recorded) -> int:
    if not rec.installed:
        raise CliError(f"nothing to adopt: the outbox schema is not installed in {where}: "
                       "run outboxpg migrate --dsn ...", EXIT_SCHEMA)
    if not rec.hand_installed:
        ours = len(rec.applied & set(sql_files.step_ids()))
        print(f"nothing to adopt: yoyo records {ours} of the {len(sql_files.step_ids())} steps already "
              "(outboxpg migrate --status)")
        return 0
    done, differences = schema.adopt(dsn)
    if not done:
        raise CliError(f"not adopted: the outbox schema in {where} does not match the migration files of this "
                       f"version ({'; '.join(differences)}); nothing recorded")
    print("\n".join(f"recorded {m}" for m in done))
    rest = len(sql_files.step_ids()) - len(done)
    print(f"checked against the migration files: the install matches {len(done)} steps, recorded in yoyo's "
          f"bookkeeping" + (f"; outboxpg migrate applies the other {rest}" if rest else ""))
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    sys.stdout.write(sql_files.inbox_install_sql() if args.inbox else sql_files.install_sql())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from outboxpg.demo import run_demo

    return run_demo(events=args.events, aggregates=args.aggregates, rate=args.rate)


def build_parser() -> argparse.ArgumentParser:
    # Usage errors are one line (exit 2), in every subcommand too.
    parser = OneLineParser(prog="outboxpg", description="A SQL-first transactional outbox for PostgreSQL.",
                            epilog=EXIT_CODES)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)

    p = sub.add_parser("migrate", help="install or upgrade the outbox schema (yoyo-migrations); re-running is a no-op")
    add_dsn(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rollback", action="store_true", help="roll back the last applied step(s)")
    g.add_argument("--status", action="store_true",
                   help="list every step and whether it is applied (read only: an outbox_operator may run it)")
    g.add_argument("--adopt", action="store_true",
                   help="record a schema installed by hand (outboxpg sql | psql) in yoyo's bookkeeping, after "
                        "checking that its objects match the migration files")
    p.add_argument("--steps", type=int, default=1, help="with --rollback: how many steps (default: 1)")
    p.add_argument("--inbox", action="store_true",
                   help="the transactional inbox instead (docs/how-to/inbox.md): installs alone, no outbox needed")
    add_yes(p)
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("sql", help="print the whole install as one psql script, for DBAs who apply SQL by hand")
    p.add_argument("--inbox", action="store_true", help="the transactional inbox's install instead")
    p.set_defaults(func=cmd_sql)

    cli_status.register(sub)
    cli_dead.register(sub)
    cli_replay.register(sub)

    p = sub.add_parser("demo", help="run the whole flow on throwaway PostgreSQL and nats-server processes")
    p.add_argument("--events", type=int, default=2000, help="sample events to write (default: 2000)")
    p.add_argument("--aggregates", type=int, default=50, help="orders the events belong to (default: 50)")
    p.add_argument("--rate", type=float, default=500.0, help="events written per second (default: 500)")
    p.set_defaults(func=cmd_demo)
    return parser


def _fail(message: str, code: int, secrets: Sequence[str]) -> int:
    # One line, whatever the message quotes (a database error can quote what a producer wrote).
    print(printable(redact(f"outboxpg: {message}", secrets)), file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    if words and words[0].startswith("-") and words[0].split("=")[0] not in ("-h", "--help", "--version"):
        # Before the command only --help and --version exist: say so, not "COMMAND is required".
        parser.error(f"unrecognized arguments: {words[0]}")
    args = parser.parse_args(words)
    restore_double_dash(args, ("dsn", "event_type", "aggregate_type", "aggregate_id", "since", "until", "reason"))
    if isinstance(getattr(args, "dsn", None), list):   # `status` takes --dsn repeated; "--dsn=--" is "--" there too
        args.dsn = ["--" if dsn == [] else dsn for dsn in args.dsn]
    secrets = secrets_of(resolve_dsn(args))
    try:
        return int(args.func(args))
    except CliError as exc:
        return _fail(str(exc), exc.code, secrets)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `outboxpg dead list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    # Objects gone from under a command that checked for them (or a command that does not check).
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction, psycopg.errors.UndefinedColumn,
            psycopg.errors.UndefinedObject) as exc:
        if 'relation "outbox" does not exist' in str(exc):
            return _fail(not_installed(), EXIT_SCHEMA, secrets)
        return _fail(f"the outbox schema is not up to date ({first_line(exc)}): run outboxpg migrate --dsn ...",
                     EXIT_SCHEMA, secrets)
    except psycopg.errors.InsufficientPrivilege as exc:   # e.g. a producer's login
        return _fail(permission_hint(exc), EXIT_FAILED, secrets)
    except psycopg.OperationalError as exc:
        if exc.sqlstate is None:  # from libpq, not from the server: connecting failed (or the connection broke)
            return _fail(describe_connection_error(exc), EXIT_CONNECT, secrets)
        return _fail(f"database error: {first_line(exc)}", EXIT_FAILED, secrets)
    except psycopg.Error as exc:
        return _fail(f"database error: {first_line(exc)}", EXIT_FAILED, secrets)
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback (OUTBOXPG_DEBUG=1 shows it)
        if os.environ.get("OUTBOXPG_DEBUG"):
            raise
        return _fail(describe(exc), EXIT_FAILED, secrets)


if __name__ == "__main__":
    sys.exit(main())
