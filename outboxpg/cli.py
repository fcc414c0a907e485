"""The ``outboxpg`` command line: install the schema, print it, run the demo.

Errors are one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import psycopg

from outboxpg import schema

DSN_HELP = "libpq connection string or URI (default: $OUTBOXPG_DSN, else libpq's PG* variables)"


class CliError(Exception):
    """A failure to report as one line, with exit code ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _dsn(args: argparse.Namespace) -> str:
    return args.dsn if args.dsn is not None else os.environ.get("OUTBOXPG_DSN", "")


def _describe_connection_error(exc: psycopg.OperationalError) -> str:
    # libpq's message names host and port but never the password; keep its first line only.
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"cannot connect to PostgreSQL: {first}"


def cmd_migrate(args: argparse.Namespace) -> int:
    dsn = _dsn(args)
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
    parser = argparse.ArgumentParser(prog="outboxpg", description="A SQL-first transactional outbox for PostgreSQL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("migrate", help="install or upgrade the outbox schema (yoyo-migrations); re-running is a no-op")
    p.add_argument("--dsn", help=DSN_HELP)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rollback", action="store_true", help="roll back the last applied step(s)")
    g.add_argument("--status", action="store_true", help="list every step and whether it is applied")
    p.add_argument("--steps", type=int, default=1, help="with --rollback: how many steps (default: 1)")
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("sql", help="print the whole install as one psql script, for DBAs who apply SQL by hand")
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser("demo", help="run the whole flow on throwaway PostgreSQL and nats-server processes")
    p.add_argument("--events", type=int, default=2000, help="sample events to write (default: 2000)")
    p.add_argument("--aggregates", type=int, default=50, help="orders the events belong to (default: 50)")
    p.add_argument("--rate", type=float, default=500.0, help="events written per second (default: 500)")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as exc:
        print(f"outboxpg: {exc}", file=sys.stderr)
        return exc.code
    except psycopg.OperationalError as exc:
        print(f"outboxpg: {_describe_connection_error(exc)}", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"outboxpg: database error: {first}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
