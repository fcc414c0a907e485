"""Each sink end to end beside its own limit: outboxpg-worker --sink URL draining a backlog, the
latency at a steady rate, and the sink's client alone publishing the same messages.

    .venv/bin/python bench/sink_drain.py                          # NATS: a nats-server of its own
    .venv/bin/python bench/sink_drain.py --sink nats://127.0.0.1:4222 --sink amqp://guest:guest@127.0.0.1:5672/
    .venv/bin/python bench/sink_drain.py --quick                  # smaller counts (about a minute a sink)

For each --sink URL (none: a nats-server started in a temp dir, removed at the end):
  drain    20,000 events over 200 aggregates, and 200,000 over 50,000 (--quick: 5,000 / 200 and
           20,000 / 5,000), prefilled by one INSERT ... SELECT (then VACUUM ANALYZE, CHECKPOINT)
           into a database of their own, delivered by ONE outboxpg-worker process with its default
           flags (and the family's WORKER_ARGS); timed from the worker's start until the server
           holds the last event (the family's ``stored()``, polled every 20 ms; without one, until
           the database has the last event published, which comes after the server's ack).
  latency  1,000 events/s for 15 s (--quick 5 s) from pgbench (-R, 4 clients, one INSERT per
           transaction, synchronous_commit off) over 100,000 aggregates, one worker running
           idle before: commit -> stored, as p50 / p99 / max of the server's own time of each
           event (the family's ``stored_at()``: JetStream's message timestamp, the Redis entry
           id's millisecond, the webhook receiver's arrival) - created_at, and commit -> reported,
           published_at - created_at (the report after the server's ack, an upper bound; the only
           figure for a family without ``stored_at``); created_at is the transaction's start, a
           millisecond or less before its commit here.
  limit    the sink's client alone, no database: ``bench/sink_limits/<family>.py``'s
           ``run(url, count, payload)`` publishes the drain's message (same payload, headers,
           acknowledgement level) ``count`` times; events/s. outboxpg's share of it is the
           larger drain's rate over the limit (target >= 70 %).

A family module (nats for nats:// and tls://; rabbitmq for amqp://, amqps://; redis; mqtt;
webhooks for http://, https://) has

    async def run(url: str, count: int, payload: bytes) -> float             # required: events/s
    async def prepare(url: str, prefix: str) -> None    # optional: an empty target for subjects <prefix>.*
    async def stored(url: str, prefix: str) -> int      # optional: messages the server holds for them
    async def stored_at(url: str, prefix: str) -> dict[str, float]   # optional: msg_id -> when the server stored it
    async def cleanup(url: str, prefix: str) -> None    # optional: remove what prepare made
    WORKER_ARGS: list[str]                              # optional: flags for the worker (--ensure-sink, ...)

For amqp://, ``--amqp-queue-type quorum`` makes the queue the drains, the latency and the client
alone publish into a quorum queue instead of a classic one (RabbitMQ confirms a persistent message
once the queue has it on disk, and the two types write to disk differently).

Each run uses a subject prefix of its own (outbox_settings.subject_prefix), a template database
migrated once and a throwaway database per measurement on --dsn's server (default the service on
127.0.0.1:5432), all dropped at the end; it stops only the processes it started, by PID. The CPU
other processes took meanwhile ("foreign", bench/proc_cpu.py) is printed beside each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
import processes  # noqa: E402
from proc_cpu import CpuMeter  # noqa: E402

from outboxpg import schema  # noqa: E402
from outboxpg.embedded import EmbeddedNats  # noqa: E402
from outboxpg.sinks.base import without_credentials  # noqa: E402

WORKER = Path(sys.executable).parent / "outboxpg-worker"
FAMILIES = {"nats": "nats", "tls": "nats", "amqp": "rabbitmq", "amqps": "rabbitmq", "redis": "redis",
            "rediss": "redis", "mqtt": "mqtt", "mqtts": "mqtt", "http": "webhooks", "https": "webhooks"}
# The drains' payload, as bench/key_mix.py writes it (the limit publishes the same bytes).
PAYLOAD = orjson.dumps({"n": 123456, "note": "a typical small event payload", "order": 4567})


def log(text: str = "") -> None:
    print(text, flush=True)


def family_of(url: str) -> ModuleType:
    scheme = urlsplit(url).scheme.lower()
    name = FAMILIES.get(scheme)
    if name is None:
        raise SystemExit(f"sink_drain: unknown scheme {scheme!r} in {without_credentials(url)}")
    path = HERE / "sink_limits" / f"{name}.py"
    if not path.exists():
        raise SystemExit(f"sink_drain: no {path.relative_to(ROOT)} for {scheme}://")
    spec = importlib.util.spec_from_file_location(f"sink_limits_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Drain:
    n: int
    aggregates: int
    seconds: float = 0.0
    delivered: int = 0
    capped: bool = False
    foreign: float = 0.0
    by: str = "server"

    @property
    def rate(self) -> float:
        return self.delivered / self.seconds if self.seconds else 0.0


@dataclass
class Result:
    url: str
    drains: list[Drain] = field(default_factory=list)
    latency: dict[str, Any] = field(default_factory=dict)
    limit: float = 0.0
    limit_foreign: float = 0.0


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tag = f"sd{os.getpid()}"
        self.tmp = Path(tempfile.mkdtemp(prefix="outboxpg-sinkdrain-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.dbs: set[str] = set()
        self.pgbench = args.pgbench or shutil.which("pgbench") or "/usr/lib/postgresql/15/bin/pgbench"
        self.template = f"{self.tag}_tpl"

    # -- databases ---------------------------------------------------------------------------

    def admin(self, statement: str | sql.Composable, params: Any = None) -> None:
        with psycopg.connect(self.args.dsn, autocommit=True) as c:
            c.execute(statement, params)

    def dsn_for(self, dbname: str) -> str:
        return make_conninfo(self.args.dsn, dbname=dbname)

    def drop_db(self, name: str) -> None:
        self.admin(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        self.dbs.discard(name)

    def make_template(self) -> None:
        self.drop_db(self.template)
        self.admin(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.template)))
        self.dbs.add(self.template)
        schema.migrate(self.dsn_for(self.template))

    def fresh(self, name: str, prefix: str) -> str:
        self.drop_db(name)
        self.admin(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                                    sql.Identifier(self.template)))
        self.dbs.add(name)
        dsn = self.dsn_for(name)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("UPDATE outbox_settings SET subject_prefix = %s", (prefix,))
        return dsn

    def fill(self, dsn: str, n: int, aggregates: int) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                      "SELECT 'order', (g %% %s)::text, 'updated', "
                      "jsonb_build_object('order', g %% %s, 'n', g, 'note', 'a typical small event payload') "
                      "FROM generate_series(1, %s) g", (aggregates, aggregates, n))
            c.execute("VACUUM ANALYZE outbox")
        self.admin("CHECKPOINT")

    # -- the worker --------------------------------------------------------------------------

    def start_worker(self, dsn: str, url: str, family: ModuleType, name: str) -> subprocess.Popen[bytes]:
        logf = self.tmp / f"worker-{name}-{len(self.procs)}.log"
        with open(logf, "wb") as err:
            p = subprocess.Popen([str(WORKER), "--dsn", dsn, "--sink", url, *getattr(family, "WORKER_ARGS", []),
                                  "--name", name, "--log-level", "WARNING"],
                                 stdout=subprocess.DEVNULL, stderr=err)
        p.log = logf  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    @staticmethod
    def tail(p: subprocess.Popen[bytes]) -> str:
        return "".join(Path(p.log).read_text(errors="replace").splitlines(True)[-15:])  # type: ignore[attr-defined]

    def stop_worker(self, p: subprocess.Popen[bytes]) -> None:
        processes.stop(p, self.procs)

    # -- measurements ------------------------------------------------------------------------

    async def drain(self, url: str, family: ModuleType, n: int, aggregates: int, cap: float) -> Drain:
        prefix = f"{self.tag}d{uuid.uuid4().hex[:6]}"
        dbname = f"{self.tag}_drain"
        dsn = self.fresh(dbname, prefix)
        if hasattr(family, "prepare"):
            await family.prepare(url, prefix)
        d = Drain(n, aggregates, by="server" if hasattr(family, "stored") else "database")
        try:
            self.fill(dsn, n, aggregates)
            with psycopg.connect(dsn, autocommit=True) as watch:
                async def done() -> int:
                    if hasattr(family, "stored"):
                        return int(await family.stored(url, prefix))
                    row = watch.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()
                    return int(row[0]) if row else 0

                meter = CpuMeter(dbname, interval=0.5).start()
                t0 = time.monotonic()
                p = self.start_worker(dsn, url, family, "drain")
                try:
                    while True:
                        got = await done()
                        now = time.monotonic()
                        if got >= n or now - t0 >= cap:
                            break
                        if p.poll() is not None:
                            raise RuntimeError(f"the worker exited with {p.returncode}, {got} of {n} stored:\n"
                                               f"{self.tail(p)}")
                        await asyncio.sleep(0.02)
                finally:
                    meter.stop()
                    self.stop_worker(p)
                d.seconds, d.delivered, d.capped, d.foreign = now - t0, got, got < n, meter.foreign
        finally:
            if hasattr(family, "cleanup"):
                await family.cleanup(url, prefix)
            self.drop_db(dbname)
        return d

    async def latency(self, url: str, family: ModuleType, rate: int, seconds: int) -> dict[str, Any]:
        prefix = f"{self.tag}l{uuid.uuid4().hex[:6]}"
        dbname = f"{self.tag}_latency"
        dsn = self.fresh(dbname, prefix)
        if hasattr(family, "prepare"):
            await family.prepare(url, prefix)
        script = self.tmp / "latency.sql"
        script.write_text("\\set a random(1, 100000)\n"
                          "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                          "VALUES ('order', :a, 'updated', jsonb_build_object('order', :a::int, 'n', 1, "
                          "'note', 'a typical small event payload'));\n")
        p = self.start_worker(dsn, url, family, "latency")
        try:
            await asyncio.sleep(2.0)   # up and idle
            if p.poll() is not None:
                raise RuntimeError(f"the worker exited with {p.returncode}:\n{self.tail(p)}")
            conn = conninfo_to_dict(dsn)
            with CpuMeter(dbname, interval=0.5) as meter:
                pg = await asyncio.create_subprocess_exec(
                    self.pgbench, "-h", str(conn.get("host", "127.0.0.1")), "-p", str(conn.get("port", 5432)),
                    "-U", str(conn.get("user", "postgres")), "-n", "-M", "prepared", "-f", str(script), "-c", "4",
                    "-j", "2", "-R", str(rate), "-T", str(seconds), dbname,
                    env={**os.environ, "PGOPTIONS": "-c synchronous_commit=off"},
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
                out, _ = await pg.communicate()
            text = out.decode(errors="replace")
            sent = int(next((ln.split(":")[1] for ln in text.splitlines() if "actually processed" in ln), "0"))
            with psycopg.connect(dsn, autocommit=True) as c:
                end = time.monotonic() + 30
                while True:
                    row = c.execute("SELECT count(*) FILTER (WHERE state = 'published'), count(*) FROM outbox").fetchone()
                    assert row is not None
                    if row[0] >= row[1] or time.monotonic() > end:
                        break
                    await asyncio.sleep(0.1)
                stats = c.execute(
                    "SELECT count(*), 1000 * extract(epoch FROM percentile_disc(0.5) WITHIN GROUP (ORDER BY d)), "
                    "1000 * extract(epoch FROM percentile_disc(0.99) WITHIN GROUP (ORDER BY d)), "
                    "1000 * extract(epoch FROM max(d)) "
                    "FROM (SELECT published_at - created_at AS d FROM outbox WHERE state = 'published') s").fetchone()
                created = c.execute("SELECT msg_id::text, extract(epoch FROM created_at)::float8 FROM outbox "
                                    "WHERE state = 'published'").fetchall()
            assert stats is not None
            published = int(stats[0])
            if not published:
                raise RuntimeError(f"nothing published; pgbench said:\n{text}\nthe worker:\n{self.tail(p)}")
            result = {"sent": sent, "published": published, "achieved": sent / seconds, "p50": float(stats[1]),
                      "p99": float(stats[2]), "max": float(stats[3]), "foreign": meter.foreign}
            if hasattr(family, "stored_at"):
                # The server's own time of each event (JetStream's message timestamp, the Redis
                # entry id's millisecond, the webhook receiver's arrival), not the report's.
                times = await family.stored_at(url, prefix)
                waits = sorted(1000 * (times[m] - t) for m, t in created if m in times)
                if waits:
                    result["stored"] = {"n": len(waits), "p50": nearest_rank(waits, 0.5),
                                        "p99": nearest_rank(waits, 0.99), "max": waits[-1]}
            return result
        finally:
            self.stop_worker(p)
            if hasattr(family, "cleanup"):
                await family.cleanup(url, prefix)
            self.drop_db(dbname)

    async def limit(self, url: str, family: ModuleType, count: int) -> tuple[float, float]:
        with CpuMeter("-", interval=0.5) as meter:
            rate = float(await family.run(url, count, PAYLOAD))
        return rate, meter.foreign

    def cleanup(self) -> None:
        for p in list(self.procs):
            try:
                self.stop_worker(p)
            except Exception:  # noqa: BLE001
                pass
        for name in list(self.dbs):
            try:
                self.drop_db(name)
            except Exception:  # noqa: BLE001
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def nearest_rank(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values by nearest rank: PostgreSQL's percentile_disc, which gives
    the commit -> reported figures printed beside these."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def sink_row(r: Result, quick: bool) -> list[str]:
    share = f"{100 * r.drains[-1].rate / r.limit:.0f} %" if r.limit and r.drains else "-"
    lines = [f"{without_credentials(r.url)}"]
    for d in r.drains:
        lines.append(f"  drain {d.n:>7,} over {d.aggregates:>6,} aggregates: {d.rate:>9,.0f} events/s "
                     f"({d.delivered:,} in {d.seconds:.2f} s{', CAPPED' if d.capped else ''}; timed by the {d.by}; "
                     f"foreign CPU {d.foreign:.0f} %)")
    lat = r.latency
    if lat:
        st = lat.get("stored")
        if st:
            lines.append(f"  latency at {lat['achieved']:,.0f}/s ({st['n']:,} of {lat['sent']:,}): commit -> stored "
                         f"(the server's time) p50 {st['p50']:.1f} ms, p99 {st['p99']:.1f} ms, max {st['max']:.1f} ms "
                         f"(target p99 <= 20 ms; foreign CPU {lat['foreign']:.0f} %)")
        lines.append(f"  latency at {lat['achieved']:,.0f}/s ({lat['published']:,} of {lat['sent']:,}): "
                     f"commit -> reported p50 {lat['p50']:.1f} ms, p99 {lat['p99']:.1f} ms, "
                     f"max {lat['max']:.1f} ms ("
                     f"{'' if st else 'the server tells no time: an upper bound of commit -> stored, target p99 <= 20 ms; '}"
                     f"foreign CPU {lat['foreign']:.0f} %)")
    if r.limit:
        lines.append(f"  limit, the client alone: {r.limit:>9,.0f} events/s (foreign CPU {r.limit_foreign:.0f} %); "
                     f"outboxpg at {share} of it on the larger drain (target >= 70 %)")
    return lines


async def run_sink(b: Bench, url: str, a: argparse.Namespace) -> Result:
    family = family_of(url)
    if hasattr(family, "QUEUE_TYPE"):
        family.QUEUE_TYPE = a.amqp_queue_type
        log(f"  into a durable {a.amqp_queue_type} queue")
    r = Result(url)
    drains = [(5_000, 200), (20_000, 5_000)] if a.quick else [(20_000, 200), (200_000, 50_000)]
    for n, aggregates in drains if a.only in (None, "drain") else []:
        log(f"  draining {n:,} over {aggregates:,} ...")
        r.drains.append(await b.drain(url, family, n, aggregates, cap=a.cap))
    if not a.no_latency and a.only in (None, "latency"):
        log(f"  latency at {a.rate}/s for {a.seconds} s ...")
        r.latency = await b.latency(url, family, a.rate, a.seconds)
    if a.only in (None, "limit"):
        count = a.limit_count or drains[-1][0]
        log(f"  the client alone, {count:,} messages ...")
        r.limit, r.limit_foreign = await b.limit(url, family, count)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sink", action="append", default=[], metavar="URL",
                    help="a sink URL, as outboxpg-worker --sink takes it (repeat); none: a nats-server of its own")
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres"),
                    help="PostgreSQL to make the throwaway databases on")
    ap.add_argument("--quick", action="store_true", help="smaller drains, 5 s of latency")
    ap.add_argument("--rate", type=int, default=1000, help="events/s of the latency measurement")
    ap.add_argument("--seconds", type=int, default=None, help="seconds of the latency measurement (15; --quick 5)")
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--only", choices=["drain", "latency", "limit"], default=None,
                    help="run only the drains, only the latency or only the client alone")
    ap.add_argument("--cap", type=float, default=300.0, help="stop a drain after this many seconds, marked CAPPED")
    ap.add_argument("--limit-count", type=int, default=None, help="messages the client alone publishes "
                    "(default: the larger drain's count)")
    ap.add_argument("--pgbench", default=None)
    ap.add_argument("--amqp-queue-type", choices=["classic", "quorum"], default="classic",
                    help="x-queue-type of the queue that amqp:// drains, latency and limit publish into")
    a = ap.parse_args()
    a.seconds = a.seconds or (5 if a.quick else 15)
    b = Bench(a)
    own_nats: EmbeddedNats | None = None
    results: list[Result] = []
    try:
        if not a.sink:
            own_nats = EmbeddedNats().start()
            a.sink = [own_nats.url]
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False).stdout.strip()
        log(f"sink_drain {time.strftime('%Y-%m-%d %H:%M:%S %Z')} commit {rev} on {platform.node()}, "
            f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {'--quick' if a.quick else 'full'}")
        b.make_template()
        for url in a.sink:
            log(f"{without_credentials(url)}:")
            results.append(asyncio.run(run_sink(b, url, a)))
    finally:
        b.cleanup()
        if own_nats is not None:
            own_nats.stop(remove=True)
    log("")
    for r in results:
        for line in sink_row(r, a.quick):
            log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
