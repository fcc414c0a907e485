"""Issue 12, item 1: the claim's candidate shapes, measured against each other in one run.

    .venv/bin/python bench/claim_candidates.py --dsn "host=127.0.0.1 port=5499 user=postgres dbname=postgres"

outboxpg's claim keeps a table of per-aggregate heads (outbox_heads: made by the claims' intake,
moved by the reports; due heads read off an index on ready_at). The two other shapes the issue
names, built here as prototypes beside it in the same throwaway database:

  skip scan   no heads table: a claim walks outbox_unfinished_by_aggregate_idx one aggregate at a
              time (a recursive CTE: the next aggregate's first unfinished event, one index descent
              each) and takes the first events that are pending and due, one per aggregate; a
              report is a plain UPDATE. Favourable to it: no runs, no commit-order guard, one
              claimer (no locking), nothing done for heads at report time.
  trigger     heads kept by the producers: an AFTER INSERT row trigger on outbox upserts the
              aggregate's head (INSERT ... ON CONFLICT DO NOTHING). Only its producer cost is
              measured; the claim side would be outboxpg's.

Measured (SQL only, no worker, no NATS):
  A  claim(100) time when K aggregates are blocked in front of the 100 claimable ones (in the
     skip scan's key order): blocked by a dead letter, by a retry backoff, by a run in flight;
     K = 0, 1,000, 10,000, 50,000. median / max of 15 calls, each followed by the report of what
     it took.
  B  server CPU per event of a claim(500) -> complete loop draining 100,000 events over 25,000
     aggregates (the uniform mix), and 100,000 over 10 (the skewed one): backend time per event,
     from pg_stat_statements when installed, else the client's wall time per event.
  C  producer INSERT, one event per transaction: pgbench at 1 / 8 / 32 clients, with and without
     the trigger candidate, alternated, best of 2, 100,000 random aggregates; and a second
     producer writing a new aggregate while the first one's transaction that made its head is
     still open (held 2 s): how long the second one waits.

Bounded: every phase has a statement_timeout; the run drops its database at the end (also on
Ctrl-C). About 4-6 minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sql_core import run_pgbench  # noqa: E402  (bench/, beside this file: one pgbench runner)

from outboxpg import schema  # noqa: E402

PROTOTYPES = """
CREATE FUNCTION cand_skip_claim(n integer, lease interval DEFAULT '30 seconds') RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    t   timestamptz := clock_timestamp();
    ids bigint[];
BEGIN
    WITH RECURSIVE aggs AS (
        (SELECT o.aggregate_type, o.aggregate_id, o.id, o.state, o.next_attempt_at, o.locked_until
           FROM outbox o
          WHERE o.unfinished
          ORDER BY o.aggregate_type, o.aggregate_id, o.id
          LIMIT 1)
        UNION ALL
        SELECT nx.*
          FROM aggs a
         CROSS JOIN LATERAL (
               SELECT o.aggregate_type, o.aggregate_id, o.id, o.state, o.next_attempt_at, o.locked_until
                 FROM outbox o
                WHERE o.unfinished
                  AND (o.aggregate_type, o.aggregate_id) > (a.aggregate_type, a.aggregate_id)
                ORDER BY o.aggregate_type, o.aggregate_id, o.id
                LIMIT 1) nx)
    SELECT array_agg(a.id) INTO ids
      FROM (SELECT aggs.id FROM aggs
             WHERE aggs.state = 'pending' AND aggs.next_attempt_at <= t
             LIMIT n) a;
    RETURN QUERY
    UPDATE outbox o
       SET state = 'processing', attempts = o.attempts + 1, claimed_at = t,
           locked_until = t + lease, lease_token = gen_random_uuid()
     WHERE o.id = ANY (ids) AND o.state = 'pending'
    RETURNING o.id;
END;
$$;

CREATE FUNCTION cand_skip_complete(ids bigint[]) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE n integer;
BEGIN
    UPDATE outbox o
       SET state = 'published', published_at = clock_timestamp(), locked_until = NULL, lease_token = NULL
     WHERE o.id = ANY (ids) AND o.state = 'processing';
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END;
$$;

CREATE TABLE cand_heads (
    aggregate_type text COLLATE "C" NOT NULL,
    aggregate_id   text COLLATE "C" NOT NULL,
    head_id        bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
) WITH (fillfactor = 50);

CREATE FUNCTION cand_heads_upsert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO cand_heads (aggregate_type, aggregate_id, head_id)
    VALUES (NEW.aggregate_type, NEW.aggregate_id, NEW.id)
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END;
$$;
"""

TRIGGER_ON = ("CREATE TRIGGER cand_heads_trigger AFTER INSERT ON outbox "
              "FOR EACH ROW EXECUTE FUNCTION cand_heads_upsert()")
TRIGGER_OFF = "DROP TRIGGER IF EXISTS cand_heads_trigger ON outbox"

BLOCKERS = ("dead letter", "retry backoff", "run in flight")


def log(msg: str) -> None:
    print(msg, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.admin_dsn = args.dsn
        self.dbname = f"outboxpg_candidates_{os.getpid()}"
        self.dsn = make_conninfo(args.dsn, dbname=self.dbname)
        self.pss = False
        self.created = False

    def admin(self, stmt: Any, params: Any = None) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as c:
            c.execute(stmt, params)

    def setup(self) -> None:
        self.admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))
        self.created = True
        schema.migrate(self.dsn)
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute(PROTOTYPES)
            try:
                c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                c.execute("SELECT pg_stat_statements_reset()")
                self.pss = True
            except psycopg.Error:
                self.pss = False

    def drop(self) -> None:
        if not self.created:
            return
        self.admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.dbname)))

    def conn(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, options="-c statement_timeout=120s")

    def reset(self, c: psycopg.Connection[Any]) -> None:
        c.execute("TRUNCATE outbox, cand_heads")
        c.execute("SELECT setval('outbox_heads_floor_us', 1, false)")

    # --- A: claim(100) behind K blocked aggregates -------------------------------------------------
    def fill_blocked(self, c: psycopg.Connection[Any], k: int, blocker: str) -> None:
        """K blocked aggregates (keys 'b00000'.. sort before the claimable 'z...'), each with one
        event in the blocking state and one pending behind it; 100 x 20 claimable events of
        aggregates 'z000'..'z099'. The blocked ones are made claimable first and moved into their
        state through outboxpg's own functions, so outbox_heads is what the real claim would have."""
        self.reset(c)
        if k:
            c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                      "SELECT 'order', 'b' || lpad(g::text, 6, '0'), 'created', '{}' "
                      "FROM generate_series(1, %s) g, generate_series(1, 2) r ORDER BY r, g", (k,))
            # The first event of each blocked aggregate: claimed by the real claim (heads made),
            # then put into the blocking state.
            done = 0
            while done < k:
                rows = c.execute("SELECT id, lease_token FROM outbox_claim(%s, '1 hour')",
                                 (min(5000, k - done),)).fetchall()
                if not rows:
                    break
                ids = [r[0] for r in rows]
                token = rows[0][1]
                if blocker in ("dead letter", "retry backoff"):
                    if blocker == "retry backoff":
                        c.execute("UPDATE outbox_settings SET backoff_base = '1 hour', backoff_cap = '1 hour'")
                    c.execute("SELECT count(outbox_fail(i, %s, 'bench', %s)) FROM unnest(%s::bigint[]) i",
                              (token, blocker == "dead letter", ids))
                done += len(ids)
        c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                  "SELECT 'order', 'z' || lpad(g::text, 3, '0'), 'created', '{}' "
                  "FROM generate_series(0, 99) g, generate_series(1, 20) r ORDER BY r, g")
        c.execute("VACUUM ANALYZE outbox")
        c.execute("VACUUM ANALYZE outbox_heads")

    def time_claims(self, c: psycopg.Connection[Any], which: str, calls: int = 15) -> tuple[float, float, int]:
        times: list[float] = []
        got = 0
        for _ in range(calls):
            t0 = time.perf_counter()
            if which == "outboxpg":
                rows = c.execute("SELECT id, lease_token FROM outbox_claim(100)").fetchall()
            else:
                rows = c.execute("SELECT * FROM cand_skip_claim(100)").fetchall()
            times.append((time.perf_counter() - t0) * 1000)
            got += len(rows)
            if rows:
                ids = [r[0] for r in rows]
                if which == "outboxpg":
                    c.execute("SELECT outbox_complete(%s::bigint[], %s)", (ids, rows[0][1]))
                else:
                    c.execute("SELECT cand_skip_complete(%s::bigint[])", (ids,))
        return statistics.median(times), max(times), got

    def phase_a(self) -> None:
        log("A. claim(100) with K aggregates blocked in front of 100 claimable ones; median / max ms "
            "of 15 calls (events handed out in all)")
        with self.conn() as c:
            for blocker in BLOCKERS:
                for k in self.args.blocked:
                    line = f"  {blocker:<14} K={k:>6,}"
                    for which in ("outboxpg", "skip scan"):
                        c.execute("UPDATE outbox_settings SET backoff_base = DEFAULT, backoff_cap = DEFAULT")
                        self.fill_blocked(c, k, blocker)
                        med, mx, got = self.time_claims(c, which)
                        line += f"   {which:<9} {med:9.2f} / {mx:9.2f} ms ({got:>5})"
                    log(line)
            c.execute("UPDATE outbox_settings SET backoff_base = DEFAULT, backoff_cap = DEFAULT")

    # --- B: server CPU per event of a drain loop -----------------------------------------------------
    def backend_ms(self, c: psycopg.Connection[Any]) -> float:
        if not self.pss:
            return 0.0
        row = c.execute("SELECT coalesce(sum(total_exec_time), 0) FROM pg_stat_statements "
                        "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                        "AND toplevel").fetchone()
        return float(row[0]) if row else 0.0

    def drain(self, c: psycopg.Connection[Any], which: str) -> tuple[float, float, int]:
        b0, t0, n = self.backend_ms(c), time.perf_counter(), 0
        while True:
            if which == "outboxpg":
                rows = c.execute("SELECT id, lease_token FROM outbox_claim(500)").fetchall()
                if not rows:
                    break
                c.execute("SELECT outbox_complete(%s::bigint[], %s)", ([r[0] for r in rows], rows[0][1]))
            else:
                rows = c.execute("SELECT * FROM cand_skip_claim(500)").fetchall()
                if not rows:
                    break
                c.execute("SELECT cand_skip_complete(%s::bigint[])", ([r[0] for r in rows],))
            n += len(rows)
        wall = (time.perf_counter() - t0) * 1e6 / max(n, 1)
        server = (self.backend_ms(c) - b0) * 1000 / max(n, 1)
        return wall, server, n

    def phase_b(self) -> None:
        log("B. claim(500) -> complete loop, one claimer, until the claim comes back empty; "
            "µs per event: wall (client) / backend (pg_stat_statements)")
        with self.conn() as c:
            for events, aggregates in ((100_000, 25_000), (100_000, 10)):
                line = f"  {events:,} over {aggregates:,}"
                for which in ("outboxpg", "skip scan"):
                    self.reset(c)
                    c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                              "SELECT 'order', (g %% %s)::text, 'created', '{}' FROM generate_series(1, %s) g",
                              (aggregates, events))
                    c.execute("VACUUM ANALYZE outbox")
                    wall, server, n = self.drain(c, which)
                    srv = f"{server:6.1f}" if self.pss else "     -"
                    line += f"   {which:<9} {wall:7.1f} / {srv} µs/ev ({n:,})"
                log(line)

    # --- C: producer cost --------------------------------------------------------------------------
    def pgbench(self, clients: int) -> float:
        tps, _, _ = run_pgbench(self.args.pgbench, self.dsn, clients, self.args.insert_seconds)
        return tps

    def phase_c(self) -> None:
        log(f"C. producer INSERT, one event per transaction (pgbench -T {self.args.insert_seconds}, 100,000 "
            "random aggregates), without and with the trigger candidate, alternated, best of 2")
        with self.conn() as c:
            for clients in (1, 8, 32):
                best = {"without": 0.0, "with": 0.0}
                for _ in range(2):
                    for side in ("without", "with"):
                        self.reset(c)
                        c.execute(TRIGGER_ON if side == "with" else TRIGGER_OFF)
                        best[side] = max(best[side], self.pgbench(clients))
                c.execute(TRIGGER_OFF)
                diff = (best["with"] / best["without"] - 1) * 100 if best["without"] else 0.0
                log(f"  {clients:>2} clients: outboxpg {best['without']:9,.0f} tx/s   with the trigger "
                    f"{best['with']:9,.0f} tx/s   {diff:+.1f} %")
            for side in ("without", "with"):
                self.reset(c)
                c.execute(TRIGGER_ON if side == "with" else TRIGGER_OFF)
                waited = self.second_producer_wait()
                log(f"  a second producer of a new aggregate while the first's transaction is open 2 s, "
                    f"{side} the trigger: its INSERT took {waited:,.1f} ms")
            c.execute(TRIGGER_OFF)

    def second_producer_wait(self) -> float:
        started = threading.Event()

        def first() -> None:
            with psycopg.connect(self.dsn) as c1:
                c1.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                           "VALUES ('order', 'brand-new', 'created', '{}')")
                started.set()
                time.sleep(2)
                c1.commit()
        th = threading.Thread(target=first)
        th.start()
        started.wait(10)
        time.sleep(0.1)
        with psycopg.connect(self.dsn, autocommit=True, options="-c statement_timeout=30s") as c2:
            t0 = time.perf_counter()
            c2.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                       "VALUES ('order', 'brand-new', 'created', '{}')")
            waited = (time.perf_counter() - t0) * 1000
        th.join()
        return waited


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN",
                                                    "host=127.0.0.1 port=5432 user=postgres dbname=postgres"),
                    help="a superuser connection (CREATE/DROP DATABASE)")
    ap.add_argument("--only", default="A,B,C", help="phases: A, B, C (comma-separated)")
    ap.add_argument("--blocked", default="0,1000,10000,50000",
                    help="K, the blocked aggregates in phase A (comma-separated)")
    ap.add_argument("--insert-seconds", type=int, default=6)
    ap.add_argument("--pgbench", default=os.environ.get("PGBENCH") or shutil.which("pgbench") or "pgbench")
    args = ap.parse_args()
    try:
        args.blocked = [int(x) for x in args.blocked.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--blocked: comma-separated integers, got {args.blocked!r}")
    phases = {p.strip().upper() for p in args.only.split(",") if p.strip()}
    if not phases <= {"A", "B", "C"}:
        ap.error(f"--only: A, B or C, got {args.only!r}")
    b = Bench(args)
    t0 = time.monotonic()
    try:
        b.setup()
        with psycopg.connect(args.dsn) as c:
            ver = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        log(f"outboxpg claim candidates (issue 12), {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; "
            f"{os.cpu_count()} cpus; PostgreSQL {ver}; database {b.dbname}; "
            f"pg_stat_statements {'on' if b.pss else 'off (backend time not shown)'}")
        for p, run in (("A", b.phase_a), ("B", b.phase_b), ("C", b.phase_c)):
            if p in phases:
                t = time.monotonic()
                run()
                log(f"  ({time.monotonic() - t:.0f} s)")
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except (psycopg.Error, subprocess.SubprocessError, OSError, RuntimeError) as e:
        log(f"claim_candidates: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e}")
        return 1
    finally:
        try:
            b.drop()
        except psycopg.Error as e:
            log(f"claim_candidates: could not drop database {b.dbname}: {e}")
    log(f"total {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
