"""The ``outboxpg`` command line: install the schema, inspect and operate the outbox, run the demo.

  outboxpg migrate [--status | --rollback]      install or upgrade the schema (yoyo-migrations)
  outboxpg sql                                   the whole install as one psql script
  outboxpg status [--json] [--watch [S]]         is it healthy? (outbox_health, events per state)
  outboxpg dead list | show | requeue | discard  dead letters
  outboxpg maintain [--dry-run]                  outbox_maintain(): partitions ahead, expired ones dropped
  outboxpg demo                                  the whole flow on throwaway servers

Every command that talks to a database takes --dsn, else $OUTBOXPG_DSN, else libpq's PG* variables.
Errors are one line on stderr and a non-zero exit code, never a traceback, and never show a
password: 1 the command failed or was refused, 2 cannot connect (or bad usage), 3 the outbox
schema is missing or older than this version.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import psycopg

from outboxpg import cli_dead, cli_status, schema
from outboxpg.cli_common import (EXIT_CONNECT, EXIT_FAILED, EXIT_SCHEMA, CliError, add_dsn,
                                 describe_connection_error, first_line, not_installed, package_version,
                                 permission_hint, redact, resolve_dsn, restore_double_dash, secrets_of)

__all__ = ["CliError", "build_parser", "main"]


def cmd_migrate(args: argparse.Namespace) -> int:
    dsn = resolve_dsn(args)
    if args.rollback:
        done = schema.rollback(dsn, args.steps)
        print("\n".join(f"rolled back {m}" for m in done) if done else "nothing to roll back")
    elif args.status:
        for step in schema.pending(dsn):
            print(f"{'applied' if step.applied else 'pending'}  {step.id}")
    else:
        done = schema.migrate(dsn)
        print("\n".join(f"applied {m}" for m in done) if done else "schema is up to date")
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    sys.stdout.write(schema.install_sql())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from outboxpg.demo import run_demo

    return run_demo(events=args.events, aggregates=args.aggregates, rate=args.rate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outboxpg", description="A SQL-first transactional outbox for PostgreSQL.",
                                     epilog="Exit codes: 0 ok, 1 failed or refused, 2 cannot connect or bad usage, "
                                            "3 outbox schema missing or not up to date.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="install or upgrade the outbox schema (yoyo-migrations); re-running is a no-op")
    add_dsn(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rollback", action="store_true", help="roll back the last applied step(s)")
    g.add_argument("--status", action="store_true", help="list every step and whether it is applied")
    p.add_argument("--steps", type=int, default=1, help="with --rollback: how many steps (default: 1)")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("sql", help="print the whole install as one psql script, for DBAs who apply SQL by hand")
    p.set_defaults(func=cmd_sql)

    cli_status.register(sub)
    cli_dead.register(sub)

    p = sub.add_parser("demo", help="run the whole flow on throwaway PostgreSQL and nats-server processes")
    p.add_argument("--events", type=int, default=2000, help="sample events to write (default: 2000)")
    p.add_argument("--aggregates", type=int, default=50, help="orders the events belong to (default: 50)")
    p.add_argument("--rate", type=float, default=500.0, help="events written per second (default: 500)")
    p.set_defaults(func=cmd_demo)
    return parser


def _fail(message: str, code: int, secrets: Sequence[str]) -> int:
    print(redact(f"outboxpg: {message}", secrets), file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    restore_double_dash(args, ("dsn", "event_type", "aggregate_type", "aggregate_id", "since", "reason"))
    secrets = secrets_of(resolve_dsn(args))
    try:
        return int(args.func(args))
    except CliError as exc:
        return _fail(str(exc), exc.code, secrets)
    except KeyboardInterrupt:
        return 130
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
        return _fail(f"{type(exc).__name__}: {first_line(exc)}", EXIT_FAILED, secrets)


if __name__ == "__main__":
    sys.exit(main())
