"""Issue 13, case 6: what a held snapshot does to the relay. Producers commit events at a steady
rate while one outboxpg-worker delivers them into JetStream; in the middle, a REPEATABLE READ
transaction takes its snapshot and stays idle for --hold seconds, then rolls back.

    .venv/bin/python bench/held_snapshot.py                 # 2,000 events/s; 60 s before, 180 s held, 60 s after
    .venv/bin/python bench/held_snapshot.py --short         # about 25 s: 4 s before, 10 s held, 4 s after
    .venv/bin/python bench/held_snapshot.py --rate 800 --hold 80

Set-up, as bench/key_mix.py does it: a database of its own on --dsn (the running server by
default), created from scratch and migrated, with `track_functions = all` set on it (ALTER
DATABASE: a superuser's DSN) so that pg_stat_user_functions times every outbox_claim call; a
nats-server of its own (outboxpg.embedded.EmbeddedNats, the binary beside this Python) or
--nats-url, and a stream of its own; one outboxpg-worker subprocess with default flags (only
--dsn, --nats-url and --name given). The producers are pgbench -R RATE (4 clients, one event per
transaction, synchronous_commit off, aggregate ids random over --aggregates), with the commit's
clock_timestamp() in the payload, as in key_mix's latency phase; a JetStream consumer in this
process subtracts it from its receive time (commit -> delivery latency, an upper bound of
commit -> ack). outbox_settings.xmin_warn_after is set to half the hold (at most its 1-minute
default), so the worker's warning (event=xmin_held) shows within the run.

Figures per phase (before / during the hold / after it):
  produced    events committed in the phase (created_at), per second
  delivered   events received by the consumer in the phase, per second, and as a share of produced
  claim       outbox_claim as the server timed it: mean ms (pg_stat_user_functions, total_time /
              calls between the phase's start and end; backends report their figures about once
              a second, so a phase's edges blur by up to a second), and as the worker saw it:
              p50 / p99 ms of the worker's own claim calls (pool wait and round trip included;
              the worker is run through a shim that times Gateway.claim and appends to a file)
  latency     commit -> delivery p50 / p99 / max ms of the events committed in the phase; and the
              part of it until the event's claim (its claimed_at, by its Nats-Msg-Id), so that a slow
              delivery shows as a wait for a claim or as the publish, JetStream and the consumer
  dead        n_dead_tup at the phase's end: the outbox partitions (summed) and outbox_heads
  backlog     outbox_health.backlog at the phase's end, and xmin_holders (0017) during the hold
Then: delivery during/before (issue 13 asks >= 0.95) and the worker's xmin_held log lines.

Bounded: pgbench runs for the phases' total (-T), the consumer waits at most --drain-wait seconds
after it for events still in flight, and each step has a timeout. At the end it stops the
processes it started (by PID), drops its database (WITH FORCE) and its stream, and removes its
temp dir, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import orjson
import psycopg
from nats.js.api import DeliverPolicy, StreamConfig
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
import processes  # noqa: E402  (bench/, beside this file)
from key_mix import log, pct  # noqa: E402
from outboxpg import schema  # noqa: E402
from outboxpg.embedded import EmbeddedNats  # noqa: E402

# The worker, unchanged, with its claim calls timed: (wall clock at the call, ms) per line.
SHIM = """#!{python}
import sys, time
sys.path.insert(0, {root!r})
from outboxpg.relay import gateway
_claim = gateway.Gateway.claim
_out = open({path!r}, "a", buffering=1)

async def claim(self, *args, **kwargs):
    at, t0 = time.time(), time.perf_counter()
    try:
        return await _claim(self, *args, **kwargs)
    finally:
        _out.write(f"{{at:.6f}} {{(time.perf_counter() - t0) * 1000:.3f}}\\n")

gateway.Gateway.claim = claim
from outboxpg.cli.outboxpg_worker import main
sys.exit(main())
"""

PRODUCER = ("\\set a random(1, {aggregates})\n"
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
            "VALUES ('order', :a, 'created', jsonb_build_object('t', extract(epoch FROM clock_timestamp())));\n")

_DEAD = """
SELECT coalesce(sum(s.n_dead_tup) FILTER (WHERE s.relid <> 'outbox_heads'::regclass), 0)::bigint,
       coalesce(sum(s.n_dead_tup) FILTER (WHERE s.relid = 'outbox_heads'::regclass), 0)::bigint
  FROM pg_stat_user_tables s
 WHERE s.relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'outbox'::regclass)
    OR s.relid = 'outbox_heads'::regclass
"""
# Index entries read (live or not: a held snapshot keeps dead ones from being skipped), per
# index; an outbox partition's index counts under its partitioned parent.
_INDEX_READS = """
SELECT coalesce((SELECT i.inhparent::regclass::text FROM pg_inherits i WHERE i.inhrelid = s.indexrelid),
                s.indexrelname) AS name, sum(s.idx_tup_read)::bigint
  FROM pg_stat_user_indexes s
 GROUP BY 1
"""
_CLAIM_STATS = ("SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum(total_time), 0)::float8 "
                "FROM pg_stat_user_functions WHERE funcname = 'outbox_claim'")


@dataclass
class Phase:
    name: str
    start: float = 0.0           # wall clock (time.time())
    end: float = 0.0
    claim_calls: int = 0
    claim_ms: float = 0.0        # server-side total
    dead_outbox: int = 0
    dead_heads: int = 0
    backlog: int = 0
    xmin_holders: int = 0
    produced: int = 0
    delivered: int = 0
    latency: list[float] = field(default_factory=list)
    until_claimed: list[float] = field(default_factory=list)   # commit -> claimed_at (its last claim)
    worker_claims: list[float] = field(default_factory=list)
    index_reads: dict[str, int] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return max(self.end - self.start, 1e-9)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = str(os.getpid())
        self.tmp = Path(tempfile.mkdtemp(prefix="outboxpg-held-snapshot-"))
        self.dbname = f"outboxpg_held_{self.tag}"
        self.dsn = make_conninfo(args.dsn, dbname=self.dbname)
        self.stream = f"HELD{self.tag}"
        self.prefix = f"held{self.tag}"
        self.nats: EmbeddedNats | None = None
        self.nats_url = args.nats_url or ""
        self.procs: list[subprocess.Popen[Any]] = []
        self.db_made = False
        self.stream_made = False
        self.claims_file = self.tmp / "claims.txt"
        self.worker_log = self.tmp / "worker.log"
        self.pgbench = args.pgbench or shutil.which("pgbench") or "/usr/lib/postgresql/15/bin/pgbench"
        self.received: list[tuple[float, float]] = []    # (receive time, commit time)
        self.msg_ids: list[str] = []                      # Nats-Msg-Id of each, in the same order
        self.claimed: dict[str, float] = {}               # msg_id -> claimed_at (epoch s), read at the end

    # -- set-up and clean-up ----------------------------------------------------------------

    def admin(self, statement: sql.Composable | str) -> None:
        with psycopg.connect(self.args.dsn, autocommit=True, connect_timeout=10) as c:
            c.execute(statement)

    def setup(self) -> None:
        if not self.args.nats_url:
            self.nats = EmbeddedNats(base_dir=str(self.tmp)).start()
            self.nats_url = self.nats.url
        db = sql.Identifier(self.dbname)
        self.admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(db))
        self.admin(sql.SQL("CREATE DATABASE {}").format(db))
        self.db_made = True
        # Only this database's backends time their function calls.
        self.admin(sql.SQL("ALTER DATABASE {} SET track_functions = 'all'").format(db))
        schema.migrate(self.dsn)
        warn_after = min(60.0, self.args.hold / 2)
        with psycopg.connect(self.dsn, autocommit=True) as c:
            c.execute("UPDATE outbox_settings SET subject_prefix = %s, xmin_warn_after = make_interval(secs => %s)",
                      (self.prefix, warn_after))
        asyncio.run(self.make_stream())
        shim = self.tmp / "outboxpg-worker"
        shim.write_text(SHIM.format(python=sys.executable, root=str(ROOT), path=str(self.claims_file)))
        shim.chmod(0o755)

    async def make_stream(self) -> None:
        nc = await nats.connect(self.nats_url)
        try:
            await nc.jetstream().add_stream(StreamConfig(name=self.stream, subjects=[f"{self.prefix}.>"],
                                                         duplicate_window=600))
            self.stream_made = True
        finally:
            await nc.close()

    async def drop_stream(self) -> None:
        nc = await nats.connect(self.nats_url, connect_timeout=5, max_reconnect_attempts=1)
        try:
            await nc.jetstream().delete_stream(self.stream)
        finally:
            await nc.close()

    def stop(self, p: subprocess.Popen[Any]) -> None:
        processes.stop(p, self.procs)

    def cleanup(self) -> None:
        for p in list(self.procs):
            try:
                self.stop(p)
            except Exception as exc:  # noqa: BLE001 - clean up the rest anyway
                log(f"cleanup: process {p.pid}: {exc}")
        if self.stream_made and self.args.nats_url:   # an EmbeddedNats goes with its store
            try:
                asyncio.run(self.drop_stream())
            except Exception as exc:  # noqa: BLE001
                log(f"cleanup: stream {self.stream}: {exc}")
        if self.nats is not None:
            self.nats.stop(remove=True)
        if self.db_made:
            try:
                self.admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.dbname)))
            except Exception as exc:  # noqa: BLE001
                log(f"cleanup: database {self.dbname}: {exc}")
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the run --------------------------------------------------------------------------------

    def start_worker(self) -> subprocess.Popen[bytes]:
        with open(self.worker_log, "wb") as err:
            p = subprocess.Popen([sys.executable, str(self.tmp / "outboxpg-worker"), "--dsn", self.dsn,
                                  "--nats-url", self.nats_url, "--name", f"held-{self.tag}"],
                                 stdout=subprocess.DEVNULL, stderr=err)
        self.procs.append(p)
        return p

    def start_producers(self, seconds: int) -> subprocess.Popen[str]:
        script = self.tmp / "producer.sql"
        script.write_text(PRODUCER.format(aggregates=self.args.aggregates))
        c = conninfo_to_dict(self.dsn)
        env = {**os.environ, "PGOPTIONS": "-c synchronous_commit=off"}
        p = subprocess.Popen([self.pgbench, "-h", str(c.get("host", "127.0.0.1")), "-p", str(c.get("port", 5432)),
                              "-U", str(c.get("user", "postgres")), "-n", "-M", "prepared", "-f", str(script),
                              "-c", "4", "-j", "2", "-R", str(self.args.rate), "-T", str(seconds), self.dbname],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.procs.append(p)
        return p

    def sample(self, c: psycopg.Connection[Any], phase: Phase) -> None:
        """The figures read at a phase's end."""
        calls, total = c.execute(_CLAIM_STATS).fetchone()  # type: ignore[misc]
        phase.claim_calls, phase.claim_ms = int(calls), float(total)
        phase.dead_outbox, phase.dead_heads = c.execute(_DEAD).fetchone()  # type: ignore[misc]
        phase.index_reads = {str(name): int(n) for name, n in c.execute(_INDEX_READS).fetchall()}
        phase.backlog, phase.xmin_holders = c.execute(
            "SELECT backlog, xmin_holders FROM outbox_health").fetchone()  # type: ignore[misc]

    async def run(self) -> list[Phase]:
        a = self.args
        warmup = 1.0 if a.short else 3.0    # pgbench's clients connected and at their rate
        total = int(warmup + a.before + a.hold + a.after + 0.999)
        nc = await nats.connect(self.nats_url)
        js = nc.jetstream()

        async def on_msg(m: Any) -> None:
            self.received.append((time.time(), orjson.loads(m.data)["t"]))
            self.msg_ids.append((m.headers or {}).get("Nats-Msg-Id", ""))

        sub = await js.subscribe(f"{self.prefix}.>", ordered_consumer=True, cb=on_msg, deliver_policy=DeliverPolicy.NEW)
        worker = self.start_worker()
        phases = [Phase("before"), Phase("during"), Phase("after")]
        mon = await asyncio.to_thread(psycopg.connect, self.dsn, autocommit=True)
        start = Phase("start")
        holder: psycopg.Connection[Any] | None = None
        try:
            await asyncio.sleep(2.0)      # the worker up and idle
            if worker.poll() is not None:
                raise RuntimeError(f"worker exited with {worker.returncode}: {self.worker_log.read_text()[-2000:]}")
            producers = self.start_producers(total)
            await asyncio.sleep(warmup)
            await asyncio.to_thread(self.sample, mon, start)
            t = time.time()
            for phase, seconds in zip(phases, (a.before, a.hold, a.after)):
                phase.start = t
                if phase.name == "during":
                    holder = await asyncio.to_thread(self.hold)
                await asyncio.sleep(max(0.0, phase.start + seconds - time.time()))
                phase.end = t = time.time()
                await asyncio.to_thread(self.sample, mon, phase)
                if holder is not None:
                    await asyncio.to_thread(holder.rollback)
                    holder.close()
                    holder = None
                if worker.poll() is not None:
                    raise RuntimeError(f"worker exited with {worker.returncode}: {self.worker_log.read_text()[-2000:]}")
            out, _ = await asyncio.to_thread(producers.communicate, timeout=60)
            self.procs.remove(producers)
            if producers.returncode != 0:
                raise RuntimeError(f"pgbench failed ({producers.returncode}):\n{out}")
            # Events still in flight: wait for the backlog, at most --drain-wait seconds.
            deadline = time.monotonic() + a.drain_wait
            committed = mon.execute("SELECT count(*) FROM outbox").fetchone()[0]  # type: ignore[index]
            while len(self.received) < committed and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            self.claimed = {str(msg_id): float(at) for msg_id, at in mon.execute(
                "SELECT msg_id, extract(epoch FROM claimed_at)::float8 FROM outbox "
                "WHERE claimed_at IS NOT NULL").fetchall()}
            for phase in phases:
                phase.produced = mon.execute(
                    "SELECT count(*) FROM outbox WHERE created_at >= to_timestamp(%s) AND created_at < to_timestamp(%s)",
                    (phase.start, phase.end)).fetchone()[0]  # type: ignore[index]
        finally:
            if holder is not None:
                holder.close()
            mon.close()
            await sub.unsubscribe()
            await nc.close()
            self.stop(worker)
        claims = [(float(at), float(ms)) for at, ms in
                  (line.split() for line in self.claims_file.read_text().splitlines() if line.strip())]
        calls, ms = start.claim_calls, start.claim_ms     # cumulative so far: the phases' differences
        reads = start.index_reads
        for phase in phases:
            phase.delivered = sum(1 for got, _ in self.received if phase.start <= got < phase.end)
            phase.latency = [(got - t) * 1000 for got, t in self.received if phase.start <= t < phase.end]
            phase.until_claimed = [(self.claimed[i] - t) * 1000 for (_, t), i in zip(self.received, self.msg_ids)
                                   if phase.start <= t < phase.end and i in self.claimed]
            phase.worker_claims = [ms for at, ms in claims if phase.start <= at < phase.end]
            (calls, phase.claim_calls), (ms, phase.claim_ms) = ((phase.claim_calls, phase.claim_calls - calls),
                                                                 (phase.claim_ms, phase.claim_ms - ms))
            (reads, phase.index_reads) = (phase.index_reads, {k: v - reads.get(k, 0) for k, v in phase.index_reads.items()})
        return phases

    def hold(self) -> psycopg.Connection[Any]:
        """A REPEATABLE READ transaction that has taken its snapshot, left idle in transaction."""
        c = psycopg.connect(self.dsn, application_name="held-snapshot bench")
        c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        c.execute("SELECT count(*) FROM outbox_settings").fetchone()
        xmin = c.execute("SELECT backend_xmin FROM pg_stat_activity WHERE pid = pg_backend_pid()").fetchone()
        if not xmin or xmin[0] is None:
            raise RuntimeError("the REPEATABLE READ transaction holds no snapshot (backend_xmin is NULL)")
        return c


def report(b: Bench, phases: list[Phase]) -> None:
    a = b.args
    log(f"held snapshot: {a.rate:,} events/s over {a.aggregates:,} aggregates, one outboxpg-worker (default flags) "
        f"-> JetStream; phases {a.before:g} s before, {a.hold:g} s held (REPEATABLE READ, idle), {a.after:g} s after")
    log(f"{'phase':<8} {'produced/s':>10} {'delivered/s':>11} {'share':>6} {'claim mean':>10} {'calls':>7} "
        f"{'worker p50':>10} {'p99':>8} {'lat p50':>9} {'p99':>9} {'max':>9} {'dead outbox':>11} {'heads':>8} "
        f"{'backlog':>8} {'xmin_holders':>12}")
    for p in phases:
        mean = p.claim_ms / p.claim_calls if p.claim_calls else float("nan")
        wc = p.worker_claims
        log(f"{p.name:<8} {p.produced / p.seconds:>10,.0f} {p.delivered / p.seconds:>11,.0f} "
            f"{p.delivered / p.produced if p.produced else float('nan'):>6.2f} {mean:>8.2f}ms {p.claim_calls:>7,} "
            f"{statistics.median(wc) if wc else float('nan'):>8.2f}ms {pct(wc, 0.99):>6.1f}ms "
            f"{pct(p.latency, 0.5):>7.1f}ms {pct(p.latency, 0.99):>7.1f}ms {max(p.latency, default=float('nan')):>7.0f}ms "
            f"{p.dead_outbox:>11,} {p.dead_heads:>8,} {p.backlog:>8,} {p.xmin_holders:>12}")
    log("of which until claimed (commit -> the event's claimed_at): p50 / p99 ms; the rest is the publish, "
        "JetStream and this process's consumer")
    for p in phases:
        log(f"  {p.name:<8} {pct(p.until_claimed, 0.5):>8.1f} {pct(p.until_claimed, 0.99):>8.1f}")
    log("latency p50 / p99 / max ms per 20 s of commit time (where in the run the slow ones are), "
        "and until claimed p50 / p99:")
    t0 = phases[0].start
    windows: dict[int, list[float]] = {}
    waits: dict[int, list[float]] = {}
    for (got, t), msg_id in zip(b.received, b.msg_ids):
        if phases[0].start <= t < phases[-1].end:
            windows.setdefault(int((t - t0) // 20), []).append((got - t) * 1000)
            if msg_id in b.claimed:
                waits.setdefault(int((t - t0) // 20), []).append((b.claimed[msg_id] - t) * 1000)
    for w in sorted(windows):
        lat, wait = windows[w], waits.get(w, [])
        log(f"  {w * 20:>4}-{w * 20 + 20:<4} s  {pct(lat, 0.5):>8.1f} {pct(lat, 0.99):>8.1f} {max(lat):>8.0f}   "
            f"{pct(wait, 0.5):>8.1f} {pct(wait, 0.99):>8.1f}")
    log("index entries read per claim call (all callers' reads, the most read first):")
    for p in phases:
        top = sorted(p.index_reads.items(), key=lambda kv: -kv[1])[:5]
        log(f"  {p.name:<8} " + ", ".join(f"{k} {v / max(p.claim_calls, 1):,.0f}" for k, v in top if v))
    before, during = phases[0], phases[1]
    if before.delivered and during.seconds:
        ratio = (during.delivered / during.seconds) / (before.delivered / before.seconds)
        log(f"delivery during/before: {ratio:.2f} (issue 13 asks >= 0.95); during p99 latency "
            f"{pct(during.latency, 0.99):.1f} ms (asks <= 50 ms)")
    held = [line for line in b.worker_log.read_text(errors="replace").splitlines() if "event=xmin_held" in line]
    log(f"worker xmin_held lines: {len(held)}" + "".join(f"\n  {line}" for line in held))
    missing = sum(p.produced for p in phases) - sum(1 for _, t in b.received if phases[0].start <= t < phases[-1].end)
    if missing > 0:
        log(f"note: {missing} events committed in the phases had not reached the consumer within "
            f"{a.drain_wait:g} s after the producers stopped")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"),
                    help="a superuser's DSN on the server to use (a database of its own is created and dropped)")
    ap.add_argument("--nats-url", default=None, help="a running nats-server with JetStream (default: start one)")
    ap.add_argument("--rate", type=int, default=2000, help="events committed per second (default 2000)")
    ap.add_argument("--aggregates", type=int, default=10000, help="aggregate ids the events spread over (default 10000)")
    ap.add_argument("--before", type=float, default=60.0, help="seconds measured before the hold (default 60)")
    ap.add_argument("--hold", type=float, default=180.0, help="seconds the snapshot is held (default 180)")
    ap.add_argument("--after", type=float, default=60.0, help="seconds measured after it (default 60)")
    ap.add_argument("--short", action="store_true",
                    help="4 s before, 10 s held, 4 s after, 3 s to drain (about 25 s in all, set-up included)")
    ap.add_argument("--drain-wait", type=float, default=30.0,
                    help="seconds to wait after the producers stop for events in flight (default 30)")
    ap.add_argument("--pgbench", default=os.environ.get("PGBENCH"))
    a = ap.parse_args()
    if a.short:
        a.before, a.hold, a.after, a.drain_wait = 4.0, 10.0, 4.0, min(a.drain_wait, 3.0)
    for name in ("rate", "aggregates", "before", "hold", "after"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name} must be positive")
    b = Bench(a)

    def on_term(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        b.setup()
        phases = asyncio.run(b.run())
        report(b, phases)
    except KeyboardInterrupt:
        log("interrupted: cleaning up")
        return 130
    finally:
        b.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
