#!/usr/bin/env python3
"""SQL-core benchmark for outboxpg: what the database side costs, without any broker.

    .venv/bin/python bench/sql_core.py            # full run (about 9-10 minutes)
    .venv/bin/python bench/sql_core.py --quick    # smaller, shorter (about 1.5 minutes)

It creates its own database (``outboxpg_bench_<pid>``) on a running server (``--dsn``, default
``host=127.0.0.1 port=5432 user=postgres dbname=postgres``, or $OUTBOXPG_BENCH_DSN), installs
the schema with ``outboxpg.schema.migrate``, measures, prints a table, and drops the database.
It starts only its own pgbench processes and its own threads, and stops them.

Sections (see BENCHMARKS.md for the figures and what they mean):
  A  claim + complete throughput (events/s), SQL only: ``outbox_claim(batch)`` then
     ``outbox_complete(ids, token)``, each its own autocommit transaction, until the claim returns
     nothing; batch 10 / 100 / 1000, 1 and 2 connections (threads, one connection each), from a
     pre-filled outbox (INSERT ... SELECT generate_series; aggregate_id = i % 50000).
  B  the "bare loop" reference on a plain table (id bigint PK, status text, payload jsonb, partial
     index on pending): UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED LIMIT 100)
     RETURNING id, then UPDATE ... SET status = 'done'; ratio outbox (batch 100, 1 conn) / bare,
     from runs taken in turn (bare, outbox, bare) next to A's, best of each, to damp outside noise.
  C  INSERT throughput, one event per transaction, with pgbench at 1 / 8 / 32 clients, for:
       i    no trigger (outbox_wake_workers disabled)
       i+w  no trigger, plus a draining worker that polls (claims every 10 ms when empty)
       ii   our trigger, no worker (nobody holds the wakeup lock)
       iii  our trigger, plus a worker running the real wakeup protocol (LISTEN, outbox_worker_idle,
            claim once more, wait, outbox_worker_busy, drain)
       iv   a naive statement trigger that always pg_notify()s, plus a worker that LISTENs and
            drains on every notification
     The wakeup cost is iii against i+w: both have a worker draining every event, so the worker's
     CPU use (this machine has 2 cores) is on both sides. The commit-order guard trigger
     (outbox_hold_horizon) stays on in all of them.
  D  wake latency: the protocol worker idle (holding the lock), single inserts committed from
     another connection ~20 ms apart; commit returned -> notification received (and -> claimed).

Outside load: every measurement reports "foreign CPU", the share of the machine's CPU that other
processes took meanwhile (sampled from /proc), and A/B report the server CPU per event, which
outside load hardly moves. Before each measurement the run waits (90 s in all, --quiet-wait) for
a second in which others take under 10% of the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import conninfo_to_dict, make_conninfo  # noqa: E402

from outboxpg import schema  # noqa: E402
from proc_cpu import CpuMeter, QuietWaiter, backend_cpu_s  # noqa: E402  (bench/, beside this file)

CLAIM = "SELECT id, lease_token FROM outbox_claim(%s)"
COMPLETE = "SELECT outbox_complete(%s, %s)"
INSERT_ONE = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
              "VALUES ('order', %s, 'created', '{\"n\":1}')")
PGBENCH_SCRIPT = Path(__file__).resolve().parent / "pgbench_insert_one.sql"

# Everything this run started, so that it can stop exactly that and nothing else.
_children: list[subprocess.Popen[str]] = []
_threads: list["Worker"] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def connect(dsn: str, name: str = "outboxpg-bench") -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, application_name=name)


def drain(conn: psycopg.Connection[Any], batch: int, stop: threading.Event | None = None) -> int:
    """claim + complete until a claim returns nothing (or stop is set); returns events done."""
    total = 0
    while True:
        rows = conn.execute(CLAIM, (batch,)).fetchall()
        if not rows:
            return total
        conn.execute(COMPLETE, ([r[0] for r in rows], rows[0][1]))
        total += len(rows)
        if stop is not None and stop.is_set():
            return total


def pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of values."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100 * len(s) + 0.5)) - 1))
    return s[k]


# --------------------------------------------------------------------------------------------
# Database lifecycle


def prefill_outbox(admin: psycopg.Connection[Any], n: int, aggregates: int) -> None:
    admin.execute("TRUNCATE outbox")
    admin.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', (i %% %s)::text, 'created', '{\"n\":1}' FROM generate_series(1, %s) AS i",
        (aggregates, n))
    admin.execute("VACUUM ANALYZE outbox")
    admin.execute("CHECKPOINT")


def reset_outbox(admin: psycopg.Connection[Any]) -> None:
    admin.execute("TRUNCATE outbox")
    admin.execute("VACUUM ANALYZE outbox")
    admin.execute("CHECKPOINT")


NAIVE_TRIGGER = """
CREATE FUNCTION bench_naive_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_naive', '');
    RETURN NULL;
END $$;
CREATE TRIGGER bench_naive_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION bench_naive_notify();
ALTER TABLE outbox DISABLE TRIGGER bench_naive_notify;
"""


def set_trigger_mode(admin: psycopg.Connection[Any], mode: str) -> None:
    """mode: 'none' (no trigger), 'ours' (outbox_wake_workers), 'naive' (always pg_notify)."""
    ours = "ENABLE" if mode == "ours" else "DISABLE"
    naive = "ENABLE" if mode == "naive" else "DISABLE"
    admin.execute(f"ALTER TABLE outbox {ours} TRIGGER outbox_wake_workers")
    admin.execute(f"ALTER TABLE outbox {naive} TRIGGER bench_naive_notify")


# --------------------------------------------------------------------------------------------
# Outside noise: how much of the machine's CPU went elsewhere during a measurement


_quiet: QuietWaiter | None = None


def wait_quiet() -> None:
    if _quiet is not None:
        _quiet()


# --------------------------------------------------------------------------------------------
# Workers (threads, each with its own connections)


@dataclass
class WorkerStats:
    drained: int = 0            # events claimed and completed
    claims: int = 0             # non-empty claims
    idle_cycles: int = 0        # times outbox_worker_idle() was granted
    wakeups: int = 0            # waits ended by a notification
    timeouts: int = 0           # waits ended by the 1 s timeout
    notifications: int = 0      # notifications received in all (one per notifying transaction)
    idle_wait_s: float = 0.0    # time spent blocked in outbox_worker_idle()


class Worker(threading.Thread):
    """A simulated worker: 'poll', 'protocol' (the real wakeup protocol) or 'naive'."""

    def __init__(self, dsn: str, kind: str, batch: int = 100, wait_s: float = 1.0,
                 on_idle: Callable[[], None] | None = None,
                 on_notify: Callable[[float], None] | None = None,
                 on_claimed: Callable[[float, int], None] | None = None) -> None:
        super().__init__(name=f"bench-worker-{kind}", daemon=True)
        self.dsn, self.kind, self.batch, self.wait_s = dsn, kind, batch, wait_s
        self.on_idle, self.on_notify, self.on_claimed = on_idle, on_notify, on_claimed
        self.stop_evt = threading.Event()
        self.ready = threading.Event()
        self.stats = WorkerStats()
        self.error: BaseException | None = None
        self.channel = {"protocol": "outbox", "naive": "outbox_naive"}.get(kind)

    def run(self) -> None:
        try:
            getattr(self, f"_run_{self.kind}")()
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self.ready.set()

    def stop(self) -> None:
        self.stop_evt.set()
        if self.channel:  # wake it if it is waiting for a notification
            with connect(self.dsn) as c:
                c.execute(sql.SQL("NOTIFY {}").format(sql.Identifier(self.channel)))
        self.join(timeout=30)
        if self.is_alive():
            raise RuntimeError(f"worker {self.kind} did not stop")
        if self.error:
            raise RuntimeError(f"worker {self.kind} failed: {self.error!r}") from self.error

    def _flush(self, listen: psycopg.Connection[Any]) -> None:
        """Count the notifications still queued for this listener: a round trip makes the
        server deliver everything pending before it answers."""
        listen.execute("SELECT 1")
        self._count(listen, 0.05)

    def _count(self, listen: psycopg.Connection[Any], timeout: float, stop_after: int | None = None) -> int:
        n = sum(1 for _ in listen.notifies(timeout=timeout, stop_after=stop_after))
        self.stats.notifications += n
        return n

    def _drain(self, conn: psycopg.Connection[Any]) -> int:
        n = drain(conn, self.batch, self.stop_evt)
        self.stats.drained += n
        return n

    def _run_poll(self) -> None:
        with connect(self.dsn, "bench-worker-poll") as wc:
            self.ready.set()
            while not self.stop_evt.is_set():
                if self._drain(wc) == 0:
                    self.stop_evt.wait(0.01)

    def _run_naive(self) -> None:
        with connect(self.dsn, "bench-listener") as lc, connect(self.dsn, "bench-worker-naive") as wc:
            lc.execute("LISTEN outbox_naive")
            self.ready.set()
            while not self.stop_evt.is_set():
                self._drain(wc)
                if self._count(lc, self.wait_s, 1):
                    self.stats.wakeups += 1
                    self._count(lc, 0)  # everything else already queued
                else:
                    self.stats.timeouts += 1
            self._flush(lc)

    def _run_protocol(self) -> None:
        with connect(self.dsn, "bench-listener") as lc, connect(self.dsn, "bench-worker") as wc:
            lc.execute("LISTEN outbox")
            while not self.stop_evt.is_set():
                self._drain(wc)
                if self.stop_evt.is_set():
                    break
                # Going idle: waits while producers that skipped the NOTIFY are still open.
                t0 = time.perf_counter()
                wc.execute("SELECT outbox_worker_idle()")
                self.stats.idle_wait_s += time.perf_counter() - t0
                self.stats.idle_cycles += 1
                # Notifications already received come from transactions that committed before
                # now: the claim below sees their events, so they need no wakeup of their own.
                self._count(lc, 0)
                rows = wc.execute(CLAIM, (self.batch,)).fetchall()  # claim once more
                if rows:
                    wc.execute(COMPLETE, ([r[0] for r in rows], rows[0][1]))
                    self.stats.drained += len(rows)
                    wc.execute("SELECT outbox_worker_busy()")
                    continue
                self.ready.set()
                if self.on_idle:
                    self.on_idle()
                if self._count(lc, self.wait_s, 1):
                    t_notified = time.perf_counter()
                    self.stats.wakeups += 1
                    if self.on_notify:
                        self.on_notify(t_notified)
                else:
                    self.stats.timeouts += 1
                wc.execute("SELECT outbox_worker_busy()")
                if self.on_claimed:
                    rows = wc.execute(CLAIM, (self.batch,)).fetchall()
                    self.on_claimed(time.perf_counter(), len(rows))
                    if rows:
                        wc.execute(COMPLETE, ([r[0] for r in rows], rows[0][1]))
                        self.stats.drained += len(rows)
            self._flush(lc)


def start_worker(dsn: str, kind: str, **kw: Any) -> Worker:
    w = Worker(dsn, kind, **kw)
    _threads.append(w)
    w.start()
    if not w.ready.wait(30) or w.error:
        raise RuntimeError(f"worker {kind} did not start: {w.error!r}")
    return w


# --------------------------------------------------------------------------------------------
# A and B: claim + complete throughput


@dataclass
class LoopResult:
    events: int
    seconds: float
    calls: int
    claim_ms: float      # mean per non-empty claim call
    complete_ms: float   # mean per complete call
    cpu: dict[str, float] = field(default_factory=dict)
    server_cpu_us: float = 0.0   # CPU time of the server processes serving the loop, per event

    @property
    def rate(self) -> float:
        return self.events / self.seconds


def run_outbox_loop(dsn: str, dbname: str, n: int, batch: int, nconn: int, limit_s: float) -> LoopResult:
    barrier = threading.Barrier(nconn + 1)
    lock = threading.Lock()
    done = [0]
    per: list[tuple[int, int, float, float]] = []
    errors: list[BaseException] = []
    server_cpu = [0.0]

    def loop(i: int) -> None:
        calls = events = 0
        t_claim = t_complete = 0.0
        try:
            with connect(dsn, f"bench-claimer-{i}") as c:
                barrier.wait()
                cpu0 = backend_cpu_s(c)
                deadline = time.perf_counter() + limit_s
                while True:
                    t0 = time.perf_counter()
                    rows = c.execute(CLAIM, (batch,)).fetchall()
                    t1 = time.perf_counter()
                    if not rows:
                        # With 2 claimers, the other one may still hold the predecessor of an
                        # event (head of line per aggregate): stop only when everything is done.
                        with lock:
                            finished = done[0] >= n
                        if finished or nconn == 1 or time.perf_counter() > deadline:
                            break
                        time.sleep(0.0005)
                        continue
                    c.execute(COMPLETE, ([r[0] for r in rows], rows[0][1]))
                    t2 = time.perf_counter()
                    calls += 1
                    events += len(rows)
                    t_claim += t1 - t0
                    t_complete += t2 - t1
                    with lock:
                        done[0] += len(rows)
                    if time.perf_counter() > deadline:
                        break
                cpu1 = backend_cpu_s(c)
                if cpu0 is not None and cpu1 is not None:
                    with lock:
                        server_cpu[0] += cpu1 - cpu0
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
        finally:
            with lock:
                per.append((calls, events, t_claim, t_complete))

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(nconn)]
    for t in threads:
        t.start()
    wait_quiet()
    with CpuMeter(dbname) as cpu:
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"claim loop failed: {errors[0]!r}") from errors[0]
    calls = sum(p[0] for p in per)
    return LoopResult(events=done[0], seconds=seconds, calls=calls,
                      claim_ms=1000 * sum(p[2] for p in per) / max(calls, 1),
                      complete_ms=1000 * sum(p[3] for p in per) / max(calls, 1), cpu=cpu.result,
                      server_cpu_us=1e6 * server_cpu[0] / max(done[0], 1))


def run_bare_loop(dsn: str, dbname: str, admin: psycopg.Connection[Any], n: int, batch: int) -> LoopResult:
    admin.execute("DROP TABLE IF EXISTS bare_queue")
    admin.execute("CREATE TABLE bare_queue (id bigint PRIMARY KEY, status text NOT NULL, payload jsonb NOT NULL)")
    admin.execute("CREATE INDEX bare_queue_pending_idx ON bare_queue (id) WHERE status = 'pending'")
    admin.execute("INSERT INTO bare_queue SELECT i, 'pending', '{\"n\":1}' FROM generate_series(1, %s) AS i", (n,))
    admin.execute("VACUUM ANALYZE bare_queue")
    admin.execute("CHECKPOINT")
    calls = events = 0
    t_claim = t_complete = 0.0
    wait_quiet()
    with connect(dsn, "bench-bare") as c, CpuMeter(dbname) as cpu:
        cpu0 = backend_cpu_s(c)
        t_start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            ids = [r[0] for r in c.execute(
                "UPDATE bare_queue SET status = 'processing' WHERE id IN ("
                " SELECT id FROM bare_queue WHERE status = 'pending' ORDER BY id LIMIT %s"
                " FOR UPDATE SKIP LOCKED) RETURNING id", (batch,))]
            t1 = time.perf_counter()
            if not ids:
                break
            c.execute("UPDATE bare_queue SET status = 'done' WHERE id = ANY(%s)", (ids,))
            t2 = time.perf_counter()
            calls += 1
            events += len(ids)
            t_claim += t1 - t0
            t_complete += t2 - t1
        seconds = time.perf_counter() - t_start
        cpu1 = backend_cpu_s(c)
    admin.execute("DROP TABLE bare_queue")
    return LoopResult(events=events, seconds=seconds, calls=calls, cpu=cpu.result,
                      server_cpu_us=1e6 * (cpu1 - cpu0) / max(events, 1) if cpu0 is not None and cpu1 is not None else 0.0,
                      claim_ms=1000 * t_claim / max(calls, 1), complete_ms=1000 * t_complete / max(calls, 1))


# --------------------------------------------------------------------------------------------
# C: INSERT throughput with pgbench


@dataclass
class PgbenchResult:
    config: str
    clients: int
    tps: float
    transactions: int
    latency_ms: float
    worker: dict[str, Any] = field(default_factory=dict)
    backlog: int = 0    # events still pending when pgbench ended (and the worker stopped)
    round: int = 1
    cpu: dict[str, float] = field(default_factory=dict)


def run_pgbench(pgbench: str, dsn: str, clients: int, seconds: int) -> tuple[float, int, float]:
    p = conninfo_to_dict(dsn)
    cmd = [pgbench, "-n", "-M", "prepared", "-f", str(PGBENCH_SCRIPT), "-c", str(clients),
           "-j", str(min(2, clients)), "-T", str(seconds)]
    for opt, key in (("-h", "host"), ("-p", "port"), ("-U", "user")):
        if p.get(key):
            cmd += [opt, str(p[key])]
    cmd.append(str(p["dbname"]))
    env = dict(os.environ)
    if p.get("password"):
        env["PGPASSWORD"] = str(p["password"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _children.append(proc)
    try:
        out, err = proc.communicate(timeout=seconds + 120)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        _children.remove(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed ({proc.returncode}): {err.strip()}\n{out}")
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
    txs = re.search(r"number of transactions actually processed: (\d+)", out)
    lat = re.search(r"latency average = ([\d.]+) ms", out)
    failed = re.search(r"number of failed transactions: (\d+)", out)
    if not tps or not txs or not lat:
        raise RuntimeError(f"cannot parse pgbench output:\n{out}\n{err}")
    if failed and int(failed.group(1)):
        raise RuntimeError(f"pgbench reports failed transactions:\n{out}")
    return float(tps.group(1)), int(txs.group(1)), float(lat.group(1))


def pgbench_command(pgbench: str, seconds: int) -> str:
    return (f"{pgbench} -n -M prepared -f bench/{PGBENCH_SCRIPT.name} -c <clients> -j <min(2, clients)> "
            f"-T {seconds}")


C_CONFIGS = [
    # key, description, trigger mode, worker kind
    ("i", "no trigger", "none", None),
    ("i+w", "no trigger + polling worker", "none", "poll"),
    ("ii", "our trigger, no worker", "ours", None),
    ("iii", "our trigger + protocol worker", "ours", "protocol"),
    ("iv", "naive NOTIFY trigger + listening worker", "naive", "naive"),
]


def section_c(dsn: str, admin: psycopg.Connection[Any], dbname: str, pgbench: str,
              clients_list: list[int], seconds: int, rounds: int) -> list[PgbenchResult]:
    """Every configuration at every concurrency, ``rounds`` times, interleaved (a round runs all
    of them once), so that outside load that comes and goes does not land on one configuration
    only. The table reports the best round of each: outside load only ever lowers a figure."""
    results = []
    for rnd in range(1, rounds + 1):
        admin.execute("CHECKPOINT")
        for clients in clients_list:
            for key, desc, trigger, kind in C_CONFIGS:
                set_trigger_mode(admin, trigger)
                admin.execute("TRUNCATE outbox")
                worker = start_worker(dsn, kind) if kind else None
                try:
                    wait_quiet()
                    with CpuMeter(dbname) as cpu:
                        tps, txs, lat = run_pgbench(pgbench, dsn, clients, seconds)
                finally:
                    if worker:
                        worker.stop()
                backlog = admin.execute("SELECT count(*) FROM outbox WHERE state = 'pending'").fetchone()[0]
                r = PgbenchResult(key, clients, tps, txs, lat, asdict(worker.stats) if worker else {},
                                  backlog, rnd, cpu.result)
                results.append(r)
                extra = ""
                if worker:
                    st = worker.stats
                    extra = f"; worker drained {st.drained}, backlog {backlog}"
                    if kind != "poll":
                        extra += f", notified {st.notifications} ({100 * st.notifications / max(txs, 1):.1f}% of tx)"
                    if kind == "protocol":
                        extra += f", idle cycles {st.idle_cycles}"
                log(f"  C r{rnd} {key:<4} {clients:>2} clients: {tps:7.0f} tx/s (lat {lat:.2f} ms, "
                    f"foreign CPU {cpu.foreign:.0f}%){extra}")
    set_trigger_mode(admin, "ours")
    return results


# --------------------------------------------------------------------------------------------
# D: wake latency


def section_d(dsn: str, dbname: str, admin: psycopg.Connection[Any], samples: int,
              spacing_s: float) -> dict[str, Any]:
    set_trigger_mode(admin, "ours")
    reset_outbox(admin)
    idle = threading.Event()
    got = threading.Event()
    cur = [-1]
    notified: dict[int, float] = {}
    claimed: dict[int, tuple[float, int]] = {}

    def on_notify(t: float) -> None:
        if cur[0] >= 0 and cur[0] not in notified:
            notified[cur[0]] = t

    def on_claimed(t: float, nrows: int) -> None:
        if cur[0] >= 0 and cur[0] not in claimed:
            claimed[cur[0]] = (t, nrows)
        got.set()

    worker = start_worker(dsn, "protocol", on_idle=idle.set, on_notify=on_notify, on_claimed=on_claimed)
    committed: dict[int, float] = {}
    sent: dict[int, float] = {}
    insert_ms: list[float] = []
    missed = 0
    try:
        with connect(dsn, "bench-producer") as prod, CpuMeter(dbname) as cpu:
            for i in range(samples):
                if not idle.wait(5):
                    raise RuntimeError("worker did not go idle")
                time.sleep(spacing_s)
                idle.clear()
                got.clear()
                cur[0] = i
                t0 = time.perf_counter()
                prod.execute(INSERT_ONE, (str(i),))
                t1 = time.perf_counter()
                sent[i] = t0
                committed[i] = t1
                insert_ms.append(1000 * (t1 - t0))
                if not got.wait(3) or i not in notified:
                    missed += 1
                cur[0] = -1
    finally:
        worker.stop()
    lat = [1000 * (notified[i] - committed[i]) for i in committed if i in notified]
    from_send = [1000 * (notified[i] - sent[i]) for i in sent if i in notified]
    to_claim = [1000 * (claimed[i][0] - committed[i]) for i in committed if i in claimed and claimed[i][1] > 0]
    if not lat:
        raise RuntimeError("no notification was received")
    res = {
        "samples": samples, "received": len(lat), "missed": missed,
        "notify_p50_ms": statistics.median(lat), "notify_p99_ms": pct(lat, 99), "notify_max_ms": max(lat),
        "notify_min_ms": min(lat),
        "send_notify_p50_ms": statistics.median(from_send), "send_notify_p99_ms": pct(from_send, 99),
        "send_notify_max_ms": max(from_send),
        "claimed_p50_ms": statistics.median(to_claim) if to_claim else None,
        "claimed_p99_ms": pct(to_claim, 99) if to_claim else None,
        "claimed_max_ms": max(to_claim) if to_claim else None,
        "insert_commit_p50_ms": statistics.median(insert_ms),
        "worker": asdict(worker.stats), "cpu": cpu.result,
    }
    return res


# --------------------------------------------------------------------------------------------
# Environment


def environment(admin: psycopg.Connection[Any], dsn: str) -> dict[str, Any]:
    settings = dict(admin.execute(
        "SELECT name, current_setting(name) FROM pg_settings WHERE name IN "
        "('synchronous_commit', 'fsync', 'shared_buffers', 'autovacuum', 'max_connections', "
        "'wal_level', 'max_wal_size', 'checkpoint_timeout', 'jit')").fetchall())
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
            mem_gib = round(kb / 1024 / 1024, 1)
    except (OSError, StopIteration, ValueError):
        pass
    p = conninfo_to_dict(dsn)
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "server_version": admin.execute("SHOW server_version").fetchone()[0],
        "server": f"{p.get('host', 'local socket')}:{p.get('port', 5432)}",
        "cpus": os.cpu_count(), "mem_gib": mem_gib, "settings": settings,
    }


def machine_load(admin: psycopg.Connection[Any]) -> str:
    """Load average and other busy sessions on the server: noise from outside this benchmark."""
    others = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
        "AND state = 'active' AND pid <> pg_backend_pid() "
        "AND coalesce(application_name, '') NOT LIKE 'bench-%' "
        "AND coalesce(application_name, '') <> 'outboxpg-bench' "
        "AND application_name <> 'pgbench'").fetchone()[0]
    return f"loadavg {' '.join(f'{x:.2f}' for x in os.getloadavg())}, other active sessions {others}"


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller and shorter (about 1.5 minutes)")
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN",
                                                    "host=127.0.0.1 port=5432 user=postgres dbname=postgres"),
                    help="a server to create the bench database on (a superuser: CHECKPOINT, DROP ... FORCE)")
    ap.add_argument("--pgbench", default=os.environ.get("PGBENCH", "/usr/bin/pgbench"))
    ap.add_argument("--only", default="ABCD", help="sections to run, e.g. AB or CD (default ABCD)")
    ap.add_argument("--events", type=int, help="events pre-filled for A and rows for B "
                    "(default 200000, quick 20000)")
    ap.add_argument("--seconds", type=int, help="pgbench -T per run in C (default 8, quick 3)")
    ap.add_argument("--rounds", type=int, help="rounds of C, best taken (default 2, quick 1)")
    ap.add_argument("--quiet-wait", type=float, help="seconds in all (default 90, quick 0) that the run may "
                    "spend waiting, before a measurement, for other users of the machine to take < 10%% of its CPU")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    n = args.events or (20_000 if args.quick else 200_000)
    aggregates = 50_000
    seconds = args.seconds or (3 if args.quick else 8)
    rounds = args.rounds or (1 if args.quick else 2)
    samples = 50 if args.quick else 200
    only = args.only.upper()
    quiet_budget = args.quiet_wait if args.quiet_wait is not None else (0.0 if args.quick else 90.0)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    admin_dsn = args.dsn
    dbname = f"outboxpg_bench_{os.getpid()}"
    dsn = make_conninfo(admin_dsn, dbname=dbname)
    results: dict[str, Any] = {"mode": "quick" if args.quick else "full", "events": n,
                               "aggregates": aggregates, "pgbench_seconds": seconds,
                               "pgbench_rounds": rounds}
    started = time.perf_counter()
    global _quiet
    _quiet = QuietWaiter(dbname, quiet_budget) if quiet_budget > 0 else None
    with connect(admin_dsn, "outboxpg-bench") as server:
        server.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    try:
        schema.migrate(dsn)
        with connect(dsn, "outboxpg-bench") as admin:
            admin.execute(NAIVE_TRIGGER)
            env = environment(admin, dsn)
            results["environment"] = env
            log(f"outboxpg SQL-core benchmark ({results['mode']}), {env['date']}")
            log(f"PostgreSQL {env['server_version']} at {env['server']}, database {dbname}; "
                f"{env['cpus']} CPUs, {env['mem_gib']} GiB; "
                + ", ".join(f"{k}={v}" for k, v in sorted(env["settings"].items())))
            log(f"before: {machine_load(admin)}")

            if "A" in only:
                log(f"\nA. claim + complete, {n} pre-filled events, aggregate_id = i % {aggregates}")
                a = []
                for batch in (10, 100, 1000):
                    for nconn in (1, 2):
                        prefill_outbox(admin, n, aggregates)
                        r = run_outbox_loop(dsn, dbname, n, batch, nconn, limit_s=600)
                        left = admin.execute("SELECT count(*) FROM outbox WHERE state <> 'published'").fetchone()[0]
                        if r.events != n or left:
                            raise RuntimeError(f"claim loop handled {r.events} of {n} events, {left} not published")
                        a.append({"batch": batch, "connections": nconn, "events_per_s": r.rate, **asdict(r)})
                        log(f"  A batch {batch:>4}, {nconn} conn: {r.rate:8.0f} events/s  ({r.seconds:.1f} s; "
                            f"per call: claim {r.claim_ms:.2f} ms, complete {r.complete_ms:.2f} ms; "
                            f"server CPU {r.server_cpu_us:.0f} us/event; foreign CPU {r.cpu['foreign_pct']:.0f}%)")
                results["A"] = a
                admin.execute("TRUNCATE outbox")

            if "B" in only:
                log(f"\nB. bare loop on a plain table, {n} rows, batch 100, 1 connection; paired with "
                    "outbox claim+complete (batch 100, 1 conn) runs, alternating, best of each")
                bare_runs, outbox_runs, bare_cpu, outbox_cpu = [], [], [], []
                if "A" in results:
                    for x in results["A"]:
                        if x["batch"] == 100 and x["connections"] == 1:
                            outbox_runs.append(x["events_per_s"])
                            outbox_cpu.append(x["server_cpu_us"])
                for rep in range(2):
                    b = run_bare_loop(dsn, dbname, admin, n, 100)
                    bare_runs.append(b.rate)
                    bare_cpu.append(b.server_cpu_us)
                    log(f"  B bare loop:        {b.rate:8.0f} rows/s  ({b.seconds:.1f} s; per call: claim "
                        f"{b.claim_ms:.2f} ms, done {b.complete_ms:.2f} ms; server CPU {b.server_cpu_us:.0f} us/row; "
                        f"foreign CPU {b.cpu['foreign_pct']:.0f}%)")
                    if rep == 0 or not outbox_runs:
                        prefill_outbox(admin, n, aggregates)
                        r = run_outbox_loop(dsn, dbname, n, 100, 1, limit_s=600)
                        outbox_runs.append(r.rate)
                        outbox_cpu.append(r.server_cpu_us)
                        log(f"  B outbox (100, 1):  {r.rate:8.0f} events/s  ({r.seconds:.1f} s; per call: claim "
                            f"{r.claim_ms:.2f} ms, complete {r.complete_ms:.2f} ms; server CPU {r.server_cpu_us:.0f} "
                            f"us/event; foreign CPU {r.cpu['foreign_pct']:.0f}%)")
                admin.execute("TRUNCATE outbox")
                results["B"] = {"events_per_s": max(bare_runs), "bare_runs": bare_runs,
                                "outbox_100_1_runs": outbox_runs, "bare_server_cpu_us": bare_cpu,
                                "outbox_100_1_server_cpu_us": outbox_cpu}
                if all(bare_cpu) and all(outbox_cpu):
                    results["ratio_cpu_B_A100"] = min(bare_cpu) / min(outbox_cpu)
                results["ratio_A100_B"] = max(outbox_runs) / max(bare_runs)
                log(f"  ratio best outbox(100, 1 conn) / best bare loop = {100 * results['ratio_A100_B']:.0f}% "
                    "(target >= 70%)")

            if "C" in only:
                log(f"\nC. INSERT, one event per transaction: {pgbench_command(args.pgbench, seconds)}; "
                    f"{rounds} rounds")
                log(f"  ({machine_load(admin)})")
                results["C"] = [asdict(r) for r in section_c(dsn, admin, dbname, args.pgbench, [1, 8, 32],
                                                             seconds, rounds)]

            if "D" in only:
                log(f"\nD. wake latency, {samples} single inserts ~20 ms apart, protocol worker idle")
                d = section_d(dsn, dbname, admin, samples, 0.02)
                results["D"] = d
                log(f"  D commit -> notification: p50 {d['notify_p50_ms']:.2f} ms, p99 {d['notify_p99_ms']:.2f} ms, "
                    f"max {d['notify_max_ms']:.2f} ms ({d['received']}/{d['samples']} received; "
                    f"foreign CPU {d['cpu']['foreign_pct']:.0f}%)")
            log(f"after: {machine_load(admin)}")
    finally:
        for proc in list(_children):
            if proc.poll() is None:
                proc.terminate()
        for w in _threads:
            w.stop_evt.set()
        with connect(admin_dsn, "outboxpg-bench") as server:
            server.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))
    results["elapsed_s"] = time.perf_counter() - started
    results["quiet_waited_s"] = _quiet.waited if _quiet else 0.0
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


def print_table(r: dict[str, Any]) -> None:
    log("\n" + "=" * 78)
    env = r.get("environment", {})
    log(f"outboxpg SQL core, {r['mode']} run, {env.get('date', '?')}, PostgreSQL {env.get('server_version', '?')}, "
        f"{env.get('cpus', '?')} CPUs / {env.get('mem_gib', '?')} GiB, {r['elapsed_s']:.0f} s "
        f"({r.get('quiet_waited_s', 0):.0f} s of it waiting for a quiet machine)")
    log("foreign CPU = share of the machine's CPU used by other processes (not this run, not PostgreSQL's "
        "background processes) during a measurement; it lowers the figure it is shown with.")
    if "A" in r:
        log(f"\nA. claim + complete (events/s), {r['events']} events, aggregate_id = i % {r['aggregates']}"
            " [foreign CPU during the run] (server CPU us per event)")
        log(f"   {'batch':>6} | {'1 connection':>24} | {'2 connections':>24}")
        for batch in (10, 100, 1000):
            row = {x["connections"]: x for x in r["A"] if x["batch"] == batch}
            cells = [f"{row[k]['events_per_s']:>7.0f} [{row[k]['cpu'].get('foreign_pct', 0):>3.0f}%] "
                     f"({row[k].get('server_cpu_us', 0):>4.0f} us)" if k in row else "-" for k in (1, 2)]
            log(f"   {batch:>6} | {cells[0]:>24} | {cells[1]:>24}")
    if "B" in r:
        b = r["B"]
        log(f"\nB. bare loop (batch 100, 1 connection): {b['events_per_s']:.0f} rows/s (best of "
            + ", ".join(f"{x:.0f}" for x in b["bare_runs"]) + "); outbox (100, 1 conn) best of "
            + ", ".join(f"{x:.0f}" for x in b["outbox_100_1_runs"]))
        if "ratio_A100_B" in r:
            ratio = r["ratio_A100_B"]
            log(f"   outbox claim+complete (batch 100, 1 conn) / bare loop = {100 * ratio:.0f}%  "
                f"target >= 70%: {'met' if ratio >= 0.7 else 'MISSED'}")
        if "ratio_cpu_B_A100" in r:
            log(f"   server CPU per event: bare {min(b['bare_server_cpu_us']):.0f} us, outbox "
                f"{min(b['outbox_100_1_server_cpu_us']):.0f} us: the outbox does {100 * r['ratio_cpu_B_A100']:.0f}% "
                "of the bare loop's work per CPU second (a figure outside load hardly moves)")
    if "C" in r:
        log(f"\nC. INSERT tx/s, one event per transaction (pgbench -T {r['pgbench_seconds']}, best of "
            f"{r['pgbench_rounds']} round(s)) [foreign CPU during the best run]")
        keys = [k for k, *_ in C_CONFIGS]
        log("   " + f"{'clients':>7} | " + " | ".join(f"{k:>12}" for k in keys)
            + " | iii vs i+w | ii vs i | iv vs i+w")
        by: dict[tuple[str, int], dict[str, Any]] = {}
        for x in r["C"]:
            k = (x["config"], x["clients"])
            if k not in by or x["tps"] > by[k]["tps"]:
                by[k] = x
        for clients in sorted({x["clients"] for x in r["C"]}):
            tps = {k: by[(k, clients)]["tps"] for k in keys if (k, clients) in by}

            def cost(a: str, b: str) -> str:
                return f"{100 * (tps[a] / tps[b] - 1):+.1f}%" if a in tps and b in tps else "-"
            cells = [f"{by[(k, clients)]['tps']:>6.0f} [{by[(k, clients)]['cpu'].get('foreign_pct', 0):>2.0f}%]"
                     if (k, clients) in by else "-" for k in keys]
            log("   " + f"{clients:>7} | " + " | ".join(f"{c:>12}" for c in cells)
                + f" | {cost('iii', 'i+w'):>10} | {cost('ii', 'i'):>7} | {cost('iv', 'i+w'):>9}")
        log("   CPU per transaction, us (this run's processes: pgbench, its backends, the worker and its backends; "
            "plus PostgreSQL's background processes):")
        for clients in sorted({x["clients"] for x in r["C"]}):
            cells = []
            for k in keys:
                x = by.get((k, clients))
                if x and x["transactions"]:
                    us = 1e6 * (x["cpu"].get("mine_cpu_s", 0) + x["cpu"].get("pg_background_cpu_s", 0)) / x["transactions"]
                    cells.append(f"{us:>12.0f}")
                else:
                    cells.append(f"{'-':>12}")
            log("   " + f"{clients:>7} | " + " | ".join(cells))
        log("   i: no trigger; i+w: no trigger + polling draining worker; ii: our trigger, no worker;")
        log("   iii: our trigger + worker running the wakeup protocol; iv: naive pg_notify trigger + listening worker")
        notif = [x for x in by.values() if x["config"] in ("iii", "iv")]
        if notif:
            log("   notifying transactions (notifications received / transactions): " + ", ".join(
                f"{x['config']}@{x['clients']} {100 * x['worker']['notifications'] / max(x['transactions'], 1):.1f}%"
                for x in sorted(notif, key=lambda x: (x["config"], x["clients"]))))
        for clients in (8, 32):
            if ("iii", clients) in by and ("i+w", clients) in by:
                c = 1 - by[("iii", clients)]["tps"] / by[("i+w", clients)]["tps"]
                log(f"   wakeup cost at {clients} producers (iii vs i+w): {100 * c:.1f}%  target <= 10%: "
                    f"{'met' if c <= 0.10 else 'MISSED'}")
    if "D" in r:
        d = r["D"]
        log(f"\nD. wake latency [foreign CPU {d['cpu'].get('foreign_pct', 0):.0f}%], commit returned -> "
            f"notification received ({d['received']}/{d['samples']}): "
            f"p50 {d['notify_p50_ms']:.2f} ms, p99 {d['notify_p99_ms']:.2f} ms, max {d['notify_max_ms']:.2f} ms")
        log(f"   (min {d['notify_min_ms']:.2f} ms: the listener is signalled during COMMIT, before the producer "
            "has read the reply)")
        log(f"   INSERT sent -> notification received: p50 {d['send_notify_p50_ms']:.2f} ms, "
            f"p99 {d['send_notify_p99_ms']:.2f} ms, max {d['send_notify_max_ms']:.2f} ms "
            f"(the producer's INSERT+COMMIT round trip: p50 {d['insert_commit_p50_ms']:.2f} ms)")
        if d.get("claimed_p50_ms") is not None:
            log(f"   commit returned -> event claimed by the worker: p50 {d['claimed_p50_ms']:.2f} ms, "
                f"p99 {d['claimed_p99_ms']:.2f} ms, max {d['claimed_max_ms']:.2f} ms")
    log("=" * 78)


if __name__ == "__main__":
    sys.exit(main())
