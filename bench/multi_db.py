"""One `outboxpg-worker` process over 1, 10 and 50 databases (``--dsn-file``).

    .venv/bin/python bench/multi_db.py            # every phase (about 5 minutes)
    .venv/bin/python bench/multi_db.py --quick    # smaller counts, shorter phases
    .venv/bin/python bench/multi_db.py --events 20000 --backlog 20000 --seconds 10   # the run in BENCHMARKS.md

The databases live in a PostgreSQL cluster of the benchmark's own (initdb in a temp dir, port
5499 unless taken, max_connections 600), because each served database holds 3 connections while
idle (the claim pool's first, the LISTEN, the wakeup lock) and up to --concurrency + 4 while busy:
50 databases need more than the 100 connections of a stock server. ``--server DSN`` uses a
running server instead (it must allow that many connections). One template database is installed
with ``outboxpg migrate``; the N databases are clones of it (CREATE DATABASE ... TEMPLATE), dropped
at the end of each phase, and the cluster is removed at the end. The stream lives on --nats-url
(default: the local service), named and prefixed for this run, deleted at the end.

Phases, each with a fresh worker process (``--dsn-file``, ``--metrics-port``), its CPU read from
/proc:

  drain N      EVENTS events spread evenly over N databases (1,000 aggregates each), committed at
               once while the worker is idle; events/s from the first commit to the last event
               marked published, and the slowest database's share: when half of all events are
               delivered, min over databases of (its delivered / the mean delivered); 1.00 is even.
  latency N    RATE events/s spread over N databases (one event per transaction, a producer
               process), SECONDS long: commit -> stored in JetStream (the stream's own timestamp
               of each message, against the time COMMIT returned) p50 / p99 / max; and the
               worker's CPU while idle over the N databases, then at the rate.
  starvation   10 databases: one with a BACKLOG-event backlog committed at once, the 9 others
               written at 100 events/s each meanwhile; the others' commit -> JetStream p50 / p99 /
               max while the backlog drains, with the default --max-in-flight (4,000 events:
               2 x --concurrency x --batch-size) and with no shared limit (--max-in-flight
               100000: only each database's own --concurrency), and the same 9 x 100 events/s
               with no backlog.

The CPU figures: the worker process's, PostgreSQL's (the postmaster's children) and the machine's
busy share, and how long the worker waited for a CPU while runnable (/proc/<pid>/task/*/schedstat,
summed over its threads): on a saturated machine a low CPU share with a long wait is starvation
by other load, not an idle worker.

Figures go to stdout; BENCHMARKS.md ("One process over many databases") holds the latest.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proc_cpu import HZ  # noqa: E402

from outboxpg.embedded import EmbeddedPostgres, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DELIVERED = re.compile(r'^outboxpg_events_delivered_total\{database="([^"]+)",event_type="[^"]*"\} ([0-9.e+]+)$',
                       re.M)


def ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def waited_ns(pid: int) -> int:
    """Nanoseconds the process's threads spent runnable but waiting for a CPU (schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except OSError:
            continue
    return total


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Cpu:
    """CPU seconds of the worker process, of the PostgreSQL server's processes (the postmaster's
    children: backends and background workers; those that exit meanwhile are not counted), and
    the machine's busy share, between start() and stop()."""

    def __init__(self, worker: int, postmaster: int | None) -> None:
        self.worker, self.postmaster = worker, postmaster

    def _pg(self) -> int:
        if self.postmaster is None:
            return 0
        total = 0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.postmaster:
                total += int(fields[11]) + int(fields[12])
        return total

    @staticmethod
    def _machine() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)

    def start(self) -> Cpu:
        self.t0, self.w0, self.p0, self.m0 = time.monotonic(), ticks(self.worker), self._pg(), self._machine()
        self.q0 = waited_ns(self.worker)
        return self

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        busy, total = self._machine()
        return {"wall": wall, "worker_pct": 100 * (ticks(self.worker) - self.w0) / HZ / wall,
                "pg_pct": 100 * (self._pg() - self.p0) / HZ / wall,
                "worker_waited_pct": 100 * (waited_ns(self.worker) - self.q0) / 1e9 / wall,
                "machine_busy_pct": 100 * (busy - self.m0[0]) / max(1, total - self.m0[1])}


def load() -> str:
    return os.getloadavg().__repr__()


def pct(values: Sequence[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))] if s else float("nan")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = uuid.uuid4().hex[:8]
        self.stream = f"BMDB{self.tag}".upper()
        self.prefix = f"bmdb{self.tag}"
        self.template = f"bmdb_{self.tag}_template"
        self.tmp = Path(tempfile.mkdtemp(prefix="outboxpg-multidb-"))
        self.pg: EmbeddedPostgres | None = None
        self.server = args.server
        self.postmaster: int | None = None

    # -- set-up ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.server is None:
            port = 5499
            try:
                with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres", connect_timeout=1):
                    port = free_port()   # someone's server is there
            except psycopg.Error:
                pass
            self.pg = EmbeddedPostgres(port=port, settings={"max_connections": "600", "shared_buffers": "256MB"})
            self.pg.start()
            self.server = self.pg.dsn
            with open(self.pg.datadir / "postmaster.pid") as f:
                self.postmaster = int(f.readline())
        with psycopg.connect(self.server, autocommit=True) as c:
            c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.template)))
        dsn = make_conninfo(self.server, dbname=self.template)
        subprocess.run([str(BIN / "outboxpg"), "migrate", "--dsn", dsn], check=True, capture_output=True)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("UPDATE outbox_settings SET subject_prefix = %s", (self.prefix,))

    def stop(self) -> None:
        try:
            with psycopg.connect(self.server, autocommit=True) as c:
                c.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(self.template)))
        finally:
            asyncio.run(self.drop_stream())
            if self.pg is not None:
                self.pg.stop()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def databases(self, n: int) -> list[str]:
        names = [f"bmdb_{self.tag}_{i}" for i in range(n)]
        with psycopg.connect(self.server, autocommit=True) as c:
            for name in names:
                c.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                                          sql.Identifier(self.template)))
        return [make_conninfo(self.server, dbname=name) for name in names]

    def drop(self, dsns: list[str]) -> None:
        with psycopg.connect(self.server, autocommit=True) as c:
            for dsn in dsns:
                c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(conninfo_to_dict(dsn)["dbname"])))

    async def reset_stream(self) -> None:
        nc = await nats.connect(self.args.nats_url)
        js = nc.jetstream()
        try:
            await js.delete_stream(self.stream)
        except Exception:  # noqa: BLE001 - not there yet
            pass
        await js.add_stream(StreamConfig(name=self.stream, subjects=[f"{self.prefix}.>"], duplicate_window=600))
        await nc.close()

    async def drop_stream(self) -> None:
        nc = await nats.connect(self.args.nats_url)
        try:
            await nc.jetstream().delete_stream(self.stream)
        except Exception:  # noqa: BLE001 - not there
            pass
        await nc.close()

    # -- the worker --------------------------------------------------------------------------

    def worker(self, dsns: list[str], *extra: str) -> tuple[subprocess.Popen[bytes], int, Path]:
        listing = self.tmp / f"dsns-{len(dsns)}-{time.monotonic_ns()}.txt"
        listing.write_text("".join(f"name=d{i} {dsn}\n" for i, dsn in enumerate(dsns)))
        port = free_port()
        log = self.tmp / f"worker-{time.monotonic_ns()}.log"
        proc = subprocess.Popen([str(BIN / "outboxpg-worker"), "--dsn-file", str(listing), "--nats-url",
                                 self.args.nats_url, "--metrics-port", str(port), "--maintenance-interval", "0",
                                 "--xmin-check-interval", "0", "--summary-interval", "3600", "--name", "bench",
                                 *extra], stdout=subprocess.DEVNULL, stderr=log.open("wb"))
        end = time.monotonic() + 60
        while log.read_text().count("event=start ") < len(dsns):
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the worker did not start: {log.read_text()[-3000:]}")
            time.sleep(0.1)
        time.sleep(1.0)   # every database's first claim done, each worker idle
        return proc, port, log

    @staticmethod
    def end_worker(proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)

    @staticmethod
    def delivered(port: int) -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for label, value in DELIVERED.findall(text):
            out[label] = out.get(label, 0.0) + float(value)
        return out

    # -- drain -------------------------------------------------------------------------------

    def drain(self, n: int, events: int) -> dict[str, Any]:
        dsns = self.databases(n)
        asyncio.run(self.reset_stream())
        try:
            proc, port, _ = self.worker(dsns)
            try:
                per = events // n
                conns = [psycopg.connect(d) for d in dsns]
                for c in conns:
                    c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                              "SELECT 'order', (g %% 1000)::text, 'updated', jsonb_build_object('n', g, 'note', "
                              "'a typical small event payload') FROM generate_series(1, %s) g", (per,))
                meter = Cpu(proc.pid, self.postmaster).start()
                t0 = time.monotonic()
                for c in conns:
                    c.commit()
                for c in conns:
                    c.close()
                share = None
                total = per * n
                while True:
                    got = self.delivered(port)
                    done = sum(got.values())
                    if share is None and done >= total / 2:
                        mean = done / n
                        share = min(got.get(f"d{i}", 0.0) for i in range(n)) / mean
                    if done >= total:
                        break
                    if time.monotonic() - t0 > 600:
                        raise RuntimeError(f"drain of {total} over {n} databases not done in 600 s: {done}")
                    time.sleep(0.25)
                wall = time.monotonic() - t0
                cpu = meter.stop()
                rss = rss_mb(proc.pid)
            finally:
                self.end_worker(proc)
        finally:
            self.drop(dsns)
        return {"databases": n, "events": total, "events_s": total / wall, "slowest_share": share,
                "worker_cpu_pct": cpu["worker_pct"],
                "worker_us_per_event": 1e6 * cpu["worker_pct"] / 100 * wall / total,
                "pg_cpu_pct": cpu["pg_pct"], "machine_busy_pct": cpu["machine_busy_pct"], "rss_mb": rss,
                "waited_pct": cpu["worker_waited_pct"], "load": load()}

    # -- latency -----------------------------------------------------------------------------

    def latency(self, n: int, rate: float, seconds: float) -> dict[str, Any]:
        dsns = self.databases(n)
        asyncio.run(self.reset_stream())
        try:
            proc, _, _ = self.worker(dsns)
            try:
                cpu0, t0 = ticks(proc.pid), time.monotonic()
                time.sleep(5.0)
                idle_pct = 100 * (ticks(proc.pid) - cpu0) / HZ / (time.monotonic() - t0)
                meter = Cpu(proc.pid, self.postmaster).start()
                committed = produce_all(dsns, [rate / n] * n, seconds, "tick")
                cpu = meter.stop()
                time.sleep(2.0)
                rss_mb_at_end = rss_mb(proc.pid)
            finally:
                self.end_worker(proc)
            stored = asyncio.run(self.stored_times("tick"))
        finally:
            self.drop(dsns)
        lat = [(stored[m] - t) * 1000 for m, t in committed.items() if m in stored]
        return {"databases": n, "rate": rate, "sent": len(committed), "missing": len(committed) - len(lat),
                "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), "max_ms": max(lat) if lat else float("nan"),
                "idle_cpu_pct": idle_pct, "busy_cpu_pct": cpu["worker_pct"], "pg_cpu_pct": cpu["pg_pct"],
                "waited_pct": cpu["worker_waited_pct"],
                "machine_busy_pct": cpu["machine_busy_pct"], "rss_mb": rss_mb_at_end, "load": load()}

    async def stored_times(self, event_type: str) -> dict[str, float]:
        """msg_id -> when JetStream stored it (the message's own timestamp), for one event type."""
        nc = await nats.connect(self.args.nats_url)
        js = nc.jetstream()
        out: dict[str, float] = {}
        try:
            sub = await js.pull_subscribe(f"{self.prefix}.order.{event_type}", stream=self.stream,
                                          config=ConsumerConfig(ack_policy=AckPolicy.NONE,
                                                                deliver_policy=DeliverPolicy.ALL))
            while True:
                try:
                    msgs = await sub.fetch(1000, timeout=2)
                except (TimeoutError, nats.errors.TimeoutError):
                    break
                for m in msgs:
                    out[(m.headers or {}).get("Nats-Msg-Id", "")] = m.metadata.timestamp.timestamp()
            await sub.unsubscribe()
        finally:
            await nc.close()
        return out

    # -- starvation --------------------------------------------------------------------------

    def starvation(self, backlog: int, in_flight: str | None) -> dict[str, Any]:
        dsns = self.databases(10)
        asyncio.run(self.reset_stream())
        try:
            proc, _, _ = self.worker(dsns, *(["--max-in-flight", in_flight] if in_flight else []))
            try:
                drain_s = None
                meter = Cpu(proc.pid, self.postmaster).start()
                if backlog:
                    with psycopg.connect(dsns[0]) as c:
                        c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                                  "SELECT 'order', (g %% 1000)::text, 'backlog', jsonb_build_object('n', g, 'note', "
                                  "'a typical small event payload') FROM generate_series(1, %s) g", (backlog,))
                t0 = time.monotonic()
                ctx = multiprocessing.get_context("spawn")
                queue = ctx.Queue()
                enough = ctx.Event()
                producer = ctx.Process(target=_produce_proc, args=(dsns[1:], [100.0] * 9, 600.0, "tick", queue,
                                                                    enough))
                producer.start()
                if backlog:
                    with psycopg.connect(dsns[0], autocommit=True) as c:
                        while c.execute("SELECT count(*) FROM outbox WHERE state <> 'published'").fetchone()[0]:
                            if time.monotonic() - t0 > 600:
                                raise RuntimeError("backlog not drained in 600 s")
                            time.sleep(0.2)
                    drain_s = time.monotonic() - t0
                else:
                    time.sleep(self.args.seconds)
                enough.set()
                committed = queue.get()
                producer.join()
                cpu = meter.stop()
                time.sleep(2.0)
            finally:
                self.end_worker(proc)
            stored = asyncio.run(self.stored_times("tick"))
        finally:
            self.drop(dsns)
        start = min(t for t, _ in committed.values()) if committed else 0
        # During the drain only (the producer stops a moment after it).
        window = [(m, t) for m, (t, _) in committed.items() if drain_s is None or t - start <= drain_s]
        lat = [(stored[m] - t) * 1000 for m, t in window if m in stored]
        return {"backlog": backlog, "max_in_flight": in_flight or "default (4000 events)", "drain_s": drain_s,
                "backlog_events_s": backlog / drain_s if drain_s else None, "others_sent": len(window),
                "missing": len(window) - len(lat), "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
                "max_ms": max(lat) if lat else float("nan"), "worker_cpu_pct": cpu["worker_pct"],
                "waited_pct": cpu["worker_waited_pct"], "pg_cpu_pct": cpu["pg_pct"],
                "machine_busy_pct": cpu["machine_busy_pct"], "load": load()}


def produce_all(dsns: list[str], rates: list[float], seconds: float, event_type: str) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_produce_proc, args=(dsns, rates, seconds, event_type, queue))
    p.start()
    committed = queue.get()
    p.join()
    return {m: t for m, (t, _) in committed.items()}


def _produce_proc(dsns: list[str], rates: list[float], seconds: float, event_type: str, queue: Any,
                  enough: Any = None) -> None:
    queue.put(asyncio.run(_produce(dsns, rates, seconds, event_type, enough)))


async def _produce(dsns: list[str], rates: list[float], seconds: float, event_type: str, enough: Any = None
                   ) -> dict[str, tuple[float, int]]:
    """One task per database, one event per transaction at its rate; msg_id -> (COMMIT returned, db)."""
    committed: dict[str, tuple[float, int]] = {}

    async def one(k: int, dsn: str, rate: float, lane: int) -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
            await c.execute("SET synchronous_commit = off")   # latency counts from COMMIT returning
            t0 = time.monotonic()
            i = 0
            while time.monotonic() - t0 < seconds and not (enough is not None and enough.is_set()):
                mid = f"{k}-{lane}-{i}-{uuid.uuid4().hex[:6]}"
                await c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, msg_id) "
                                "VALUES ('order', %s, %s, '{\"n\": 1}', %s)",
                                (f"{k}-{lane}-{i % 100}", event_type, mid), prepare=True)
                committed[mid] = (time.time(), k)
                i += 1
                ahead = i / rate - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)

    # One connection commits about 100-300 transactions/s here (a round trip each): a database's
    # rate is spread over ceil(rate / 100) connections of its own.
    lanes = [(k, d, r / math.ceil(r / 100), j) for k, (d, r) in enumerate(zip(dsns, rates))
             for j in range(math.ceil(r / 100))]
    await asyncio.gather(*(one(k, d, r, j) for k, d, r, j in lanes))
    return committed


def code_version() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", help="a running PostgreSQL server (libpq DSN) instead of a cluster of the bench's own")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--counts", default="1,10,50", help="numbers of databases, comma-separated")
    p.add_argument("--events", type=int, default=100_000, help="events of each drain, spread over the databases")
    p.add_argument("--rate", type=float, default=1000.0, help="events/s of the latency phases")
    p.add_argument("--seconds", type=float, default=15.0, help="length of each latency phase")
    p.add_argument("--backlog", type=int, default=200_000, help="the starving database's backlog")
    p.add_argument("--only", choices=("drain", "latency", "starvation"), action="append")
    p.add_argument("--quick", action="store_true", help="20,000-event drains, 5 s phases, a 30,000-event backlog")
    args = p.parse_args()
    if args.quick:
        args.events, args.seconds, args.backlog = 20_000, 5.0, 30_000
    counts = [int(c) for c in args.counts.split(",")]
    phases = args.only or ["drain", "latency", "starvation"]
    b = Bench(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stopped: still drop what it made (finally)
    print(f"bench/multi_db.py at {code_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} CPUs, load {load()}", flush=True)
    b.start()
    try:
        if "drain" in phases:
            print(f"\ndrain: {args.events} events spread evenly, committed at once, one worker process", flush=True)
            for n in counts:
                r = b.drain(n, args.events)
                print(f"  {n:3d} databases: {r['events_s']:8.0f} events/s, slowest database's share at half-way "
                      f"{r['slowest_share']:.2f}, worker CPU {r['worker_cpu_pct']:.0f} % of a core "
                      f"({r['worker_us_per_event']:.1f} us/event; waiting for a CPU {r['waited_pct']:.0f} % of the "
                      f"time), PostgreSQL {r['pg_cpu_pct']:.0f} %, machine busy "
                      f"{r['machine_busy_pct']:.0f} %, worker RSS {r['rss_mb']:.0f} MB, load {r['load']}",
                      flush=True)
        if "latency" in phases:
            print(f"\nlatency: {args.rate:g} events/s spread over the databases for {args.seconds:g} s, commit -> "
                  "stored in JetStream", flush=True)
            for n in counts:
                r = b.latency(n, args.rate, args.seconds)
                print(f"  {n:3d} databases: p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max "
                      f"{r['max_ms']:.1f} ms ({r['sent']} sent: {r['sent'] / args.seconds:.0f} events/s reached, "
                      f"{r['missing']} missing); worker CPU idle "
                      f"{r['idle_cpu_pct']:.1f} %, at the rate {r['busy_cpu_pct']:.0f} % of a core (waiting for a CPU "
                      f"{r['waited_pct']:.0f} % of the time), PostgreSQL "
                      f"{r['pg_cpu_pct']:.0f} %, machine busy {r['machine_busy_pct']:.0f} %, worker RSS "
                      f"{r['rss_mb']:.0f} MB; load {r['load']}",
                      flush=True)
        if "starvation" in phases:
            print(f"\nstarvation: 10 databases, one with a {args.backlog}-event backlog, 9 at 100 events/s each; "
                  "the 9's commit -> JetStream while the backlog drains", flush=True)
            for backlog, in_flight in ((args.backlog, None), (args.backlog, "100000"), (0, None)):
                r = b.starvation(backlog, in_flight)
                what = (f"backlog, --max-in-flight {r['max_in_flight']}" if backlog else
                        "no backlog (the 9 alone)")
                drained = (f"backlog drained in {r['drain_s']:.1f} s ({r['backlog_events_s']:.0f} events/s); "
                           if backlog else "")
                print(f"  {what}: {drained}the others p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max "
                      f"{r['max_ms']:.1f} ms ({r['others_sent']} sent, {r['missing']} missing); worker CPU "
                      f"{r['worker_cpu_pct']:.0f} % (waiting for a CPU {r['waited_pct']:.0f} %), PostgreSQL "
                      f"{r['pg_cpu_pct']:.0f} %, machine busy "
                      f"{r['machine_busy_pct']:.0f} %; load {r['load']}", flush=True)
    finally:
        b.stop()


if __name__ == "__main__":
    main()
