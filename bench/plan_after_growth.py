"""A claim planned while the outbox is small, timed once a backlog has come.

    .venv/bin/python bench/plan_after_growth.py                      # 200,000 events over 50,000 aggregates
    .venv/bin/python bench/plan_after_growth.py --events 50000 --server "host=127.0.0.1 user=postgres"

outbox_claim and outbox_complete keep their plans for the session (generic plans), made with the
table as it was when each statement first ran. Three sessions, each on a database of its own
(outboxpg_bench_growth_<pid>_<n>, created, migrated and dropped here):

  small     claims and completes three single events while the outbox holds only those;
  warm-up   calls outbox_warm_up() on the empty outbox (skipped where the schema has none);
  cold      connects after the burst.

Then --events events land over --aggregates aggregates (one INSERT ... SELECT, no ANALYZE: a
session's plans outlive the burst until an ANALYZE of the partition), and each session claims
500 and completes them, --claims times. Printed: the first claim's wall time (it takes the
burst's newest aggregates in) and the median of the others.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from outboxpg.schema import migrate  # noqa: E402

CLAIM = "SELECT id, lease_token FROM outbox_claim(500, NULL, 'bench', NULL, NULL)"


def claims(session: psycopg.Connection[Any], count: int) -> list[float]:
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        rows = session.execute(CLAIM).fetchall()
        times.append((time.perf_counter() - t0) * 1000)
        session.execute("SELECT outbox_complete(%s, %s)", ([r[0] for r in rows], rows[0][1]))
    return times


def case(server: str, name: str, how: str, events: int, aggregates: int, count: int) -> str:
    dsn = make_conninfo(server, dbname=name)
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as writer:
            session = psycopg.connect(dsn, autocommit=True) if how != "cold" else None
            if how == "small":
                for i in range(3):
                    writer.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                                   "VALUES ('small', %s, 'e', '{}')", (str(i),))
                    claims(session, 1)  # type: ignore[arg-type]
            elif how == "warm-up":
                if writer.execute("SELECT to_regprocedure('outbox_warm_up(text)')").fetchone()[0] is None:  # type: ignore[index]
                    session.close()  # type: ignore[union-attr]
                    return f"  {how:<8} (no outbox_warm_up in this schema)"
                session.execute("SELECT outbox_warm_up()")  # type: ignore[union-attr]
            writer.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                           "SELECT 'acct', 'a' || (g %% %s), 'e', '{\"n\": 1}' FROM generate_series(1, %s) g",
                           (aggregates, events))
            session = session or psycopg.connect(dsn, autocommit=True)
            with session:
                times = claims(session, count)
        return (f"  {how:<8} first claim {times[0]:7.1f} ms, then median {statistics.median(times[1:]):7.1f} ms "
                f"(min {min(times[1:]):.1f}, max {max(times[1:]):.1f}) per claim of 500")
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="host=127.0.0.1 user=postgres", help="a libpq string without a database")
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--aggregates", type=int, default=50_000)
    ap.add_argument("--claims", type=int, default=8)
    args = ap.parse_args()
    print(f"claims of 500 after {args.events:,} events over {args.aggregates:,} aggregates landed "
          f"(load average {os.getloadavg()[0]:.1f})")
    for n, how in enumerate(("small", "warm-up", "cold")):
        print(case(args.server, f"outboxpg_bench_growth_{os.getpid()}_{n}", how, args.events, args.aggregates,
                   args.claims), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
