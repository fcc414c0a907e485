"""End-to-end benchmark of the worker: commit -> JetStream ack -> marked published.

    .venv/bin/python bench/e2e.py            # full run (about 6 minutes)
    .venv/bin/python bench/e2e.py --quick    # smaller counts, shorter phases

Uses the PostgreSQL and NATS servers given by --dsn / --nats-url (default: the local services),
in a database and a stream of its own that it removes at the end. Workers run as separate
outboxpg-worker processes, as in production. Prints:

  * throughput: 200,000 pre-filled events drained by 1 and by 2 worker processes, and by a naive
    relay (claim 100 -> publish_async -> await acks -> complete, nothing overlapped) in the same
    run, with the ratio;
  * latency commit -> delivery to a JetStream consumer (an upper bound of commit -> ack), p50 /
    p99 / max, at steady 100, 1,000 and 5,000 events/s, one event per transaction;
  * queries per second issued by an idle worker over 60 s (pg_stat_database.xact_commit: every
    statement the worker sends in autocommit is one transaction).

For every throughput phase it also prints where the CPU went, in microseconds per event, read
from /proc (bench/proc_cpu.py): the worker processes (or the naive relay, which runs in the bench
process), the PostgreSQL backends of the bench database, PostgreSQL's shared background
processes, nats-server (the process listening on the --nats-url port), the bench's own progress
polling, and the share of the machine other users took meanwhile ("foreign"), the hypervisor's
steal, and a speed reference (ms for a fixed piece of Python work, taken before the phase). CPU
per event moves much less with outside load than events/s does; compare designs by it, and by
events/s only in runs with little foreign load. On this VM, all components' CPU per event
sometimes rise together by a third with no foreign load or steal showing (the host's other
guests): a slow speed reference, or such a uniform rise, marks a run to repeat.

    .venv/bin/python bench/e2e.py --only throughput --events 100000 --workers 1 --no-naive
    .venv/bin/python bench/e2e.py --only throughput --profile /tmp/prof   # cProfile each worker
"""

from __future__ import annotations

import argparse
import hashlib
import asyncio
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats
import psycopg
from nats.js.api import DeliverPolicy, StreamConfig
from psycopg.conninfo import conninfo_to_dict, make_conninfo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from outboxpg import schema, sql_files  # noqa: E402
from outboxpg.events import CLAIM_COLUMNS  # noqa: E402
from outboxpg.relay.gateway import RawJsonLoader  # noqa: E402
from proc_cpu import CpuMeter, QuietWaiter, speed_reference_ms  # noqa: E402  (bench/, beside this file)

WORKER = str(Path(sys.executable).parent / "outboxpg-worker")


def log(text: str) -> None:
    print(text, flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = f"{os.getpid()}"
        self.admin_dsn = args.dsn
        self.dbname = f"outboxpg_e2e_{self.tag}"
        self.dsn = make_conninfo(args.dsn, dbname=self.dbname)
        self.stream = f"E2E{self.tag}"
        self.prefix = f"e2e{self.tag}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.nats_port = urlsplit(args.nats_url).port or 4222
        self._mon: psycopg.Connection[Any] | None = None
        self._in_flow_sql: str | None = None
        self.quiet = QuietWaiter(self.dbname, args.quiet_wait, nats_port=self.nats_port)
        self.cpu_lines: list[str] = []
        self.speed_ref = 0.0
        self.worker_log = tempfile.TemporaryFile()   # the workers' stderr, shown if a phase fails

    # -- setup ----------------------------------------------------------------------------

    def create_db(self) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{self.dbname}"')
            c.execute(f'CREATE DATABASE "{self.dbname}"')
        schema.migrate(self.dsn)
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("UPDATE outbox_settings SET subject_prefix = %s", (self.prefix,))

    def drop_db(self) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{self.dbname}" WITH (FORCE)')

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
        except Exception:  # noqa: BLE001
            pass
        await nc.close()

    def truncate(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("TRUNCATE outbox")
            c.execute("VACUUM ANALYZE outbox")

    def fill(self, n: int, aggregates: int) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                      "SELECT 'order', (g %% %s)::text, 'updated', "
                      "jsonb_build_object('order', g %% %s, 'n', g, 'note', 'a typical small event payload') "
                      "FROM generate_series(1, %s) g", (aggregates, aggregates, n))
            c.execute("VACUUM ANALYZE outbox")

    def monitor(self) -> psycopg.Connection[Any]:
        """One connection for the progress polls (a new connection per poll would cost a backend
        fork each time); its backend's CPU is counted as the bench's, not the worker's."""
        if self._mon is None or self._mon.closed:
            self._mon = psycopg.connect(self.dsn, autocommit=True)
        return self._mon

    def close_monitor(self) -> None:
        if self._mon is not None:
            self._mon.close()
            self._mon = None

    def published(self) -> int:
        c = self.monitor()
        return int(c.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0])  # type: ignore[index]

    def meter(self) -> CpuMeter:
        # Every 0.5 s: no process of a phase exits before its end, and each scan of /proc costs
        # CPU on the machine being measured.
        return CpuMeter(self.dbname, nats_port=self.nats_port, bench_backends={self.monitor().info.backend_pid},
                        interval=0.5)

    def report_cpu(self, label: str, meter: CpuMeter, events: int) -> None:
        us = meter.per_event_us(events)
        r = meter.result
        line = (f"  cpu us/event [{label}]: {'relay' if label == 'naive' else 'worker'} "
                f"{us['bench'] if label == 'naive' else us['worker']:5.1f}  pg {us['pg']:5.1f}  "
                f"pg-bg {us['pg_background']:4.1f}  nats {us['nats']:5.1f}  "
                f"bench {us['bench'] if label != 'naive' else 0.0:4.1f}  "
                f"| busy {r['busy_pct']:3.0f}% foreign {r['foreign_pct']:3.0f}% steal {r['steal_pct']:.0f}% "
                f"of {os.cpu_count()} cpus; speed ref {self.speed_ref:.1f} ms")
        log(line)
        self.cpu_lines.append(line)

    def start_worker(self, name: str, *extra: str) -> subprocess.Popen[bytes]:
        cmd = [WORKER]
        if self.args.profile:
            os.makedirs(self.args.profile, exist_ok=True)
            cmd = [sys.executable, "-m", "cProfile", "-o",
                   os.path.join(self.args.profile, f"{name}-{len(self.procs)}-{int(time.time())}.prof"), WORKER]
        p = subprocess.Popen([*cmd, "--dsn", self.dsn, "--nats-url", self.args.nats_url, "--name", name,
                              "--batch-size", str(self.args.batch_size), "--concurrency", str(self.args.concurrency),
                              "--log-level", "WARNING", *extra],
                             stdout=subprocess.DEVNULL, stderr=self.worker_log)
        self.procs.append(p)
        return p

    def worker_log_tail(self, lines: int = 20) -> str:
        """The end of what the workers wrote to stderr (warnings and errors), for a failed phase."""
        self.worker_log.flush()
        self.worker_log.seek(0)
        return "".join(self.worker_log.read().decode(errors="replace").splitlines(True)[-lines:])

    def stop_workers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    # -- throughput ------------------------------------------------------------------------

    def in_flow_left(self) -> bool:
        """Whether any event is still pending or leased. Cheap at any backlog when the schema
        has the partial index on in_flow (one index probe), unlike counting the published rows,
        which scans the table: polled every 50 ms, a count cost PostgreSQL about 15 us of CPU
        per event drained, on the same 2 cores as the worker it measures."""
        c = self.monitor()
        if self._in_flow_sql is None:
            has = c.execute("SELECT 1 FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
                            "AND attname = 'in_flow' AND NOT attisdropped").fetchone()
            self._in_flow_sql = ("SELECT EXISTS (SELECT 1 FROM outbox WHERE in_flow)" if has else
                                 "SELECT EXISTS (SELECT 1 FROM outbox WHERE state IN ('pending', 'processing'))")
        return bool(c.execute(self._in_flow_sql).fetchone()[0])  # type: ignore[index]

    def drain_rate(self, total: int, label: str) -> tuple[float, float]:
        """Events/s from the first progress seen to the last event published (startup excluded);
        CPU per event over the same window."""
        meter = self.meter()
        deadline = time.monotonic() + 600
        while True:   # start-up: until the first event is published
            t0 = time.monotonic()
            start_count = self.published()
            if start_count > 0:
                start_t = (t0 + time.monotonic()) / 2
                break
            if t0 > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError("no event published (worker exited or 600 s passed); worker log:\n"
                                   + self.worker_log_tail())
            time.sleep(0.05)
        meter.start()
        try:
            while self.in_flow_left():
                if time.monotonic() > deadline:
                    raise RuntimeError("drain did not finish within 600 s; worker log:\n" + self.worker_log_tail())
                time.sleep(0.05)
            end_t = time.monotonic()
        finally:
            meter.stop()
        n = self.published()
        if n != total:
            raise RuntimeError(f"drain ended with {n} of {total} events published")
        self.report_cpu(label, meter, total - start_count)
        return (total - start_count) / (end_t - start_t), end_t - start_t

    def prepare(self, total: int, aggregates: int) -> None:
        self.truncate()
        asyncio.run(self.reset_stream())
        self.fill(total, aggregates)
        self.monitor()
        if self.args.quiet_wait > 0:
            foreign = self.quiet()
            if foreign >= self.quiet.threshold:
                log(f"  (no quiet second found: foreign CPU {foreign:.0f}% just before this phase)")
        self.speed_ref = speed_reference_ms()

    def throughput(self, workers: int, total: int, aggregates: int) -> tuple[float, float]:
        self.prepare(total, aggregates)
        for i in range(workers):
            self.start_worker(f"bench{i}")
        try:
            return self.drain_rate(total, f"x{workers}")
        finally:
            self.stop_workers()

    def naive(self, total: int, aggregates: int) -> tuple[float, float]:
        self.prepare(total, aggregates)
        with self.meter() as meter:
            rate, secs = asyncio.run(self._naive(total))
        self.report_cpu("naive", meter, total)
        return rate, secs

    async def _naive(self, total: int) -> tuple[float, float]:
        nc = await nats.connect(self.args.nats_url)
        js = nc.jetstream()
        done = 0
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as c:
            c.adapters.register_loader("jsonb", RawJsonLoader)  # payload bytes as stored, like the worker
            t0 = time.monotonic()
            while True:
                rows = await (await c.execute(f"SELECT {CLAIM_COLUMNS} FROM outbox_claim(100)")).fetchall()
                if not rows:
                    break
                futs = [await js.publish_async(r[1], r[5], headers={"Nats-Msg-Id": r[7]}) for r in rows]
                await asyncio.gather(*futs)
                await c.execute("SELECT outbox_complete(%s::bigint[], %s)", ([r[0] for r in rows], rows[0][10]))
                done += len(rows)
            elapsed = time.monotonic() - t0
        await nc.close()
        return done / elapsed, elapsed

    # -- latency ---------------------------------------------------------------------------

    def latency(self, rate: int, seconds: float) -> dict[str, float]:
        self.truncate()
        asyncio.run(self.reset_stream())
        self.start_worker("lat")
        time.sleep(2.0)  # worker up and idle
        try:
            return asyncio.run(self._latency(rate, seconds))
        finally:
            self.stop_workers()

    async def _latency(self, rate: int, seconds: float) -> dict[str, float]:
        received: dict[str, float] = {}
        nc = await nats.connect(self.args.nats_url)
        js = nc.jetstream()

        async def on_msg(msg: nats.aio.msg.Msg) -> None:
            received[(msg.headers or {}).get("Nats-Msg-Id", "")] = time.time()

        sub = await js.subscribe(f"{self.prefix}.>", ordered_consumer=True, cb=on_msg,
                                 deliver_policy=DeliverPolicy.NEW)
        # Producers run in processes of their own, so that neither they nor this consumer wait
        # for each other's turn on one event loop; time.time() is one clock for all of them.
        procs = max(1, min(4, rate // 500))
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        workers = [ctx.Process(target=produce, args=(self.dsn, k, rate / procs, seconds, self.tag, queue))
                   for k in range(procs)]
        for w in workers:
            w.start()
        committed: dict[str, float] = {}
        for _ in workers:
            committed.update(await asyncio.get_running_loop().run_in_executor(None, queue.get))
        for w in workers:
            w.join()
        end = time.monotonic() + 10
        while len(set(committed) - set(received)) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        await sub.unsubscribe()
        await nc.close()
        lat = sorted(received[m] - t for m, t in committed.items() if m in received)
        if not lat:
            raise RuntimeError("no latency samples")
        return {"sent": len(committed), "received": len(lat), "achieved_rate": len(committed) / seconds,
                "p50": lat[len(lat) // 2] * 1000, "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000,
                "max": lat[-1] * 1000, "missing": len(committed) - len(lat)}

    # -- idle ------------------------------------------------------------------------------

    def idle_qps(self, seconds: float) -> tuple[float, int]:
        self.truncate()
        self.start_worker("idle")
        # Past the start-up queries, and past PostgreSQL 15's 10 s delay in flushing an idle
        # backend's statistics: otherwise the start-up would be counted in the window.
        time.sleep(15.0)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as c:
                def commits() -> int:
                    c.execute("SELECT pg_stat_clear_snapshot()")
                    return int(c.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
                               .fetchone()[0])  # type: ignore[index]
                time.sleep(1.5)  # let pending statistics flush
                before = commits()
                time.sleep(seconds)
                time.sleep(1.5)
                after = commits()
            own = 2  # our own two snapshot queries (the clear_snapshot calls read no counts)
            queries = after - before - own
            return queries / seconds, queries
        finally:
            self.stop_workers()


def produce(dsn: str, k: int, rate: float, seconds: float, tag: str, queue: "multiprocessing.Queue[dict[str, float]]") -> None:
    """A producer process: one event per transaction at ``rate``/s; reports commit times."""
    committed: dict[str, float] = {}
    with psycopg.connect(dsn, autocommit=True) as c:
        # Latency counts from the moment COMMIT returns; not waiting for the WAL flush lets one
        # connection keep up the rate (a flush costs about 2-3 ms on this disk).
        c.execute("SET synchronous_commit = off")
        t0 = time.monotonic()
        i = 0
        while time.monotonic() - t0 < seconds:
            mid = f"{k}-{i}-{tag}"
            c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, msg_id) "
                      "VALUES ('order', %s, 'updated', '{\"n\": 1}', %s)", (f"{k}-{i % 500}", mid), prepare=True)
            committed[mid] = time.time()
            i += 1
            ahead = i / rate - (time.monotonic() - t0)
            if ahead > 0:
                time.sleep(ahead)
    queue.put(committed)


def code_version() -> str:
    """The commit, whether the tree differs from it, and a digest of the migrations installed
    (other work on the SQL changes what PostgreSQL spends per event)."""
    root = Path(schema.__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or "?"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head, dirty = "?", ""
    digest = hashlib.sha1()
    for f in sorted(sql_files.migrations_dir().glob("*.sql")):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return (f"{root} at {head}{' with uncommitted changes' if dirty else ''}; "
            f"migrations digest {digest.hexdigest()[:10]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres"))
    ap.add_argument("--nats-url", default=os.environ.get("OUTBOXPG_BENCH_NATS", "nats://127.0.0.1:4222"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument("--aggregates", type=int, default=20_000)
    ap.add_argument("--batch-size", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--only", choices=["throughput", "latency", "idle"], default=None)
    ap.add_argument("--workers", default="1,2",
                    help="throughput phases: numbers of worker processes, comma-separated (default 1,2)")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive relay's throughput phase")
    ap.add_argument("--quiet-wait", type=float, default=30.0,
                    help="before each throughput phase, wait (at most this many seconds in all) for a "
                         "second with under 10%% foreign CPU (default 30; 0: never wait)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="run each worker under cProfile, writing DIR/<name>-<n>-<time>.prof")
    args = ap.parse_args()
    total = args.events or (40_000 if args.quick else 200_000)
    lat_seconds = 5.0 if args.quick else 15.0
    idle_seconds = 15.0 if args.quick else 60.0

    b = Bench(args)
    log(f"outboxpg e2e benchmark  {time.strftime('%Y-%m-%d %H:%M:%S')}  {platform.node()}  "
        f"{os.cpu_count()} cpus  python {platform.python_version()}")
    with psycopg.connect(args.dsn) as c:
        log(f"PostgreSQL {c.info.server_version}  at {conninfo_to_dict(args.dsn).get('host')}; NATS {args.nats_url}")
    log(f"code: {code_version()}")
    log(f"worker: --batch-size {args.batch_size} --concurrency {args.concurrency}; "
        f"{total} events over {args.aggregates} aggregates")
    b.create_db()
    results: list[str] = []
    try:
        if args.only in (None, "throughput"):
            naive_rate = None
            if not args.no_naive:
                naive_rate, naive_s = b.naive(total, args.aggregates)
                log(f"naive relay (claim 100 -> publish_async -> acks -> complete): {naive_rate:9.0f} events/s "
                    f"({naive_s:.1f} s)")
            for workers in (int(w) for w in args.workers.split(",") if w.strip()):
                rate, secs = b.throughput(workers, total, args.aggregates)
                ratio = f"   ratio to naive {rate / naive_rate:4.2f}" if naive_rate else ""
                log(f"outboxpg-worker x{workers}: {rate:9.0f} events/s ({secs:.1f} s){ratio}")
                results.append(f"throughput workers={workers} {rate:.0f}/s{ratio}")
        if args.only in (None, "latency"):
            for rate in (100, 1000, 5000):
                r = b.latency(rate, lat_seconds)
                log(f"latency commit->consumer at {rate:5d}/s (achieved {r['achieved_rate']:.0f}/s, {int(r['received'])} samples): "
                    f"p50 {r['p50']:6.2f} ms  p99 {r['p99']:6.2f} ms  max {r['max']:7.2f} ms"
                    + (f"  MISSING {int(r['missing'])}" if r["missing"] else ""))
        if args.only in (None, "idle"):
            qps, q = b.idle_qps(idle_seconds)
            log(f"idle worker: {q} queries in {idle_seconds:.0f} s = {qps:.3f} queries/s "
                f"(one per {idle_seconds / q if q else float('inf'):.1f} s)")
    finally:
        b.stop_workers()
        b.close_monitor()
        asyncio.run(b.drop_stream())
        b.drop_db()
    return 0


if __name__ == "__main__":
    sys.exit(main())
