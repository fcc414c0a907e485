"""Shards (outbox_claim(..., shard => 'I/N')): what a shard's claim reads, and the total drain
rate of 1, 2, 4 and 8 claimers, and of as many outboxpg-worker processes, with and without shards.

    .venv/bin/python bench/shards.py                       # every part (about 15 minutes on 2 cores)
    .venv/bin/python bench/shards.py --only cost           # the claim cost part alone
    .venv/bin/python bench/shards.py --only drain --quick  # smaller drains
    .venv/bin/python bench/shards.py --only workers        # the workers part alone
    .venv/bin/python bench/shards.py --only workers --workers 2,8 --split   # two fleet sizes, where the CPU goes
    .venv/bin/python bench/shards.py --only workers --workers 1,8 --mixes 2  # 20,000 over 200 only

It runs on a PostgreSQL server that is already running (--server, a libpq string without a
database; default host=127.0.0.1 user=postgres): it creates a database of its own for each
measurement (outboxpg_bench_shards_<pid>_<n>), installs the current schema/ into it with yoyo
(outboxpg migrate), runs SELECT outbox_shards_enable(), and drops it afterwards, also on Ctrl-C.

cost   100,000 due heads (one event each) in shard 1/2, older than 10 due aggregates of shard 0/2
       (50 events each). For a claim of 100 by shard 0/2, and by a claim without a shard: the
       index entries it reads (outbox_heads_bucket_idx + outbox_heads_ready_idx, this backend's
       counters) and the backend's CPU time (log_statement_stats: user + system, as the LOG
       notice reports it), median of 5 claims each rolled back. The same with shard 1/2 empty
       (its 100,000 heads never inserted): a shard's claim must cost the same.
drain  prefilled events (server-side INSERT ... SELECT, then VACUUM ANALYZE): 200,000 over 50,000
       aggregates and 20,000 over 200 (--quick: 50,000 over 12,500 and 20,000 over 200). N
       claimer processes (1, 2, 4, 8), each a loop of outbox_claim(500) -> outbox_complete on its
       own connection (the database side of a worker, without a broker); without shards, and
       with claimer i of N given shard i/N. Each claimer first makes one claim and complete in a
       transaction it rolls back, one claimer at a time (planning the claim's statements takes a
       new connection tens of ms of CPU, which a worker pays once when it starts, and which 8
       claimers on 2 cores would otherwise add to a drain of well under a second; --cold leaves
       it out), then the database is vacuumed. The time runs from the moment every claimer is
       connected and warm to the end of the last outbox_complete (each claimer notes when its
       last one returned, and counts what it published: the parent waits for the sum, with no
       query of its own during the drain); the rate is events/s, the median of --repeat drains (default 3: a drain of
       20,000 takes well under a second here, and one drain alone moves by tens of percent), and
       the claim cost per claimer: the mean wall time of its claims that handed out events
       (median over the claimers, then over the drains).
       The configurations of a mix run alternated, as close together as the run allows, so that
       the machine's load weighs on all of them. The load average at each line is printed beside
       it.
workers
       the same mixes drained by N outboxpg-worker processes (1, 2, 4, 8; default flags, and
       --shard i/N for the sharded line) publishing to a Python callable that does nothing
       (bench/null_publisher.py: the worker and the database, no broker). The workers start, and
       the burst is written once every one of them is idle (one holds the wakeup lock, the
       others queue for it), in one INSERT ... SELECT: the case of a fleet that a burst wakes;
       then, once they are idle again, a second burst of the same size (the first one's events
       stay in the table, published, as they do until retention drops them). The first burst
       finds each connection cold: its first outbox_claim and outbox_complete compile the
       functions and plan their statements; the second, warm, is a fleet's steady state.
       Events/s from a burst's commit to its last published_at, the median of --repeat drains;
       how many workers delivered a part of it; and the machine's busy CPU over the drain
       (/proc/stat, every process), which shows what each added worker costs. With --split,
       where that CPU goes, per burst (medians): the worker processes' own (/proc/PID/stat),
       their server sessions' (those open at the burst's start), and how many server sessions
       the workers opened during it (their pools' new connections, each with its own first
       plans).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from proc_cpu import HZ, process_cpu_s  # noqa: E402  (bench/, beside this file)

from outboxpg.schema import migrate  # noqa: E402

_seq = 0


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


@contextmanager
def database(server: str) -> Iterator[str]:
    """A fresh database with the schema installed and shards enabled; dropped afterwards."""
    global _seq
    _seq += 1
    name = f"outboxpg_bench_shards_{os.getpid()}_{_seq}"
    with psycopg.connect(f"{server} dbname=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    dsn = f"{server} dbname={name}"
    try:
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("SELECT outbox_shards_enable()")
        yield dsn
    finally:
        with psycopg.connect(f"{server} dbname=postgres", autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def take_in(c: psycopg.Connection[Any]) -> None:
    """The intake (outbox_take_in, as every claim runs it) until its cursor has every event: the
    heads exist, nothing is leased."""
    while True:
        c.execute("SELECT outbox_take_in(g.settled, g.last_id, 10000) FROM outbox_commit_guard() g").fetchone()
        row = c.execute("SELECT intake_id >= (SELECT coalesce(max(id), 0) FROM outbox) FROM outbox_intake").fetchone()
        if row and row[0]:
            return


_CPU = re.compile(r"!\s+([0-9.]+) s user, ([0-9.]+) s system")


def one_claim(dsn: str, shard: str | None) -> tuple[int, int, float]:
    """(handed out, index entries read, backend CPU ms) of one claim of 100, rolled back."""
    notices: list[str] = []
    with psycopg.connect(dsn) as c:
        c.add_notice_handler(lambda d: notices.append(d.message_detail or ""))
        c.execute("SELECT count(*) FROM outbox_claim(1, shard => %s)", (shard,))   # plans made
        c.rollback()
        c.execute("SET log_statement_stats = on")
        c.execute("SET client_min_messages = log")
        entries = ("SELECT coalesce(pg_stat_get_xact_tuples_returned('outbox_heads_bucket_idx'::regclass), 0) "
                   "+ pg_stat_get_xact_tuples_returned('outbox_heads_ready_idx'::regclass)")
        before = c.execute(entries).fetchone()[0]  # type: ignore[index]
        notices.clear()
        n = len(c.execute("SELECT id FROM outbox_claim(100, shard => %s)", (shard,)).fetchall())
        cpu = [float(m[1]) + float(m[2]) for s in notices if (m := _CPU.search(s))]
        after = c.execute(entries).fetchone()[0]  # type: ignore[index]
        c.rollback()
    return n, int(after) - int(before), 1000 * cpu[-1] if cpu else float("nan")


def part_cost(server: str) -> None:
    print("\ncost: a claim of 100 by shard 0/2 and without a shard; 10 due aggregates of shard 0/2 (50 events "
          "each) behind shard 1/2's due heads; median of 5")
    print(f"  {'shard 1/2 backlog':>18} {'claim':>9} {'handed out':>10} {'entries read':>12} {'CPU ms':>7}  load")
    for backlog in (0, 100_000):
        with database(server) as dsn, psycopg.connect(dsn, autocommit=True) as c:
            b1 = c.execute("SELECT outbox_shard_buckets('1/2')").fetchone()[0]  # type: ignore[index]
            b0 = c.execute("SELECT outbox_shard_buckets('0/2')").fetchone()[0]  # type: ignore[index]
            c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                      "SELECT 'acct', a, 'e', '{}' FROM (SELECT 'b' || g AS a FROM generate_series(1, %s) g) s "
                      "WHERE outbox_aggregate_bucket('acct', a) = ANY (%s) LIMIT %s", (3 * backlog, b1, backlog))
            take_in(c)
            time.sleep(0.05)
            quiet = [r[0] for r in c.execute(
                "SELECT a FROM (SELECT 'q' || g AS a FROM generate_series(1, 1000) g) s "
                "WHERE outbox_aggregate_bucket('acct', a) = ANY (%s) LIMIT 10", (b0,)).fetchall()]
            c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                      "SELECT 'acct', a, 'e', '{}' FROM unnest(%s::text[]) a, generate_series(1, 50)", (quiet,))
            take_in(c)
            c.execute("VACUUM ANALYZE outbox_heads")
            for shard in ("0/2", None):
                runs = [one_claim(dsn, shard) for _ in range(5)]
                print(f"  {backlog:>18,} {shard or 'no shard':>9} {runs[0][0]:>10} "
                      f"{statistics.median(r[1] for r in runs):>12.0f} {statistics.median(r[2] for r in runs):>7.2f}"
                      f"  {load()}", flush=True)


def claimer(dsn: str, shard: str | None, start: Any, done: Any, last: Any, cost: Any, i: int,
            warm: Any | None, published: Any) -> None:
    parent = os.getppid()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT 1")
        if warm is not None:
            # The connection's first claim and complete plan their statements (generic plans,
            # once per connection: tens of ms of CPU). A worker does that once when it starts;
            # here it would be paid again in every drain, once per claimer. Rolled back, one
            # claimer at a time, so that each finds the same due heads.
            with warm:
                c.execute("BEGIN")
                rows = c.execute("SELECT id, lease_token FROM outbox_claim(500, shard => %s)", (shard,)).fetchall()
                if rows:
                    c.execute("SELECT outbox_complete(%s::bigint[], %s)", ([r[0] for r in rows], rows[0][1]))
                c.execute("ROLLBACK")
        start.wait()                                          # every claimer connected (and warm)
        start.wait()                                          # the parent ready: the clock starts
        empty = 0
        claims = 0
        spent = 0.0
        while not done.is_set() and os.getppid() == parent:   # the bench gone (killed): stop too
            t = time.perf_counter()
            rows = c.execute("SELECT id, lease_token FROM outbox_claim(500, shard => %s)", (shard,)).fetchall()
            if rows:
                spent += time.perf_counter() - t
                claims += 1
                cost[i] = spent / claims
            if not rows:
                empty += 1
                time.sleep(0.002 * min(empty, 10))
                continue
            empty = 0
            (n,) = c.execute("SELECT outbox_complete(%s::bigint[], %s)",  # type: ignore[misc]
                             ([r[0] for r in rows], rows[0][1])).fetchone()
            last[i] = time.monotonic()                        # CLOCK_MONOTONIC: one clock for all processes
            with published.get_lock():
                published.value += n


def drain(server: str, events: int, aggregates: int, workers: int, sharded: bool,
          cold: bool = False) -> tuple[float, float]:
    """(events/s, the mean wall time of a claim that handed out events, in ms, the median over
    the claimers)."""
    with database(server) as dsn, psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                  "SELECT 'acct', 'a' || (g %% %s), 'e', '{\"n\": 1}' FROM generate_series(1, %s) g",
                  (aggregates, events))
        c.execute("VACUUM ANALYZE")
        ctx = mp.get_context("spawn")
        start, done = ctx.Barrier(workers + 1), ctx.Event()
        last, cost = ctx.Array("d", workers), ctx.Array("d", workers)
        published = ctx.Value("q", 0)
        warm = None if cold else ctx.Lock()
        procs = [ctx.Process(target=claimer,
                             args=(dsn, f"{i}/{workers}" if sharded else None, start, done, last, cost, i, warm,
                                   published))
                 for i in range(workers)]
        for p in procs:
            p.start()
        start.wait(120)                                       # all connected (and warm)
        if not cold:
            c.execute("VACUUM outbox_heads, outbox")          # what the warm-up claims rolled back
        start.wait(120)                                       # all connected: the clock starts
        t0 = time.monotonic()
        try:
            # The claimers count what they published: the end is seen without a query of the
            # parent's own on the 2 cores the claimers share.
            while published.value < events:
                if time.monotonic() - t0 > 600:
                    raise RuntimeError(f"drain: {published.value} of {events} events published after 600 s")
                time.sleep(0.005)
            elapsed = max(last) - t0
            left = c.execute("SELECT count(*) FROM outbox WHERE unfinished").fetchone()[0]  # type: ignore[index]
            if left:
                raise RuntimeError(f"drain: {left} events unfinished after the claimers published {events}")
        finally:
            done.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
        return events / elapsed, 1000 * statistics.median(c for c in cost if c > 0)


def mixes_of(quick: bool, chosen: Sequence[int] | None) -> list[tuple[int, int]]:
    """(events, aggregates) of the mixes to drain: 1 the uniform one, 2 20,000 over 200 (--mixes)."""
    mixes = [(50_000, 12_500), (20_000, 200)] if quick else [(200_000, 50_000), (20_000, 200)]
    return [m for i, m in enumerate(mixes, 1) if chosen is None or i in chosen]


def part_drain(server: str, quick: bool, repeat: int, cold: bool = False, chosen: Sequence[int] | None = None) -> None:
    mixes = mixes_of(quick, chosen)
    print(f"\ndrain: N claimers, each outbox_claim(500) -> outbox_complete; events/s (no broker), "
          f"median of {repeat} drains{'; cold connections (their first claim in the time)' if cold else ''}")
    for events, aggregates in mixes:
        print(f"  {events:,} events over {aggregates:,} aggregates")
        for workers in (1, 2, 4, 8):
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(repeat):
                for sharded in (False, True):
                    runs[sharded].append(drain(server, events, aggregates, workers, sharded, cold))
            rates = {k: statistics.median(r for r, _ in v) for k, v in runs.items()}
            costs = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
            print(f"    {workers} claimer{'s' if workers > 1 else ' '}  no shards {rates[False]:>8,.0f}/s "
                  f"(claim {costs[False]:5.1f} ms)   shards {rates[True]:>8,.0f}/s (claim {costs[True]:5.1f} ms)   "
                  f"load {load()}", flush=True)


ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(sys.executable).parent / "outboxpg-worker"


def busy_jiffies() -> int:
    """Busy CPU time of the whole machine so far, in clock ticks (/proc/stat: all but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(values) - values[3] - values[4]


def wakeup_queue(c: psycopg.Connection[Any]) -> int:
    """Sessions holding or queueing for the wakeup lock (1868724336, 1): idle workers."""
    row = c.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 1868724336 "
                    "AND objid = 1 AND objsubid = 2 AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())").fetchone()
    return int(row[0]) if row else 0


def fleet_sessions(c: psycopg.Connection[Any]) -> list[int]:
    """The pids of the workers' server sessions in this database (their pools keep a connection
    open for 10 minutes once it was opened)."""
    return [row[0] for row in c.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                                        "AND application_name LIKE 'outboxpg-worker%%'").fetchall()]


Burst = tuple[float, int, float, tuple[float, float, int]]


def worker_drain(server: str, events: int, aggregates: int, workers: int, sharded: bool) -> list[Burst]:
    """Two bursts into the same idle workers, the first cold, the second warm: for each, (events/s
    from the burst's commit to its last published_at, workers that delivered part of it, the
    machine's busy CPU seconds over the drain, and (the worker processes' CPU seconds, the CPU
    seconds of their sessions open at its start, sessions opened) over it)."""
    with database(server) as dsn, psycopg.connect(dsn, autocommit=True) as c:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "bench"), str(ROOT)]))
        procs = [subprocess.Popen([str(WORKER), "--dsn", dsn, "--publisher", "null_publisher:publish",
                                   "--maintenance-interval", "0", "--log-level", "WARNING", "--name", f"w{i}",
                                   *(["--shard", f"{i}/{workers}"] if sharded else [])],
                                  env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                 for i in range(workers)]
        bursts = []
        try:
            for _ in range(2):
                t0 = time.monotonic()
                while wakeup_queue(c) < workers:              # every worker idle
                    if time.monotonic() - t0 > 120 or any(p.poll() is not None for p in procs):
                        raise RuntimeError(f"workers: {wakeup_queue(c)} of {workers} idle after "
                                           f"{time.monotonic() - t0:.0f} s (exited: {[p.returncode for p in procs]})")
                    time.sleep(0.1)
                (before,) = c.execute("SELECT coalesce(max(id), 0) FROM outbox").fetchone()  # type: ignore[misc]
                sessions = fleet_sessions(c)
                own = sum(process_cpu_s(p.pid) for p in procs)
                served = sum(process_cpu_s(pid) for pid in sessions)
                c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                          "SELECT 'acct', 'a' || (g %% %s), 'e', '{\"n\": 1}' FROM generate_series(1, %s) g",
                          (aggregates, events))
                cpu = busy_jiffies()
                (committed,) = c.execute("SELECT clock_timestamp()").fetchone()  # type: ignore[misc]
                t0 = time.monotonic()
                while c.execute("SELECT EXISTS (SELECT FROM outbox WHERE unfinished)").fetchone()[0]:  # type: ignore[index]
                    if time.monotonic() - t0 > 600:
                        raise RuntimeError("workers: the burst not drained after 600 s")
                    time.sleep(0.05)
                cpu = busy_jiffies() - cpu
                own = sum(process_cpu_s(p.pid) for p in procs) - own
                served = sum(process_cpu_s(pid) for pid in sessions) - served
                (seconds, took_part) = c.execute(  # type: ignore[misc]
                    "SELECT extract(epoch FROM max(published_at) - %s), count(DISTINCT locked_by) FROM outbox "
                    "WHERE id > %s", (committed, before)).fetchone()
                opened = len(set(fleet_sessions(c)) - set(sessions))
                bursts.append((events / float(seconds), int(took_part), cpu / HZ, (own, served, opened)))
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    return bursts


def part_workers(server: str, quick: bool, repeat: int, counts: Sequence[int] = (1, 2, 4, 8),
                 split: bool = False, chosen: Sequence[int] | None = None) -> None:
    mixes = mixes_of(quick, chosen)
    print(f"\nworkers: N outboxpg-worker processes, idle, then a burst, then another once they are idle again; "
          f"events/s from a burst's commit to its last published (a no-op publisher), median of {repeat}; "
          f"workers that took part; busy CPU s of the machine during the drain")
    for events, aggregates in mixes:
        print(f"  {events:,} events over {aggregates:,} aggregates")
        for workers in counts:
            runs: dict[bool, list[list[Burst]]] = {False: [], True: []}
            for _ in range(repeat):
                for sharded in (False, True):
                    runs[sharded].append(worker_drain(server, events, aggregates, workers, sharded))
            for sharded in (False, True):
                cells = []
                for burst, what in ((0, "first burst"), (1, "warm")):
                    r = [d[burst] for d in runs[sharded]]
                    cells.append(f"{what} {statistics.median(x[0] for x in r):>8,.0f}/s "
                                 f"({min(x[1] for x in r)}-{max(x[1] for x in r)} took part, "
                                 f"CPU {statistics.median(x[2] for x in r):.2f} s)")
                print(f"    {workers} worker{'s' if workers > 1 else ' '} {'shards   ' if sharded else 'no shards'}  "
                      f"{'   '.join(cells)}   load {load()}", flush=True)
                if split:
                    parts = []
                    for burst, what in ((0, "first"), (1, "warm")):
                        split_of = [d[burst][3] for d in runs[sharded]]
                        own, served, opened = (statistics.median(x[k] for x in split_of) for k in range(3))
                        parts.append(f"{what}: workers {own:.2f} s, their sessions {served:.2f} s, "
                                     f"sessions opened {opened:.0f}")
                    print(f"      {'   '.join(parts)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="host=127.0.0.1 user=postgres")
    ap.add_argument("--only", choices=("cost", "drain", "workers"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=3, help="drains per configuration; the median is shown")
    ap.add_argument("--cold", action="store_true",
                    help="drain: no warm-up claim; each connection's first claim (its plans) falls in the time")
    ap.add_argument("--workers", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8], metavar="N,N",
                    help="workers: the fleet sizes to run (default 1,2,4,8)")
    ap.add_argument("--split", action="store_true",
                    help="workers: also where each burst's CPU goes (worker processes, their sessions, "
                         "sessions opened)")
    ap.add_argument("--mixes", type=lambda t: sorted({int(x) for x in t.split(",")}), default=None, metavar="N,N",
                    help="drain, workers: the mixes to run, 1 (200,000 over 50,000; --quick 50,000 over 12,500) "
                         "and/or 2 (20,000 over 200); default both")
    a = ap.parse_args()
    if not a.workers or min(a.workers) < 1:
        ap.error("--workers: one or more counts of at least 1")
    if a.mixes is not None and (not a.mixes or not set(a.mixes) <= {1, 2}):
        ap.error("--mixes: 1, 2 or 1,2")
    # SIGTERM as Ctrl-C: the claimers are told to stop and joined, the databases dropped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"bench/shards.py on {os.uname().nodename}, {os.cpu_count()} CPUs, load {load()}")
    if a.only in (None, "cost"):
        part_cost(a.server)
    if a.only in (None, "drain"):
        part_drain(a.server, a.quick, max(1, a.repeat), a.cold, a.mixes)
    if a.only in (None, "workers"):
        part_workers(a.server, a.quick, max(1, a.repeat), a.workers, a.split, a.mixes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
