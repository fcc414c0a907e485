"""What --standby-flushed adds to latency, and what synchronous replication costs producers.

    .venv/bin/python bench/standby_flush.py                 # about 25 s
    .venv/bin/python bench/standby_flush.py --fsync         # with fsync on both servers

Starts a throwaway primary and a streaming standby (pg_basebackup -R) on this machine, installs
the schema, and runs a worker in this process whose publisher only notes when each event reached
it (no broker: the figure is what the worker adds). A producer commits one event per
transaction at --rate for --seconds in each phase:

  async            asynchronous replication, the worker without --standby-flushed (the default);
  standby-flushed  asynchronous replication, the worker with --standby-flushed any;
  synchronous      synchronous_standby_names = 'standby1' (synchronous_commit = on): each
                   producer's COMMIT waits for the standby's flush; the worker without the option.

Prints per phase: commit -> publisher latency p50 / p90 / p99 / max (from COMMIT returning in
the producer to the publisher's call; negative values are events delivered before COMMIT
returned to the producer), and the producer's COMMIT time p50 / p99. Both servers share this
machine (a standby one network hop away adds that round trip); throwaway clusters run with fsync
off unless --fsync, which makes each flush cost what this disk's fsync costs.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import psycopg

from outboxpg import schema
from outboxpg.embedded import EmbeddedPostgres, EmbeddedStandby
from outboxpg.events import OutboxEvent
from outboxpg.relay.worker import Worker, WorkerConfig


def quantiles(values: list[float]) -> str:
    ordered = sorted(values)

    def q(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000

    return f"p50 {q(0.5):7.2f} ms  p90 {q(0.9):7.2f} ms  p99 {q(0.99):7.2f} ms  max {ordered[-1] * 1000:7.2f} ms"


async def phase(name: str, dsn: str, standby_flushed: str, rate: float, seconds: float) -> None:
    reached: dict[str, float] = {}

    async def publish(event: OutboxEvent) -> None:
        reached[event.msg_id] = time.monotonic()

    worker = Worker(WorkerConfig(dsn=dsn, standby_flushed=standby_flushed, maintenance_interval=0,
                                 summary_interval=3600, poll_interval=5), publish)
    task = asyncio.create_task(worker.run())
    committed: dict[str, float] = {}
    commit_times: list[float] = []
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await asyncio.sleep(1.0)   # the worker is up and idle
        total = int(rate * seconds)
        start = time.monotonic()
        for n in range(total):
            await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
            msg_id = str(uuid.uuid4())
            await conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, msg_id) "
                               "VALUES ('order', %s, 'created', '{}', %s)", (str(n % 50), msg_id))
            t = time.monotonic()
            await conn.commit()
            committed[msg_id] = time.monotonic()
            commit_times.append(committed[msg_id] - t)
    deadline = time.monotonic() + 20
    while len(reached) < len(committed) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    worker.stop()
    await task
    latencies = [reached[m] - committed[m] for m in committed if m in reached]
    print(f"{name:16s} {len(latencies):5d}/{len(committed)} delivered  commit->publisher {quantiles(latencies)}")
    print(f"{'':16s} producer COMMIT {quantiles(commit_times)}")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0, help="events per second (one per transaction)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per phase")
    ap.add_argument("--fsync", action="store_true", help="fsync on (default: off, as in the tests)")
    args = ap.parse_args()
    durability = {"fsync": "on", "full_page_writes": "on"} if args.fsync else {}
    with EmbeddedPostgres(settings=durability) as primary:
        with psycopg.connect(primary.dsn, autocommit=True) as c:
            c.execute("CREATE DATABASE bench")
        dsn = primary.dsn_for("bench")
        schema.migrate(dsn)
        with EmbeddedStandby(primary, name="standby1", settings=durability):
            print(f"primary :{primary.port}, streaming standby standby1, fsync {'on' if args.fsync else 'off'}, "
                  f"{args.rate:g} events/s for {args.seconds:g} s per phase")
            await phase("async", dsn, "", args.rate, args.seconds)
            await phase("standby-flushed", dsn, "any", args.rate, args.seconds)
            with psycopg.connect(primary.dsn, autocommit=True) as c:
                c.execute("ALTER SYSTEM SET synchronous_standby_names = 'standby1'")
                c.execute("SELECT pg_reload_conf()")
            await phase("synchronous", dsn, "", args.rate, args.seconds)


if __name__ == "__main__":
    asyncio.run(main())
