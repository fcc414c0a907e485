"""Chaos soak: producers, three outboxpg-worker processes and seeded faults, then a checker.

    bin/soak --minutes 3 --seed 42          (python tools/soak.py ..., from the checkout)
    bin/soak --distributed --seconds 180 --seed 42   (root: a JetStream cluster, a replicated
                                            PostgreSQL, workers on hosts of their own; tools/soak_distributed.py)
    bin/soak --patroni --minutes 3 --seed 42    (PostgreSQL run by Patroni and etcd: switchovers and
                                            crash failovers; tools/soak_patroni.py)

Everything runs on throwaway servers started here (EmbeddedPostgres, EmbeddedNats) and everything
started here is stopped here. See RELIABILITY.md for what is injected, what is checked and how the
figures are measured. Exit code 0: every invariant held; 1: a violation; 2: the harness failed.

A tool beside the tests, not part of the installed package. ``FlakyPublisher`` is the
publisher the soak's workers load (``--publisher soak:FlakyPublisher``, this directory on their
PYTHONPATH): the real ``NatsPublisher`` behind a coin that fails a fraction
of events before they are published, configured through OUTBOXPG_SOAK_* environment variables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
from soak_patroni import PATRONI_KINDS

from outboxpg.events import runs_of
from outboxpg.relay.publishers import NotSent

FAULT_KINDS = ("kill9", "sigterm", "pg_terminate", "pg_restart_fast", "pg_restart_immediate",
               "nats_outage", "sigstop")
# --distributed: a 3-node JetStream cluster, a primary with a synchronous standby, workers on hosts
# of their own (network namespaces); these kinds join the ones above (but nats_outage: a node kill
# is the cluster's outage).
DISTRIBUTED_KINDS = ("nats_node_kill9", "nats_leader_kill9", "pg_failover", "net_cut_pg", "net_cut_nats",
                     "slow_publisher", "poison", "held_snapshot")
# --patroni: PostgreSQL run by Patroni (a leader and a synchronous standby, etcd); these kinds
# join the ones above but the restarts (Patroni restarts PostgreSQL itself).
PATRONI_BASE_KINDS = ("kill9", "sigterm", "pg_terminate", "nats_outage", "sigstop")
SUBJECT_PREFIX = "soak"
STREAM = "SOAK"
WORKER_APP = "soak-worker"
PRODUCER_APP = "soak-producer"


# --------------------------------------------------------------------------------------------
# The publisher inside the worker processes


class FlakyPublisher:
    """NatsPublisher that fails OUTBOXPG_SOAK_FAIL_RATE of events (RuntimeError outcome, never
    sent) and notes every injected failure and every PubAck with duplicate=True in
    OUTBOXPG_SOAK_STATS_DIR/pub-<pid>.log (one line each: survives kill -9)."""

    def __init__(self) -> None:
        from outboxpg.relay.nats.publisher import NatsPublisher

        self.fail_rate = float(os.environ.get("OUTBOXPG_SOAK_FAIL_RATE", "0.05"))
        self.rng = random.Random(f'{os.environ.get("OUTBOXPG_SOAK_SEED", "0")}-{os.getpid()}')
        self.inner = NatsPublisher(os.environ["OUTBOXPG_SOAK_NATS_URL"],
                                   ack_timeout=float(os.environ.get("OUTBOXPG_SOAK_ACK_TIMEOUT", "1.5")),
                                   on_duplicate=lambda seq: self._note(f"dup {seq}"))
        stats_dir = os.environ.get("OUTBOXPG_SOAK_STATS_DIR")
        self._stats = open(Path(stats_dir) / f"pub-{os.getpid()}.log", "a", buffering=1) if stats_dir else None
        # The slow_publisher fault: while this file holds a time (time.time()) still to come, each
        # batch waits 0.2 s .. OUTBOXPG_SOAK_SLOW_MAX s before it is published.
        worker = os.environ.get("OUTBOXPG_SOAK_WORKER", "")
        self._slow_flag = Path(stats_dir) / f"slow-{worker}" if stats_dir and worker else None
        self.slow_max = float(os.environ.get("OUTBOXPG_SOAK_SLOW_MAX", "5"))

    def _note(self, what: str) -> None:
        if self._stats is not None:
            self._stats.write(what + "\n")

    async def start(self) -> None:
        await self.inner.start()

    async def _maybe_slow(self) -> None:
        if self._slow_flag is None:
            return
        try:
            until = float(self._slow_flag.read_text())
        except (OSError, ValueError):
            return
        if time.time() < until:
            delay = self.rng.uniform(0.2, self.slow_max)
            self._note(f"slow {delay:.2f}")
            await asyncio.sleep(delay)

    async def publish_batch(self, events: Any) -> list[BaseException | None]:
        await self._maybe_slow()
        outcomes: list[BaseException | None] = [None] * len(events)
        keep = []
        # A failure ends its run: the aggregate's later events of the batch are not sent (as a
        # real publisher must do, or the stream would hold them before the failed one).
        for run in runs_of(events):
            for k, i in enumerate(run):
                if self.rng.random() < self.fail_rate:
                    outcomes[i] = RuntimeError("soak: injected publish failure")
                    self._note(f"fail {events[i].id}")
                    for rest in run[k + 1:]:
                        outcomes[rest] = NotSent("soak: an earlier event of its run failed")
                    break
                keep.append(i)
        keep.sort()
        if keep:
            results = await self.inner.publish_batch([events[i] for i in keep])
            for i, outcome in zip(keep, results):
                outcomes[i] = outcome
        return outcomes

    async def close(self) -> None:
        await self.inner.close()
        if self._stats is not None:
            self._stats.close()


# --------------------------------------------------------------------------------------------
# Bookkeeping


@dataclass
class Ledger:
    lock: threading.Lock = field(default_factory=threading.Lock)
    committed: dict[str, tuple[str, float]] = field(default_factory=dict)   # msg_id -> (aggregate, commit time)
    rolled_back: set[str] = field(default_factory=set)
    poison_dead: set[str] = field(default_factory=set)   # committed over max_payload: must die, unsent
    tx: Counter[str] = field(default_factory=Counter)

    def commit(self, events: list[tuple[str, str]], at: float, how: str) -> None:
        with self.lock:
            for msg_id, aggregate in events:
                self.committed[msg_id] = (aggregate, at)
            self.tx[how] += 1

    def roll_back(self, msg_ids: list[str], how: str) -> None:
        with self.lock:
            self.rolled_back.update(msg_ids)
            self.tx[how] += 1

    def snapshot(self) -> set[str]:
        with self.lock:
            return set(self.committed)


def say(text: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {text}", flush=True)


# --------------------------------------------------------------------------------------------
# Producers


def producer(idx: int, dsn: str, ledger: Ledger, stop: threading.Event, seed: int) -> None:
    from outboxpg import Event, enqueue, enqueue_many

    rng = random.Random(f"{seed}-producer-{idx}")
    conn: psycopg.Connection[Any] | None = None
    while not stop.is_set():
        n = rng.randint(1, 5)
        aggregates = [f"acct/hot-{rng.randrange(4)}" if rng.random() < 0.4 else f"order/cold-{rng.randrange(5000)}"
                      for _ in range(n)]
        rollback = rng.random() < 0.10
        hold = rng.uniform(1.0, 3.0) if rng.random() < 0.12 else 0.0
        use_copy = rng.random() < 0.5
        for _attempt in range(20):
            bid = uuid.uuid4().hex
            events = [(str(uuid.uuid4()), agg) for agg in aggregates]
            phase = "body"
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(dsn, application_name=PRODUCER_APP, connect_timeout=3)
                conn.execute("INSERT INTO soak_business (id, events) VALUES (%s, %s)", (bid, len(events)))
                items = [Event(agg.split("/")[0], agg.split("/")[1], "changed", {"tx": bid, "i": k}, msg_id=m)
                         for k, (m, agg) in enumerate(events)]
                if use_copy:
                    enqueue_many(conn, items)
                else:
                    for item in items:
                        enqueue(conn, item.aggregate_type, item.aggregate_id, item.event_type, item.payload,
                                msg_id=item.msg_id)
                if hold:
                    time.sleep(hold)
                if rollback:
                    conn.rollback()
                    ledger.roll_back([m for m, _ in events], "rolled_back")
                    break
                phase = "commit"
                before = time.time()
                conn.commit()
                ledger.commit(events, time.time(), "held_open_committed" if hold else "committed")
                break
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                if phase == "body":
                    # COMMIT was never sent: the server aborted it. Retry with fresh msg_ids.
                    ledger.roll_back([m for m, _ in events], "aborted_by_fault_retried")
                else:
                    committed = _resolve(dsn, bid, stop)
                    if committed is None:
                        ledger.roll_back([], "commit_unresolved")   # counted as a harness failure
                        with ledger.lock:
                            ledger.tx["unresolved_events"] += len(events)
                        break
                    if committed:
                        ledger.commit(events, before, "commit_unknown_was_committed")
                        break
                    ledger.roll_back([m for m, _ in events], "commit_unknown_was_rolled_back")
                time.sleep(0.2)
                if stop.is_set():
                    break
        time.sleep(rng.uniform(0.03, 0.3))
    if conn is not None:
        conn.close()


def _row(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> tuple[Any, ...]:
    """The one row ``query`` returns."""
    row: tuple[Any, ...] | None = conn.execute(query, params).fetchone()
    assert row is not None, query
    return row


def _resolve(dsn: str, bid: str, stop: threading.Event) -> bool | None:
    """Did the transaction that wrote business row ``bid`` commit? Asks until PostgreSQL answers (60 s)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            with psycopg.connect(dsn, application_name=PRODUCER_APP, connect_timeout=3, autocommit=True) as c:
                return bool(_row(c, "SELECT EXISTS (SELECT 1 FROM soak_business WHERE id = %s)", (bid,))[0])
        except psycopg.Error:
            time.sleep(0.3)
    return None


# --------------------------------------------------------------------------------------------
# Workers


class Workers:
    def __init__(self, count: int, dsn: str, nats_url: str, workdir: Path, seed: int, args: argparse.Namespace,
                 prefixes: list[list[str]] | None = None) -> None:
        self.binary = str(Path(sys.executable).parent / "outboxpg-worker")
        self.dsn, self.workdir, self.args = dsn, workdir, args
        # Worker i runs under prefixes[i] (``ip netns exec <its host>`` with --distributed).
        self.prefixes = prefixes or [[] for _ in range(count)]
        self.env = {**os.environ, "OUTBOXPG_SOAK_NATS_URL": nats_url, "OUTBOXPG_SOAK_SEED": str(seed),
                    "OUTBOXPG_SOAK_FAIL_RATE": str(args.fail_rate),
                    "OUTBOXPG_SOAK_ACK_TIMEOUT": str(args.publish_timeout),
                    "OUTBOXPG_SOAK_SLOW_MAX": str(args.lease + 1.0),
                    "OUTBOXPG_SOAK_STATS_DIR": str(workdir),
                    # The workers load FlakyPublisher from this file: --publisher soak:FlakyPublisher.
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                                os.environ.get("PYTHONPATH")]))}
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * count
        self.spawns = [0] * count
        self.expected_exit: set[int] = set()       # pids the soak itself signalled
        self.exits: list[tuple[str, int, int, bool]] = []   # (name, pid, rc, expected)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="soak-supervisor", daemon=True)

    def name(self, i: int) -> str:
        return f"w{i + 1}"

    def spawn(self, i: int) -> None:
        self.spawns[i] += 1
        log = (self.workdir / f"{self.name(i)}.{self.spawns[i]}.log").open("wb")
        a = self.args
        self.procs[i] = subprocess.Popen(
            [*self.prefixes[i], self.binary, "--dsn", self.dsn, "--name", self.name(i), "--batch-size", "50",
             "--concurrency", "2",
             "--lease", str(a.lease), "--publish-timeout", str(a.publish_timeout), "--poll-interval", "2",
             "--summary-interval", "10", "--publisher", "soak:FlakyPublisher"],
            stdout=log, stderr=subprocess.STDOUT, env={**self.env, "OUTBOXPG_SOAK_WORKER": self.name(i)})
        log.close()

    def start(self) -> None:
        for i in range(len(self.procs)):
            self.spawn(i)
        self._thread.start()

    def _supervise(self) -> None:
        while not self.stopping.is_set():
            with self.lock:
                for i, p in enumerate(self.procs):
                    if p is not None and p.poll() is not None:
                        expected = p.pid in self.expected_exit
                        self.exits.append((self.name(i), p.pid, p.returncode, expected))
                        if not expected:
                            say(f"worker {self.name(i)} pid {p.pid} exited by itself with {p.returncode}")
                        self.spawn(i)
            time.sleep(0.2)

    def pick(self, rng: random.Random) -> tuple[int, subprocess.Popen[bytes]]:
        with self.lock:
            alive = [(i, p) for i, p in enumerate(self.procs) if p is not None and p.poll() is None]
        return rng.choice(alive)

    def signal(self, proc: subprocess.Popen[bytes], sig: int, ends_it: bool) -> None:
        if ends_it:
            self.expected_exit.add(proc.pid)
        proc.send_signal(sig)

    def stop_all(self) -> None:
        self.stopping.set()
        self._thread.join(5)
        for p in self.procs:
            if p is not None and p.poll() is None:
                self.expected_exit.add(p.pid)
                p.send_signal(signal.SIGCONT)
                p.send_signal(signal.SIGTERM)
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            self.exits.append((self.name(i), p.pid, p.returncode, True))


# --------------------------------------------------------------------------------------------
# Recovery monitor


@dataclass
class FaultRecord:
    kind: str
    injected: float
    lifted: float = 0.0
    waiting: set[str] = field(default_factory=set)
    recovered: float | None = None
    detail: str = ""
    armed: bool = False          # set at the moment the fault strikes; the monitor watches from then


def monitor(dsn: str, faults: list[FaultRecord], lock: threading.Lock, stop: threading.Event) -> None:
    """Marks a fault recovered once every event committed before it was injected is published."""
    conn: psycopg.Connection[Any] | None = None
    while not stop.is_set():
        time.sleep(0.25)
        with lock:
            open_faults = [f for f in faults if f.recovered is None and f.armed]
        if not open_faults:
            continue
        try:
            if conn is None or conn.closed:
                conn = psycopg.connect(dsn, application_name="soak-monitor", connect_timeout=2, autocommit=True)
            unpublished = {r[0] for r in conn.execute("SELECT msg_id FROM outbox WHERE state <> 'published'")}
        except psycopg.Error:
            if conn is not None:
                conn.close()
            conn = None
            continue
        now = time.monotonic()
        with lock:
            for f in open_faults:
                if not (f.waiting & unpublished):
                    f.recovered = now
    if conn is not None:
        conn.close()


# --------------------------------------------------------------------------------------------
# The run


def _setup(dsn: str, nats_url: str, replicas: int = 1) -> None:
    from outboxpg import schema

    schema.migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE soak_business (id text PRIMARY KEY, events int NOT NULL, at timestamptz DEFAULT now())")
        # Fast retries, and enough attempts that nothing dies of the injected faults alone.
        c.execute("UPDATE outbox_settings SET subject_prefix = %s, backoff_base = '100 milliseconds', "
                  "backoff_cap = '2 seconds', max_attempts = 1000", (SUBJECT_PREFIX,))

    async def make_stream() -> None:
        import nats
        from nats.js.api import StreamConfig
        from nats.js.errors import Error as JsError

        nc = await nats.connect(servers=nats_url.split(","))
        try:
            # A cluster that has just started may have no meta leader yet: ask again for 30 s.
            deadline = time.monotonic() + 30
            while True:
                try:
                    await nc.jetstream().add_stream(StreamConfig(name=STREAM, subjects=[f"{SUBJECT_PREFIX}.>"],
                                                                 duplicate_window=600, num_replicas=replicas))
                    return
                except (JsError, TimeoutError, nats.errors.Error):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()

    asyncio.run(make_stream())


@dataclass
class Rig:
    """The servers the soak runs on: single ones, or (--distributed) a replicated PostgreSQL, a
    JetStream cluster and hosts for the workers."""
    admin_dsn: str            # the soak's own connections (producers, monitor, chaos, checker)
    worker_dsn: str
    nats_url: str             # comma-separated with a cluster
    workdir: Path
    pg: Any = None            # EmbeddedPostgres (single)
    ns: Any = None            # EmbeddedNats (single)
    replicated: Any = None    # soak_distributed.ReplicatedPg
    cluster: Any = None       # soak_distributed.NatsCluster
    hosts: Any = None         # soak_distributed.Hosts
    patroni: Any = None       # tests/patroni.py's PatroniCluster (--patroni)

    def primary(self) -> Any:
        return self.replicated.primary if self.replicated is not None else self.pg


def catch_mid_batch(proc: subprocess.Popen[bytes], name: str, admin_dsn: str, limit: float = 3.0) -> int:
    """Leave ``proc`` SIGSTOPped, if possible at a moment it holds leases (mid-batch): stop it,
    look, let it go on if it holds none, and try again for up to ``limit`` seconds. Returns
    the number of leases it holds (0: it was idle every time; it is stopped all the same)."""
    end = time.monotonic() + limit
    held = 0
    try:
        with psycopg.connect(admin_dsn, autocommit=True, application_name="soak-chaos", connect_timeout=3) as c:
            while True:
                proc.send_signal(signal.SIGSTOP)
                held = int(_row(c, "SELECT count(*) FROM outbox WHERE state = 'processing' AND locked_by = %s "
                                   "AND locked_until > now()", (name,))[0])
                if held or time.monotonic() > end:
                    return held
                proc.send_signal(signal.SIGCONT)
                time.sleep(0.02)
    except psycopg.Error:
        proc.send_signal(signal.SIGSTOP)
        return held




def inject(kind: str, rng: random.Random, workers: Workers, rig: Rig, lease: float, rec: FaultRecord,
           ledger: Ledger) -> None:
    admin_dsn = rig.admin_dsn
    if kind in ("kill9", "sigterm", "sigstop"):
        i, proc = workers.pick(rng)
        rec.detail = f"{workers.name(i)} pid {proc.pid}"
        if kind == "kill9":
            held = catch_mid_batch(proc, workers.name(i), admin_dsn)
            rec.injected, rec.waiting, rec.armed = time.monotonic(), ledger.snapshot(), True
            workers.signal(proc, signal.SIGKILL, True)
            rec.detail += f" holding {held} leases"
        elif kind == "sigterm":
            rec.armed = True
            workers.signal(proc, signal.SIGTERM, True)
            t0 = time.monotonic()
            try:
                rc = proc.wait(15)
                rec.detail += f" exited {rc} after {time.monotonic() - t0:.2f}s"
            except subprocess.TimeoutExpired:
                rec.detail += " did not exit within 15s"
        else:
            pause = lease + rng.uniform(1.0, 2.0)
            held = catch_mid_batch(proc, workers.name(i), admin_dsn)
            # The pause starts now, not when the hunt for leases began.
            rec.injected, rec.waiting, rec.armed = time.monotonic(), ledger.snapshot(), True
            time.sleep(pause)
            proc.send_signal(signal.SIGCONT)
            rec.detail += f" holding {held} leases, paused {pause:.1f}s"
    elif kind == "pg_terminate":
        with psycopg.connect(admin_dsn, autocommit=True, application_name="soak-chaos") as c:
            rec.armed = True
            n = _row(c, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = %s", (WORKER_APP,))[0]
        rec.detail = f"{n} worker connections"
    elif kind.startswith("pg_restart_"):
        t0 = time.monotonic()
        rec.armed = True
        rig.primary().restart(kind.removeprefix("pg_restart_"))
        rec.detail = f"down/up in {time.monotonic() - t0:.2f}s"
    elif kind == "nats_outage":
        down = rng.uniform(2.0, 4.0)
        rec.armed = True
        rig.ns.stop()
        time.sleep(down)
        rig.ns.start()
        rec.detail = f"down {down:.1f}s"
    elif kind in ("nats_node_kill9", "nats_leader_kill9"):
        from soak_distributed import stream_leader

        cluster = rig.cluster
        try:
            leader = asyncio.run(stream_leader(rig.nats_url, STREAM))
        except Exception:  # noqa: BLE001 - no answer is an answer: no known leader right now
            leader = None
        nodes = list(range(len(cluster.procs)))
        if kind == "nats_leader_kill9" and leader is not None:
            victim = cluster.index_of(leader)
        else:
            others = [i for i in nodes if leader is None or cluster.server_name(i) != leader]
            victim = rng.choice(others)
        down = rng.uniform(2.0, 4.0)
        rec.armed = True
        cluster.kill_node(victim)
        time.sleep(down)
        t0 = time.monotonic()
        cluster.start_node(victim)
        role = "stream leader" if cluster.server_name(victim) == leader else "follower"
        rec.detail = (f"{cluster.server_name(victim)} ({role}{', leader unknown' if leader is None else ''}) "
                      f"SIGKILLed, down {down:.1f}s, "
                      f"back in {time.monotonic() - t0:.2f}s")
    elif kind == "pg_failover":
        rec.armed = True
        rec.detail = rig.replicated.fail_over(rng.uniform(0.5, 2.0))
    elif kind in PATRONI_KINDS:
        import soak_patroni

        rec.armed = True
        rec.detail = soak_patroni.inject(kind, rig.patroni, ledger.commit)
    elif kind in ("net_cut_pg", "net_cut_nats"):
        # Cut a worker's host off while it holds leases where possible (caught as kill9 does):
        # its reports for them hang until the link is back, long after the leases expired and
        # other workers took the events over; then they must change nothing (fencing).
        i, proc = workers.pick(rng)
        service = rig.hosts.pg_addr if kind == "net_cut_pg" else rig.hosts.nats_addr
        cut = lease + rng.uniform(1.5, 3.0)
        held = catch_mid_batch(proc, workers.name(i), admin_dsn)
        rec.injected, rec.waiting, rec.armed = time.monotonic(), ledger.snapshot(), True
        try:
            rig.hosts.cut(i, service)
        finally:
            proc.send_signal(signal.SIGCONT)
        try:
            time.sleep(cut)
        finally:
            rig.hosts.restore(i, service)
        rec.detail = (f"{workers.name(i)} ({rig.hosts.netns(i)}) holding {held} leases cut from "
                      f"{'PostgreSQL' if kind == 'net_cut_pg' else 'NATS'} for {cut:.1f}s (lease {lease:g}s)")
    elif kind == "slow_publisher":
        i = rng.randrange(len(workers.procs))
        window = lease + rng.uniform(2.0, 4.0)
        flag = rig.workdir / f"slow-{workers.name(i)}"
        rec.armed = True
        flag.write_text(str(time.time() + window))
        try:
            time.sleep(window)
        finally:
            flag.unlink(missing_ok=True)
        rec.detail = f"{workers.name(i)}: each batch waits 0.2-{lease + 1:g}s before publishing, for {window:.1f}s"
    elif kind == "poison":
        rec.armed = True
        rec.detail = _poison(admin_dsn, rig.nats_url, ledger)
    elif kind == "held_snapshot":
        hold = rng.uniform(1.5 * lease, 2.5 * lease)
        with psycopg.connect(admin_dsn, autocommit=True, application_name="soak-snapshot") as c:
            c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            c.execute("SELECT count(*) FROM outbox")          # takes the snapshot; then idle
            rec.armed = True
            time.sleep(hold)
            c.execute("ROLLBACK")
        rec.detail = f"REPEATABLE READ snapshot held idle {hold:.1f}s"
    else:
        raise ValueError(kind)


def _poison(admin_dsn: str, nats_url: str, ledger: Ledger) -> str:
    """One transaction: two events whose messages come just under the server's max_payload
    (they must be delivered) and one just over it (it must die at once, unsent, and block
    nothing: each on an aggregate of its own), with outbox_settings.max_event_bytes raised to
    let them in."""
    import nats

    from outboxpg import Event, enqueue_many

    async def max_payload() -> int:
        nc = await nats.connect(servers=nats_url.split(","))
        try:
            return int(nc.max_payload)
        finally:
            await nc.close()

    limit = asyncio.run(max_payload())
    under = [(str(uuid.uuid4()), f"poison/fits-{uuid.uuid4().hex[:8]}") for _ in range(2)]
    over = (str(uuid.uuid4()), f"poison/over-{uuid.uuid4().hex[:8]}")
    # The headers (msg_id, ids, aggregate, trace) take a few hundred bytes: 2 KiB under is near.
    items = [Event("poison", agg.split("/")[1], "big", {"pad": "u" * (limit - 2048)}, msg_id=m) for m, agg in under]
    items.append(Event("poison", over[1].split("/")[1], "big", {"pad": "o" * (limit + 512)}, msg_id=over[0]))
    with psycopg.connect(admin_dsn, application_name=PRODUCER_APP) as c:
        # Near max_payload is over max_event_bytes' default (1,000,000): raised, as an operator
        # would for events this large; the one over max_payload must still die at the worker.
        c.execute("UPDATE outbox_settings SET max_event_bytes = greatest(max_event_bytes, %s)", (2 * limit,))
        enqueue_many(c, items)
        c.commit()
    ledger.commit(under, time.time(), "poison_committed")
    with ledger.lock:
        ledger.poison_dead.add(over[0])
    return f"2 events of ~{limit - 2048} bytes, 1 of {limit + 512} (max_payload {limit})"


def kinds_for(args: argparse.Namespace) -> tuple[str, ...]:
    available = (tuple(k for k in FAULT_KINDS if k != "nats_outage") + DISTRIBUTED_KINDS
                 if args.distributed else PATRONI_BASE_KINDS + PATRONI_KINDS if args.patroni else FAULT_KINDS)
    if not args.kinds:
        return available
    wanted = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = [k for k in wanted if k not in available]
    if unknown or not wanted:
        more = "" if args.distributed or args.patroni else " (more with --distributed or --patroni)"
        raise ValueError(f"--kinds: {', '.join(unknown) or 'none given'} not among {', '.join(available)}{more}")
    return wanted


def run(args: argparse.Namespace) -> int:
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    kinds = kinds_for(args)
    if args.distributed:
        import soak_distributed

        try:
            soak_distributed.check_available()
        except soak_distributed.Unavailable as e:
            print(f"soak: {e}", file=sys.stderr, flush=True)
            return 2
        for what in soak_distributed.sweep_stale():
            say(f"removed {what} left by a soak no longer running")
    if args.patroni:
        import soak_patroni

        _bins, why = soak_patroni.helpers().find_patroni()
        if not _bins:
            print(f"soak: {why}", file=sys.stderr, flush=True)
            return 2
    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="outboxpg-soak-"))
    say(f"seed={args.seed} run={duration:g}s workers={args.workers} producers={args.producers} "
        f"lease={args.lease}s publish_timeout={args.publish_timeout}s fail_rate={args.fail_rate} "
        f"distributed={'yes' if args.distributed else 'no'} patroni={'yes' if args.patroni else 'no'} "
        f"logs={workdir}")
    ledger = Ledger()
    faults: list[FaultRecord] = []
    flock = threading.Lock()
    stop_producers, stop_monitor = threading.Event(), threading.Event()
    with contextlib.ExitStack() as servers:
        rig = _servers(servers, args, workdir)
        say(f"servers: {rig.admin_dsn} / {rig.nats_url}")
        _setup(rig.admin_dsn, rig.nats_url, replicas=3 if args.distributed else 1)
        prefixes = [rig.hosts.exec_prefix(i) for i in range(args.workers)] if rig.hosts is not None else None
        workers = Workers(args.workers, rig.worker_dsn, rig.nats_url, workdir, args.seed, args, prefixes)
        threads: list[threading.Thread] = []
        mon = threading.Thread(target=monitor, args=(rig.admin_dsn, faults, flock, stop_monitor), daemon=True)
        try:
            workers.start()
            mon.start()
            for k in range(args.producers):
                t = threading.Thread(target=producer, args=(k, rig.admin_dsn, ledger, stop_producers, args.seed),
                                     name=f"soak-producer-{k}", daemon=True)
                t.start()
                threads.append(t)
            t_start = time.monotonic()
            end = t_start + duration
            # Every kind once, in a seeded order, then seeded random kinds until the time is up.
            schedule = list(kinds)
            rng.shuffle(schedule)
            gap = min(12.0, max(2.0, (duration - 8.0) / (len(kinds) + 2)))
            time.sleep(min(3.0, duration / 10))
            while schedule or time.monotonic() < end:
                kind = schedule.pop(0) if schedule else rng.choice(kinds)
                rec = FaultRecord(kind, time.monotonic(), waiting=ledger.snapshot())
                with flock:
                    faults.append(rec)   # watched by the monitor from the moment inject() arms it
                inject(kind, rng, workers, rig, args.lease, rec, ledger)
                rec.lifted = time.monotonic()
                say(f"fault {len(faults):3d} {kind:21s} {rec.detail}")
                if not schedule and time.monotonic() + gap * 0.5 >= end:
                    break
                time.sleep(gap * rng.uniform(0.5, 1.5))
            ran_for = time.monotonic() - t_start
            stop_producers.set()
            for t in threads:
                t.join(30)
            say(f"producers stopped after {ran_for:.1f}s; draining (at most {args.drain:g}s)")
            drained, drain_time = _drain(rig.admin_dsn, len(ledger.committed), args.drain, ledger.poison_dead)
            say(f"drain {'done' if drained else 'TIMED OUT'} in {drain_time:.1f}s")
            time.sleep(0.6)   # the recovery monitor's last look (it polls every 0.25 s)
            stop_monitor.set()
            mon.join(5)
        finally:
            stop_producers.set()
            stop_monitor.set()
            workers.stop_all()
        report = asyncio.run(check(rig.admin_dsn, rig.nats_url, ledger, faults, workers, workdir, ran_for, drained,
                                   drain_time, kinds, args.seed))
    print(report["table"], flush=True)
    print("SOAK_RESULT " + json.dumps({k: v for k, v in report.items() if k != "table"}), flush=True)
    ok = report["ok"]
    if ok and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        say(f"worker logs kept in {workdir}")
    return 0 if ok else 1


def _servers(stack: contextlib.ExitStack, args: argparse.Namespace, workdir: Path) -> Rig:
    """Start the servers (stopped and removed by ``stack``, in the reverse order)."""
    if args.patroni:
        import soak_patroni

        from outboxpg.embedded import EmbeddedNats

        patroni = soak_patroni.start_cluster()
        stack.callback(patroni.stop)
        ns = stack.enter_context(EmbeddedNats())
        dsn = soak_patroni.dsn(patroni)
        return Rig(dsn, f"{dsn} application_name={WORKER_APP}", ns.url, workdir, ns=ns, patroni=patroni)
    if not args.distributed:
        from outboxpg.embedded import EmbeddedNats, EmbeddedPostgres

        # EmbeddedPostgres commits synchronously: an immediate-mode restart forgets no acknowledged
        # commit, so any loss the checker finds is outboxpg's.
        pg = stack.enter_context(EmbeddedPostgres())
        ns = stack.enter_context(EmbeddedNats())
        return Rig(pg.dsn, f"{pg.dsn} application_name={WORKER_APP}", ns.url, workdir, pg=pg, ns=ns)
    from soak_distributed import Hosts, NatsCluster, ReplicatedPg

    hosts = stack.enter_context(Hosts(args.workers))
    # Synchronous replication: a COMMIT is acknowledged once the standby has its WAL, so the
    # promotion loses no acknowledged commit and the ledger needs no allowance for lost ones.
    replicated = stack.enter_context(ReplicatedPg(hosts.pg_addr, f"10.{hosts.net}.0.0/16"))
    cluster = stack.enter_context(NatsCluster(hosts.nats_addr))
    return Rig(replicated.dsn("127.0.0.1"), f"{replicated.dsn(hosts.pg_addr)} application_name={WORKER_APP}",
               cluster.url, workdir, replicated=replicated, cluster=cluster, hosts=hosts)


def _drain(dsn: str, committed: int, limit: float, expected_dead: set[str]) -> tuple[bool, float]:
    t0 = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as c:
        while time.monotonic() - t0 < limit:
            published, unfinished = _row(
                c, "SELECT count(*) FILTER (WHERE state = 'published'), "
                   "count(*) FILTER (WHERE state IN ('pending', 'processing', 'dead') "
                   "AND NOT (msg_id::text = ANY(%s))) FROM outbox", (list(expected_dead),))
            if unfinished == 0 and published >= committed:
                return True, time.monotonic() - t0
            time.sleep(0.25)
    return False, time.monotonic() - t0


# --------------------------------------------------------------------------------------------
# The checker


async def read_all(nats_url: str) -> list[tuple[int, str, int, str, datetime | None]]:
    """(seq, msg_id, outbox id, aggregate, stream timestamp) of every message, in stream order."""
    import nats

    nc = await nats.connect(servers=nats_url.split(","))
    try:
        js = nc.jetstream()
        info = await js.stream_info(STREAM)
        out: list[tuple[int, str, int, str, datetime | None]] = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            m = await js.get_msg(STREAM, seq)
            h = m.headers or {}
            assert m.seq is not None
            out.append((m.seq, h["Nats-Msg-Id"], int(h["Outbox-Id"]),
                        f'{h["Outbox-Aggregate-Type"]}/{h["Outbox-Aggregate-Id"]}', m.time))
        return out
    finally:
        await nc.close()


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))]


async def check(dsn: str, nats_url: str, ledger: Ledger, faults: list[FaultRecord], workers: Workers,
                workdir: Path, ran_for: float, drained: bool, drain_time: float,
                kinds: tuple[str, ...] = FAULT_KINDS, seed: int | None = None) -> dict[str, Any]:
    msgs = await read_all(nats_url)
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute("SELECT msg_id, id, aggregate_type || '/' || aggregate_id, state::text, attempts "
                         "FROM outbox").fetchall()
        business = _row(c, "SELECT count(*), coalesce(sum(events), 0) FROM soak_business")
    db = {r[0]: r for r in rows}
    committed, rolled_back, poison = ledger.committed, ledger.rolled_back, ledger.poison_dead
    stream_ids = Counter(m[1] for m in msgs)
    states = Counter(r[3] for r in rows if r[0] not in poison)

    inv: list[tuple[str, bool, str]] = []

    def invariant(name: str, ok: bool, detail: str) -> None:
        inv.append((name, ok, detail))

    lost = [m for m in committed if m not in stream_ids]
    invariant("every committed event is in the stream", not lost,
              f"{len(lost)} missing" + (f", e.g. {lost[:3]}" if lost else ""))
    ghosts = [m for m in rolled_back if m in stream_ids or m in db]
    invariant("no rolled-back event in stream or outbox", not ghosts,
              f"{len(ghosts)} found" + (f", e.g. {ghosts[:3]}" if ghosts else ""))
    strangers = [m for m in stream_ids if m not in committed]
    invariant("stream holds only committed events", not strangers, f"{len(strangers)} unknown msg_ids")
    dups = {m: n for m, n in stream_ids.items() if n > 1}
    invariant("each msg_id exactly once in the stream", not dups, f"{len(dups)} msg_ids stored more than once")
    last: dict[str, tuple[int, int]] = {}
    disorder = []
    for seq, _msg_id, oid, agg, _ in msgs:
        if agg in last and oid <= last[agg][0]:
            disorder.append((agg, last[agg], (oid, seq)))
        last[agg] = (oid, seq)
    invariant("per aggregate, stream order = id order", not disorder,
              f"{len(disorder)} out of order" + (f", e.g. {disorder[:3]}" if disorder else ""))
    mismatched = [m for seq, m, oid, agg, _ in msgs if m in db and (db[m][1] != oid or db[m][2] != agg)]
    invariant("stream headers match the outbox row", not mismatched, f"{len(mismatched)} mismatched")
    poison_wrong = [m for m in poison if m in stream_ids or m not in db or db[m][3] != "dead"]
    invariant("poison over max_payload: dead, not in stream", not poison_wrong,
              f"{len(poison)} poison events, {len(poison_wrong)} not dead or in the stream")
    unfinished = {s: n for s, n in states.items() if s != "published"}
    invariant("outbox: nothing pending, processing or dead", not unfinished and drained,
              f"states {dict(states)}, drained in {drain_time:.1f}s" if drained else f"NOT drained: {dict(states)}")
    not_in_db = [m for m in committed if m not in db]
    extra_in_db = [m for m in db if m not in committed and m not in poison]
    invariant("outbox rows = events the producers saw commit", not not_in_db and not extra_in_db,
              f"{len(not_in_db)} committed but absent, {len(extra_in_db)} present but not recorded")
    unresolved = ledger.tx["unresolved_events"]
    invariant("every unknown COMMIT outcome resolved", unresolved == 0, f"{unresolved} events unresolved")

    # Figures.
    commit_at = {m: t for m, (_, t) in committed.items()}
    lat = [m[4].timestamp() - commit_at[m[1]] for m in msgs if m[1] in commit_at and m[4] is not None]
    injected_fail = dup_acks = 0
    for f in workdir.glob("pub-*.log"):
        for line in f.read_text().splitlines():
            injected_fail += line.startswith("fail ")
            dup_acks += line.startswith("dup ")
    handouts = sum(r[4] for r in rows)
    worker_errors: Counter[str] = Counter()
    for log_file in workdir.glob("w*.log"):
        text = log_file.read_text(errors="replace")
        worker_errors["Traceback"] += text.count("Traceback")
        worker_errors["level=ERROR"] += text.count("level=ERROR")
        worker_errors["event=lease_lost"] += text.count("event=lease_lost")
    unexpected_exits = [e for e in workers.exits if not e[3]]
    by_kind: dict[str, list[FaultRecord]] = defaultdict(list)
    for fault in faults:
        by_kind[fault.kind].append(fault)
    # Worst commit->stream latency around each fault: events committed from 1 s before it struck
    # until 1 s after it was lifted or recovered (whichever came later).
    to_wall = time.time() - time.monotonic()
    latency_of = [(commit_at[m[1]], m[4].timestamp() - commit_at[m[1]])
                  for m in msgs if m[1] in commit_at and m[4] is not None]

    def worst_around(f: FaultRecord) -> float:
        start = f.injected + to_wall - 1.0
        stop = max(f.lifted, f.recovered or f.lifted) + to_wall + 1.0
        return max((lag for at, lag in latency_of if start <= at <= stop), default=0.0)

    worst_by_kind = {k: max((worst_around(f) for f in v), default=0.0) for k, v in by_kind.items()}

    lines: list[str] = []
    w = lines.append
    w("")
    w("=" * 78)
    w(f"outboxpg chaos soak: seed {seed}, ran {ran_for:.1f}s, drain {drain_time:.1f}s")
    w("-" * 78)
    w(f"{'transactions committed':44s} {ledger.tx['committed'] + ledger.tx['held_open_committed']:>10d}")
    w(f"{'  of which held open 1-3 s':44s} {ledger.tx['held_open_committed']:>10d}")
    w(f"{'  of which COMMIT outcome unknown -> found':44s} {ledger.tx['commit_unknown_was_committed']:>10d}")
    w(f"{'transactions rolled back (deliberately)':44s} {ledger.tx['rolled_back']:>10d}")
    w(f"{'transactions aborted by a fault (retried)':44s} {ledger.tx['aborted_by_fault_retried']:>10d}")
    w(f"{'COMMIT outcome unknown -> not committed':44s} {ledger.tx['commit_unknown_was_rolled_back']:>10d}")
    w(f"{'business rows / their events (PostgreSQL)':44s} {business[0]:>10d} / {business[1]}")
    w(f"{'events committed':44s} {len(committed):>10d}")
    w(f"{'events rolled back / aborted (must be absent)':44s} {len(rolled_back):>10d}")
    if poison:
        w(f"{'poison events over max_payload (must die)':44s} {len(poison):>10d}")
    w(f"{'events delivered (unique msg_ids in stream)':44s} {len(stream_ids):>10d}")
    w(f"{'messages in stream':44s} {len(msgs):>10d}")
    w(f"{'events lost':44s} {len(lost):>10d}")
    w(f"{'out-of-order deliveries':44s} {len(disorder):>10d}")
    w(f"{'duplicates stored in stream':44s} {sum(n - 1 for n in dups.values()):>10d}")
    w(f"{'duplicates dropped by JetStream (PubAck dup)':44s} {dup_acks:>10d}")
    w(f"{'hand-outs beyond the first (sum attempts-1)':44s} {handouts - len(rows):>10d}")
    w(f"{'publishes failed on purpose (flaky publisher)':44s} {injected_fail:>10d}")
    w(f"{'latency commit->stream p50 / p99 / max (s)':44s} {_pct(lat, .5):>6.3f} / {_pct(lat, .99):.3f} / "
      f"{max(lat, default=0):.3f}")
    w(f"{'worker restarts / unexpected worker exits':44s} {sum(workers.spawns) - len(workers.spawns):>10d} / "
      f"{len(unexpected_exits)}")
    w(f"{'worker log: Traceback / ERROR / lease_lost':44s} {worker_errors['Traceback']:>6d} / "
      f"{worker_errors['level=ERROR']} / {worker_errors['event=lease_lost']}")
    w("-" * 78)
    w("recovery: seconds until every event committed before the fault was injected is published;")
    w("worst latency: max commit->stream of events committed from 1 s before the fault to 1 s after it ended")
    w(f"{'fault':20s} {'count':>5s} {'after lifted: median':>20s} {'max':>6s} "
      f"{'after injected: max':>19s} {'never':>5s} {'worst lat':>9s}")
    for kind in kinds:
        recs = by_kind.get(kind, [])
        rts = [max(0.0, f.recovered - f.lifted) for f in recs if f.recovered is not None]
        rti = [max(0.0, f.recovered - f.injected) for f in recs if f.recovered is not None]
        w(f"{kind:20s} {len(recs):>5d} {_pct(rts, .5):>20.2f} {max(rts, default=0):>6.2f} "
          f"{max(rti, default=0):>19.2f} {sum(1 for f in recs if f.recovered is None):>5d} "
          f"{worst_by_kind.get(kind, 0.0):>9.2f}")
    w(f"{'publish failures (5%)':22s} {injected_fail:>5d}")
    w("-" * 78)
    for name, ok, detail in inv:
        w(f"{'PASS' if ok else 'FAIL'}  {name:46s} {detail}")
    w("=" * 78)
    ok = all(i[1] for i in inv)
    return {
        "ok": ok, "table": "\n".join(lines),
        "committed": len(committed), "delivered": len(stream_ids), "stream_messages": len(msgs),
        "lost": len(lost), "out_of_order": len(disorder), "duplicates_stored": sum(n - 1 for n in dups.values()),
        "duplicate_acks": dup_acks, "injected_publish_failures": injected_fail,
        "latency_max": max(lat, default=0.0), "faults": {k: len(v) for k, v in by_kind.items()},
        "seed": seed, "latency_worst_around": worst_by_kind, "poison_dead": len(poison),
        "recovery_max": {k: max((max(0.0, f.recovered - f.lifted) for f in v if f.recovered is not None), default=None)
                         for k, v in by_kind.items()},
        "recovery_after_injected_max": {
            k: max((max(0.0, f.recovered - f.injected) for f in v if f.recovered is not None), default=None)
            for k, v in by_kind.items()},
        "unrecovered_faults": sum(1 for f in faults if f.recovered is None),
        "unexpected_worker_exits": unexpected_exits, "invariants": {n: o for n, o, _ in inv},
        "transactions": dict(ledger.tx),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="soak", description="outboxpg chaos soak on throwaway servers")
    p.add_argument("--minutes", type=float, default=1.0, help="how long producers and faults run")
    p.add_argument("--seconds", type=float, default=None, help="run time in seconds (overrides --minutes)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--lease", type=float, default=4.0)
    p.add_argument("--publish-timeout", type=float, default=1.5)
    p.add_argument("--fail-rate", type=float, default=0.05, help="fraction of publishes the workers fail on purpose")
    p.add_argument("--drain", type=float, default=120.0, help="seconds allowed for the backlog to drain")
    p.add_argument("--keep", action="store_true", help="keep worker logs even when every check passes")
    p.add_argument("--distributed", action="store_true",
                   help="3-node JetStream cluster, primary + synchronous standby, workers in network namespaces "
                        f"(root, `ip netns`); adds the kinds {', '.join(DISTRIBUTED_KINDS)}")
    p.add_argument("--patroni", action="store_true",
                   help="PostgreSQL run by Patroni and etcd (Debian's patroni, etcd-server), synchronous_mode on, "
                        f"the multi-host DSN; adds the kinds {', '.join(PATRONI_KINDS)}")
    p.add_argument("--kinds", default="", help="comma-separated fault kinds to inject (default: every kind)")
    args = p.parse_args(argv)
    if args.patroni and args.distributed:
        p.error("--patroni and --distributed are two different rigs: one at a time")
    if args.seconds is None and args.minutes <= 0 or args.seconds is not None and args.seconds <= 0:
        p.error("run time must be positive")
    try:
        kinds_for(args)
    except ValueError as e:
        p.error(str(e))
    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # unwinds through the finally blocks: everything started is stopped

    signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args)
    except KeyboardInterrupt:
        say("interrupted: every process, server and namespace started here is stopped and removed; "
            "the worker logs are kept (their directory is in the first line)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
