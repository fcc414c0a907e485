"""Where PostgreSQL's time goes in a drain, statement by statement, the functions' inner
statements included.

    .venv/bin/python bench/pg_profile.py                          # 200,000 events over 50,000 aggregates
    .venv/bin/python bench/pg_profile.py --events 20000 --aggregates 200 --batch 500
    .venv/bin/python bench/pg_profile.py --shard 0/8                  # the claims of one shard
    .venv/bin/python bench/pg_profile.py --past-days 8                # a week's partitions kept, as in production
    .venv/bin/python bench/pg_profile.py --app-locks 80               # 80 application transactions in flight

A throwaway cluster of its own (outboxpg.embedded.EmbeddedPostgres, the tests' settings) with
pg_stat_statements loaded (track = all: the statements inside the PL/pgSQL functions count
apart) and track_functions = all; the current schema installed; the events inserted
server-side, VACUUM ANALYZE; then one connection claims `--batch` and completes what it got
(with the events' created_at range, as the worker does) until a claim comes back empty (the
database side of a worker, no broker). With `--shard I/N` shards are enabled and the claims
are that shard's (`outbox_claim(..., shard => 'I/N')`): its events are drained, the other
shards' stay, and the figures per event are of the shard's events.
With `--past-days N`, N daily partitions before today's are made first, named and bounded as
outbox_maintain makes them (a new install has today's, 3 ahead and the default; the default
`retention` of 7 days keeps about 8 more), empty: what their number costs the claims and reports.
With `--detach-empty`, every partition without a row is detached before the drain (the 3 ahead
and the default of a new install, and --past-days' ones): the scans of one partition, what a
claim and a report would cost if their plans pruned every partition but the events'.
With `--app-locks N`, N other sessions each hold a transaction open with locks on 60 tables of
their own (none of outbox's) through the drain: an application's transactions in flight, in the
lock table that anything reading pg_locks scans.
Printed: the rate, and the statements and functions by total execution time, each also in µs
per event. The cluster is stopped and removed at the end (also on Ctrl-C). pg_stat_statements
costs time of its own: the rate is lower than without it; the shares are what this is for.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from outboxpg.embedded import EmbeddedPostgres  # noqa: E402
from outboxpg.schema import migrate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--aggregates", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=500, help="outbox_claim's batch_size (default 500, the worker's)")
    ap.add_argument("--shard", default=None, metavar="I/N", help="claim shard I of N only (shards enabled)")
    ap.add_argument("--past-days", type=int, default=0, metavar="N",
                    help="N empty daily partitions before today's, as a week's retention keeps them (default 0)")
    ap.add_argument("--detach-empty", action="store_true",
                    help="detach every partition without a row before the drain (what pruning could save)")
    ap.add_argument("--app-locks", type=int, default=0, metavar="N",
                    help="N other sessions holding 60 table locks each in an open transaction (default 0)")
    ap.add_argument("--top", type=int, default=20, help="statements shown (default 20)")
    args = ap.parse_args()
    if args.shard is not None and not ((m := re.fullmatch(r"(\d+)/(\d+)", args.shard))
                                       and int(m[1]) < int(m[2]) <= 64):
        ap.error(f"--shard: I/N with 0 <= I < N <= 64, got {args.shard!r}")
    if args.past_days < 0 or not 0 <= args.app_locks <= 150:
        ap.error("--past-days: 0 or more; --app-locks: 0 to 150 (the cluster takes 200 connections)")
    if args.events < 1 or args.aggregates < 1 or args.batch < 1:
        ap.error("--events, --aggregates and --batch must be 1 or more")
    settings = {"shared_preload_libraries": "pg_stat_statements", "pg_stat_statements.track": "all",
                "pg_stat_statements.max": "10000", "track_functions": "all"}
    with EmbeddedPostgres(settings=settings) as pg, psycopg.connect(pg.dsn, autocommit=True) as c:
        migrate(pg.dsn)
        c.execute("CREATE EXTENSION pg_stat_statements")
        today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
        for day in range(1, args.past_days + 1):
            lo = today - timedelta(days=day)
            c.execute(sql.SQL("CREATE TABLE {} PARTITION OF outbox FOR VALUES FROM ({}) TO ({})").format(
                sql.Identifier(f"outbox_p{lo:%Y%m%dT%H%M%S}"), sql.Literal(lo), sql.Literal(lo + timedelta(days=1))))
        c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                  "SELECT 'order', 'a' || (g %% %s), 'e', jsonb_build_object('n', g) "
                  "FROM generate_series(1, %s) g", (args.aggregates, args.events))
        if args.detach_empty:
            empty = c.execute("SELECT p.inhrelid::regclass::text FROM pg_inherits p "
                              "WHERE p.inhparent = 'outbox'::regclass "
                              "AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.tableoid = p.inhrelid)").fetchall()
            for (name,) in empty:
                c.execute(sql.SQL("ALTER TABLE outbox DETACH PARTITION {}").format(sql.SQL(name)))
        if args.shard:
            c.execute("SELECT outbox_shards_enable()")
        c.execute("VACUUM ANALYZE")
        holders = []
        if args.app_locks:
            tables = [f"app_table_{t}" for t in range(60)]
            for t in tables:
                c.execute(sql.SQL("CREATE TABLE {} (id integer)").format(sql.Identifier(t)))
            for _ in range(args.app_locks):
                h = psycopg.connect(pg.dsn)
                h.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
                    sql.SQL(", ").join(sql.Identifier(t) for t in tables)))
                holders.append(h)
        c.execute("SELECT pg_stat_statements_reset()")
        c.execute("SELECT pg_stat_reset()")
        n = claims = 0
        t0 = time.perf_counter()
        while True:
            rows = c.execute("SELECT id, lease_token, created_at FROM outbox_claim(%s, shard => %s)",
                             (args.batch, args.shard)).fetchall()
            claims += 1
            if not rows:
                break
            n += len(rows)
            # As the worker reports: with the events' created_at range (their partitions only).
            c.execute("SELECT outbox_complete(%s::bigint[], %s, %s, %s)",
                      ([r[0] for r in rows], rows[0][1], min(r[2] for r in rows), max(r[2] for r in rows)))
        seconds = time.perf_counter() - t0
        for h in holders:
            h.close()
        row = c.execute("SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox'::regclass").fetchone()
        parts = row[0] if row else 0
        print(f"{n:,} events over {args.aggregates:,} aggregates in {seconds:.2f} s ({n / seconds:,.0f} events/s), "
              f"{claims} claims of up to {args.batch}{f' by shard {args.shard}' if args.shard else ''}; "
              f"{parts} partitions; {args.app_locks} sessions holding locks; PostgreSQL {c.info.server_version // 10000}")
        print(f"\n{'ms':>9} {'µs/event':>9} {'calls':>7} {'rows':>8}  statement")
        for ms, calls, nrows, query in c.execute(
                "SELECT total_exec_time, calls, rows, query FROM pg_stat_statements "
                "WHERE query NOT LIKE '%%pg_stat_statements%%' ORDER BY total_exec_time DESC LIMIT %s", (args.top,)):
            text = re.sub(r"\s+", " ", re.sub(r"--[^\n]*", "", query)).strip()
            print(f"{ms:9.1f} {ms * 1000 / max(n, 1):9.2f} {calls:7} {nrows:8}  {text[:110]}")
        print(f"\n{'self ms':>9} {'µs/event':>9} {'calls':>7}  function (time in its own statements)")
        for name, calls, self_ms in c.execute(
                "SELECT funcname, calls, self_time FROM pg_stat_user_functions WHERE calls > 0 "
                "ORDER BY self_time DESC LIMIT 10"):
            print(f"{self_ms:9.1f} {self_ms * 1000 / max(n, 1):9.2f} {calls:7}  {name}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
