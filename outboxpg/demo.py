"""``outboxpg demo``: the whole flow on throwaway servers, shown live.

Starts its own PostgreSQL cluster and nats-server, installs the schema, runs a worker, writes
sample orders (a business row and its events in one transaction each), consumes the events from
JetStream, prints progress and latency, and removes everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import statistics
import sys
import time
import uuid
from datetime import timedelta

import nats
import psycopg
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from outboxpg import enqueue, schema, statements
from outboxpg.embedded import EmbeddedNats, EmbeddedPostgres
from outboxpg.relay.nats.connection import supports_atomic_batch
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.nats.streams import ensure_stream
from outboxpg.relay.worker import Worker, WorkerConfig

STEPS = ("created", "paid", "shipped")


class LatencyClock:
    """Commit -> consumer latency per event, by msg_id.

    The clock starts when the producer sends COMMIT (``committing``), not when the commit
    returns: an event may reach the consumer before the producer has even read the commit's
    reply (the worker is woken by the NOTIFY that the commit itself sends), and an event timed
    from after that moment was not counted at all ("over 1999 events" of 2,000)."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.latencies: list[float] = []

    def committing(self, msg_id: str) -> None:
        self.started[msg_id] = time.monotonic()

    def received(self, msg_id: str) -> None:
        started = self.started.pop(msg_id, None)
        if started is not None:
            self.latencies.append(time.monotonic() - started)


def say(text: str) -> None:
    print(text, flush=True)


def run_demo(events: int = 2000, aggregates: int = 50, rate: float = 500.0) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    say("outboxpg demo: everything below runs on throwaway servers started just for it.")
    with EmbeddedPostgres() as pg:
        say(f"  PostgreSQL  started on 127.0.0.1:{pg.port} (initdb in a temp dir"
            f"{', run as user postgres' if pg._as_root else ''})")
        with EmbeddedNats() as ns:
            say(f"  nats-server started on {ns.url} with JetStream ({ns.binary})")
            applied = schema.migrate(pg.dsn)
            say(f"  schema      installed: {len(applied)} migration steps ({applied[0]} .. {applied[-1]})")
            return asyncio.run(_flow(pg.dsn, ns.url, events, aggregates, rate))


async def _flow(dsn: str, nats_url: str, events: int, aggregates: int, rate: float) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(statements.DEMO_CREATE_ORDERS)

    publisher = NatsPublisher(nats_url)
    await publisher.start()
    assert publisher.js is not None and publisher.nc is not None
    # As --ensure-stream does: allow_atomic where the server has atomic batch publish.
    say("  stream      " + await ensure_stream(publisher.js, "ORDERS", ["outbox.>"], timedelta(minutes=6),
                                                atomic=supports_atomic_batch(publisher.nc)))
    worker = Worker(WorkerConfig(dsn=dsn, batch_size=200, concurrency=2, summary_interval=3600), publisher)
    worker_task = asyncio.create_task(worker.run())

    clock = LatencyClock()
    latencies = clock.latencies
    received: list[str] = []
    sample: list[Msg] = []
    nc = await nats.connect(nats_url)
    js = nc.jetstream()

    async def on_message(msg: Msg) -> None:
        msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
        received.append(msg_id)
        clock.received(msg_id)
        if not sample:
            sample.append(msg)

    sub = await js.subscribe("outbox.>", ordered_consumer=True, cb=on_message, deliver_policy=DeliverPolicy.ALL)

    written = 0
    rng = random.Random(7)

    async def produce() -> None:
        nonlocal written
        step_of = [0] * aggregates
        async with await psycopg.AsyncConnection.connect(dsn) as producer:
            start = time.monotonic()
            while written < events:
                order = rng.randrange(aggregates)
                step = STEPS[step_of[order] % len(STEPS)]
                step_of[order] += 1
                order_id = f"order-{order:04d}"
                async with producer.transaction():
                    await producer.execute(statements.DEMO_UPSERT_ORDER, (order_id, step, rng.randrange(5, 500)))
                    msg_id = str(uuid.uuid4())  # known here, so the consumer can time this event
                    await enqueue(producer, "order", order_id, step, {"order": order_id, "status": step}, msg_id=msg_id)
                    clock.committing(msg_id)   # the block's end sends COMMIT: the event may arrive before it returns
                written += 1
                ahead = written / rate - (time.monotonic() - start)
                if ahead > 0:
                    await asyncio.sleep(ahead)

    # Written once the worker has made its first claim (its claims' connection warmed up before
    # it): what follows is the relay's steady state, not its start.
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        until = time.monotonic() + 30
        while not (await (await conn.execute(statements.DEMO_WORKER_CLAIMED)).fetchone())[0]:  # type: ignore[index]
            if time.monotonic() > until or worker_task.done():
                break       # the run below reports what did not arrive
            await asyncio.sleep(0.05)
    say(f"\nwriting {events} events for {aggregates} orders at about {rate:g}/s "
        f"(each: UPDATE orders + INSERT INTO outbox, one transaction)\n")
    producing = asyncio.create_task(produce())
    t0 = time.monotonic()
    deadline = t0 + events / rate + 60
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        lat = sorted(latencies[-2000:])
        p50 = lat[len(lat) // 2] * 1000 if lat else 0.0
        p99 = lat[int(len(lat) * 0.99)] * 1000 if lat else 0.0
        say(f"  t={time.monotonic() - t0:5.1f}s  written {written:6d}  delivered {len(received):6d}  "
            f"commit->consumer p50 {p50:6.1f} ms  p99 {p99:6.1f} ms")
        if producing.done() and len(received) >= events:
            break
    await producing

    ok = len(received) == events and len(set(received)) == events
    worker.stop()
    await worker_task
    await sub.unsubscribe()
    await nc.close()

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(statements.STATS)
        names = [d.name for d in cur.description or []]
        row = await cur.fetchone()
    say(f"\n{statements.STATS};")
    for name, value in zip(names, row or ()):
        say(f"  {name:20s} {value}")
    if sample:
        m = sample[0]
        say(f"\nfirst message in JetStream: subject {m.subject}")
        for k, v in (m.headers or {}).items():
            say(f"  {k}: {v}")
        say(f"  payload: {m.data.decode()}")
    if latencies:
        say(f"\ncommit -> consumer latency over {len(latencies)} events: "
            f"p50 {statistics.median(latencies) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")
    say(f"\n{'OK' if ok else 'PROBLEM'}: {len(received)} of {events} events delivered "
        f"({len(set(received))} distinct). Stopping and removing the throwaway servers.")
    with contextlib.suppress(Exception):
        await publisher.close()
    return 0 if ok else 1
