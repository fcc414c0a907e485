"""A new connection's first outbox_claim: what a client that connects per job pays (other
languages, a pooler handing out new server connections), against the same claim once warm.

    .venv/bin/python bench/first_claim.py                 # 30 samples of each case
    .venv/bin/python bench/first_claim.py --samples 60 --dsn "host=127.0.0.1 user=postgres dbname=postgres"

Installs the schema (outboxpg migrate) into a throwaway database, then for each case connects
anew for every sample and times `SELECT count(*) FROM outbox_claim(50)` in a transaction that
is rolled back (so every sample finds the same state). Besides the wall time it reads the
backend's own CPU time for the statement (log_statement_stats: user + system, reported back to
the client as a LOG notice), which other processes on a loaded machine do not inflate. Cases:
an empty table; 1,000 pending events over 100 aggregates (the intake takes them in, the claim
hands out 50); outbox_warm_up() on a new connection with those events pending, and the first
claim after it; and the same claim on a warm connection. The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
CLAIM = "SELECT count(*) FROM outbox_claim(50)"
_CPU = re.compile(r"!\s+([\d.]+) s user, ([\d.]+) s system")


def timed(conn: psycopg.Connection[Any], statement: str = CLAIM) -> tuple[float, float]:
    """(wall ms, backend CPU ms) of one claim (or ``statement``), rolled back."""
    notes: list[str] = []
    conn.add_notice_handler(lambda d: notes.append(d.message_detail or ""))
    conn.execute("SET log_statement_stats = on")
    conn.execute("SET client_min_messages = log")
    notes.clear()
    t0 = time.perf_counter()
    conn.execute(statement).fetchone()
    wall = (time.perf_counter() - t0) * 1000
    conn.rollback()
    cpu = [float(m.group(1)) + float(m.group(2)) for n in notes if (m := _CPU.search(n))]
    return wall, (cpu[-1] * 1000 if cpu else float("nan"))


def first(dsn: str) -> tuple[float, float]:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")       # the connection's own start-up is not the claim's
        return timed(conn)


def after_warm_up(dsn: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """On a new connection: outbox_warm_up() itself, then the first claim."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1")
        warm_up = timed(conn, "SELECT outbox_warm_up()")   # undone by itself: the rollback changes nothing
        return warm_up, timed(conn)


def report(label: str, samples: list[tuple[float, float]]) -> None:
    wall = [s[0] for s in samples]
    cpu = [s[1] for s in samples]
    print(f"  {label:<44} wall median {statistics.median(wall):6.2f} ms (min {min(wall):6.2f}); "
          f"backend CPU median {statistics.median(cpu):6.2f} ms (min {min(cpu):6.2f}) [{len(samples)}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN",
                                                    "host=127.0.0.1 port=5432 user=postgres dbname=postgres"))
    ap.add_argument("--samples", type=int, default=30)
    args = ap.parse_args()
    name = f"outboxpg_first_claim_{os.getpid()}"
    dsn = make_conninfo(args.dsn, dbname=name)
    with psycopg.connect(args.dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        subprocess.run([str(Path(sys.executable).parent / "outboxpg"), "migrate", "--dsn", dsn],
                       check=True, capture_output=True, cwd=ROOT)
        print(f"first outbox_claim(50) on a new connection, {args.samples} samples each "
              f"(load average {os.getloadavg()[0]:.1f})")
        report("empty table", [first(dsn) for _ in range(args.samples)])
        with psycopg.connect(dsn) as conn:
            conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                         "SELECT 'order', (i % 100)::text, 'created', '{}' FROM generate_series(1, 1000) i")
            conn.commit()
        report("1,000 pending over 100 aggregates", [first(dsn) for _ in range(args.samples)])
        pairs = [after_warm_up(dsn) for _ in range(args.samples)]
        report("the same, outbox_warm_up() itself", [p[0] for p in pairs])
        report("the same, the first claim after it", [p[1] for p in pairs])
        with psycopg.connect(dsn) as conn:
            timed(conn)
            report("the same, warm connection", [timed(conn) for _ in range(args.samples)])
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


if __name__ == "__main__":
    sys.exit(main())
