"""Retention soak: does the outbox stay small while events flow through it?

    .venv/bin/python bench/retention_soak.py                # 1,000,000 events
    .venv/bin/python bench/retention_soak.py --events 200000

Partitions are made short (--width, default 15 s, retention = one width) so that a few minutes
of traffic cross many of them. Producers write events in batches (COPY); one outboxpg-worker
process delivers them to NATS JetStream and runs outbox_maintain() every few seconds. Every
10 s the run prints the outbox's on-disk size (all partitions, pg_total_relation_size), how many
partitions exist, and the backlog. At the end: size before, peak and after, partitions dropped,
and dead tuples left in the partitions that remain.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import psycopg
from nats.js.api import StreamConfig
from psycopg.conninfo import make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from outboxpg import Event, enqueue_many, schema  # noqa: E402

WORKER = str(Path(sys.executable).parent / "outboxpg-worker")
SIZE = ("SELECT (coalesce(sum(pg_total_relation_size(inhrelid)), 0) + pg_total_relation_size('outbox'))::float8, count(*) "
        "FROM pg_inherits WHERE inhparent = 'outbox'::regclass")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres"))
    ap.add_argument("--nats-url", default=os.environ.get("OUTBOXPG_BENCH_NATS", "nats://127.0.0.1:4222"))
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--rate", type=int, default=6000, help="events written per second")
    ap.add_argument("--width", type=int, default=15, help="partition width and retention, seconds")
    args = ap.parse_args()

    tag = str(os.getpid())
    dbname = f"outboxpg_soak_{tag}"
    dsn = make_conninfo(args.dsn, dbname=dbname)
    with psycopg.connect(args.dsn, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{dbname}"')
    worker = None
    try:
        schema.migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("UPDATE outbox_settings SET partition_width = make_interval(secs => %s), "
                      "retention = make_interval(secs => %s), partitions_ahead = 4, subject_prefix = %s",
                      (args.width, args.width, f"soak{tag}"))
            # The install made daily partitions; they are empty: replace them with short ones.
            for (name,) in c.execute("SELECT partition FROM outbox_partitions WHERE NOT is_default").fetchall():
                c.execute(f'DROP TABLE "{name}"')
            c.execute("SELECT * FROM outbox_maintain()")
            size0, parts0 = c.execute(SIZE).fetchone()  # type: ignore[misc]

        async def stream(op: str) -> None:
            nc = await nats.connect(args.nats_url)
            js = nc.jetstream()
            if op == "add":
                await js.add_stream(StreamConfig(name=f"SOAK{tag}", subjects=[f"soak{tag}.>"], max_msgs=100_000))
            else:
                await js.delete_stream(f"SOAK{tag}")
            await nc.close()
        asyncio.run(stream("add"))

        worker = subprocess.Popen([WORKER, "--dsn", dsn, "--nats-url", args.nats_url, "--maintenance-interval", "3",
                                   "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"outboxpg retention soak {time.strftime('%Y-%m-%d %H:%M:%S')}: {args.events} events at ~{args.rate}/s, "
              f"partition width = retention = {args.width}s; start size {size0 / 1e6:.1f} MB in {parts0} partitions",
              flush=True)
        peak = size0
        written = 0
        dropped_seen: set[str] = set()
        t0 = time.monotonic()
        last_report = t0
        chunk = 2000
        with psycopg.connect(dsn) as prod, psycopg.connect(dsn, autocommit=True) as mon:
            def sample(final: bool = False) -> None:
                nonlocal peak
                size, parts = mon.execute(SIZE).fetchone()  # type: ignore[misc]
                backlog = mon.execute("SELECT count(*) FROM outbox WHERE state IN ('pending','processing')").fetchone()[0]  # type: ignore[index]
                names = {r[0] for r in mon.execute("SELECT relname FROM pg_class WHERE relname LIKE 'outbox_p%%' "
                                                   "AND relkind = 'r'").fetchall()}
                dropped_seen.update(all_names - names)
                all_names.update(names)
                peak = max(peak, size)
                print(f"  t={time.monotonic() - t0:6.1f}s written {written:8d} backlog {backlog:7d} "
                      f"size {size / 1e6:7.1f} MB partitions {parts:3d} dropped so far {len(dropped_seen):3d}", flush=True)
            all_names: set[str] = set()
            while written < args.events:
                n = min(chunk, args.events - written)
                with prod.transaction():
                    enqueue_many(prod, [Event("order", str((written + i) % 10_000), "updated",
                                              {"n": written + i, "note": "x" * 200}) for i in range(n)])
                written += n
                ahead = written / args.rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
                if time.monotonic() - last_report >= 10:
                    last_report = time.monotonic()
                    sample()
            # Drain, then let retention pass and maintenance drop what is left behind.
            while mon.execute("SELECT count(*) FROM outbox WHERE state IN ('pending','processing')").fetchone()[0]:  # type: ignore[index]
                time.sleep(1)
            drained_at = time.monotonic() - t0
            time.sleep(2 * args.width + 4)
            mon.execute("SELECT * FROM outbox_maintain()")
            sample(final=True)
            size1, parts1 = mon.execute(SIZE).fetchone()  # type: ignore[misc]
            published = mon.execute("SELECT count(*) FROM outbox").fetchone()[0]  # type: ignore[index]
            dead_tup = mon.execute("SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
                                   "WHERE relname LIKE 'outbox_%%'").fetchone()[0]  # type: ignore[index]
        print(f"\nevents written and delivered: {written} (drained at t={drained_at:.0f}s)")
        print(f"outbox size: start {size0 / 1e6:.1f} MB, peak {peak / 1e6:.1f} MB, end {size1 / 1e6:.1f} MB")
        print(f"partitions: {parts0} at start, {parts1} at end, {len(dropped_seen)} dropped during the run")
        print(f"rows left in the outbox: {published}; dead tuples in remaining partitions: {dead_tup}")
        return 0
    finally:
        if worker is not None and worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
        try:
            asyncio.run(stream("delete"))  # type: ignore[possibly-undefined]
        except Exception:  # noqa: BLE001
            pass
        with psycopg.connect(args.dsn, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


if __name__ == "__main__":
    sys.exit(main())
