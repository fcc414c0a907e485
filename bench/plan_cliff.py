#!/usr/bin/env python3
"""Regression check for a cached-plan cliff in outbox_claim / outbox_complete (see BENCHMARKS.md).

    .venv/bin/python bench/plan_cliff.py [--dsn ...] [--events 200000]

outbox_claim and outbox_complete run with plan_cache_mode = force_generic_plan: each session
plans their statements once, with the table statistics of that moment, and keeps the plans.
Before the plan shape was pinned (enable_seqscan = off, ... on the functions, migrations 0005
and 0006), a worker that started while the outbox was (nearly) empty kept plans made for a tiny
table, and after a burst they scanned the whole unfinished index for every candidate: seconds
per claim. Both rows of the output should now be alike.

The scenario: one worker session claims and completes a dozen single events as they arrive
(the outbox holding a few rows), then a burst of --events events lands, and the same session
claims batches of 100. It is run twice: on a never-analysed table and on one analysed while
empty (autovacuum would do that), for the installed functions and, for comparison, for copies
of them that pin the plan shape (``*_pinned``: no seq/bitmap scans, no hash/merge joins, no
materialisation, no JIT, and no ``state = 'pending'`` re-check in the claim's UPDATE, so that
only the primary key can find the rows). It creates and drops its own database.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from outboxpg import schema  # noqa: E402

PIN = ("SET enable_seqscan TO 'off'", "SET enable_bitmapscan TO 'off'", "SET enable_hashjoin TO 'off'",
       "SET enable_mergejoin TO 'off'", "SET enable_material TO 'off'", "SET jit TO 'off'")


def pinned_copy(conn: psycopg.Connection[Any], signature: str, name: str, new: str) -> bool:
    """Create <new> from the definition of <signature> with the plan shape pinned."""
    src = conn.execute("SELECT pg_get_functiondef(%s::regprocedure)", (signature,)).fetchone()[0]
    head, sep, body = src.partition("AS $function$")
    if not sep or " SET search_path TO " not in head:
        return False
    head = head.replace(f"FUNCTION public.{name}(", f"FUNCTION public.{new}(")
    head = head.replace(" SET search_path TO ", "".join(f" {p}\n" for p in PIN) + " SET search_path TO ", 1)
    body = body.replace(f"{name}.lease_token", f"{new}.lease_token")
    # The candidates are locked by this transaction already: the re-check adds nothing but lets
    # the planner pick a partial index scanned end to end.
    body = body.replace("           AND o.created_at BETWEEN oldest AND newest\n           AND o.state = 'pending'\n",
                        "           AND o.created_at BETWEEN oldest AND newest\n")
    conn.execute(head + sep + body)
    return True


def scenario(dsn: str, claim: str, complete: str, analyze_empty: bool, events: int) -> tuple[float, float]:
    with psycopg.connect(dsn, autocommit=True) as adm, psycopg.connect(dsn, autocommit=True) as w:
        adm.execute("TRUNCATE outbox")
        if analyze_empty:
            adm.execute("VACUUM ANALYZE outbox")
        for i in range(12):   # the worker's life while the outbox holds a few rows
            adm.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                        "VALUES ('order', %s, 'created', '{}')", (str(i),))
            rows = w.execute(f"SELECT id, lease_token FROM {claim}(100)").fetchall()
            w.execute(f"SELECT {complete}(%s, %s)", ([r[0] for r in rows], rows[0][1]))
        adm.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                    "SELECT 'order', (i %% 50000)::text, 'created', '{\"n\":1}' "
                    "FROM generate_series(1, %s) AS i", (events,))
        tc = tk = 0.0
        calls = 5
        for _ in range(calls):
            t0 = time.perf_counter()
            rows = w.execute(f"SELECT id, lease_token FROM {claim}(100)").fetchall()
            t1 = time.perf_counter()
            w.execute(f"SELECT {complete}(%s, %s)", ([r[0] for r in rows], rows[0][1]))
            tk += time.perf_counter() - t1
            tc += t1 - t0
        return 1000 * tc / calls, 1000 * tk / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN",
                                                    "host=127.0.0.1 port=5432 user=postgres dbname=postgres"))
    ap.add_argument("--events", type=int, default=200_000)
    args = ap.parse_args()
    dbname = f"outboxpg_cliff_{os.getpid()}"
    dsn = make_conninfo(args.dsn, dbname=dbname)
    with psycopg.connect(args.dsn, autocommit=True) as server:
        server.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        schema.migrate(dsn)
        pairs = [("outbox_claim", "outbox_complete")]
        with psycopg.connect(dsn, autocommit=True) as c:
            if (pinned_copy(c, "outbox_claim(integer,interval,text,bigint,text)", "outbox_claim", "outbox_claim_pinned")
                    and pinned_copy(c, "outbox_complete(bigint[],uuid)", "outbox_complete", "outbox_complete_pinned")):
                pairs.append(("outbox_claim_pinned", "outbox_complete_pinned"))
        print(f"claim(100) and complete after a burst of {args.events} events, in a worker session that "
              "started on a near-empty outbox (mean of 5 calls)")
        for claim, complete in pairs:
            for analyze_empty in (False, True):
                tc, tk = scenario(dsn, claim, complete, analyze_empty, args.events)
                stats = "analysed while empty" if analyze_empty else "never analysed     "
                print(f"  {claim:<20} table {stats}: claim {tc:9.1f} ms, complete {tk:7.1f} ms")
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as server:
            server.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
