"""RabbitMQ (amqp://, amqps://) for bench/sink_drain.py.

``run``: aio-pika alone, no database: ``count`` messages of ``payload`` as the sink sends them
(persistent, message_id, the Outbox-* headers, the ``mandatory`` flag), to a durable topic
exchange with a durable queue bound, on ONE channel in publisher-confirm mode, INFLIGHT lanes at
once, each publishing its next message only once the broker confirmed the one before: the sink's
shape (every run of a batch is such a lane, all on one channel) and its acknowledgement level
(basic.ack: routed and, persistent into a durable queue, on disk). Its exchange and queue are
its own, deleted after.

``prepare``/``stored``/``cleanup``: for the worker's drains, a durable queue ``<prefix>`` bound
with ``<prefix>.#`` to the URL's exchange (``?exchange=``, default ``outbox``; declared as
--ensure-sink declares it, and deleted after if this made it), and how many messages it holds.

``QUEUE_TYPE`` is the ``x-queue-type`` of every queue these declare: ``classic`` unless
bench/sink_drain.py's ``--amqp-queue-type`` sets it (``quorum``: RabbitMQ's replicated queue).

The broker's own confirm latency, the floor under the worker's commit -> stored latency:

    .venv/bin/python bench/sink_limits/rabbitmq.py latency [--url amqp://guest:guest@127.0.0.1:5672/]
        [--rate 1000] [--seconds 15] [--repeat 1] [--queue-types classic,quorum]

publishes the drain's message at ``--rate`` a second, arrivals spaced as pgbench -R spaces its
transactions (Poisson), each in a task of its own that does not wait for the others (independent
aggregates: one event each, nothing pipelined behind it), on one channel in confirm mode with
the ``mandatory`` flag, to a durable topic exchange and a durable queue of its own (deleted
after), as ``run`` does; once persistent (the sink's messages: confirmed once on disk), once
transient (confirmed once enqueued: the same path without the disk). For each it prints
publish -> confirm p50 / p99 / max, and how late the publishes started against their schedule
(the client's own event loop falling behind). ``--repeat`` alternates the two that many times.
``--queue-types`` picks the queue's type (``x-queue-type``), each in turn: ``classic`` (the
default, as the drains use) or ``quorum`` (RabbitMQ's replicated queue, confirmed once its log
is on disk), whose confirms wait for the disk differently.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import aio_pika
from aio_pika.abc import AbstractConnection, AbstractExchange

INFLIGHT = 200
QUEUE_TYPES = ("classic", "quorum")
QUEUE_TYPE = "classic"
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
WORKER_ARGS: list[str] = ["--ensure-sink"]

_connections: dict[str, AbstractConnection] = {}
_made_exchange: set[tuple[str, str]] = set()


def _split(url: str) -> tuple[str, str]:
    """The URL without its query (for aio-pika), and the exchange the sink publishes to."""
    parts = urlsplit(url)
    exchange = dict(parse_qsl(parts.query, keep_blank_values=True)).get("exchange", "outbox")
    return urlunsplit((parts.scheme, parts.netloc, parts.path, "", "")), exchange


async def _connection(url: str) -> AbstractConnection:
    c = _connections.get(url)
    if c is None or c.is_closed:
        c = _connections[url] = await aio_pika.connect(url)
    return c


async def prepare(url: str, prefix: str) -> None:
    server, exchange = _split(url)
    channel = await (await _connection(server)).channel()
    try:
        try:
            await channel.declare_exchange(exchange, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            channel = await (await _connection(server)).channel()
            await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
            _made_exchange.add((server, exchange))
        queue = await channel.declare_queue(prefix, durable=True, arguments={"x-queue-type": QUEUE_TYPE})
        await queue.bind(exchange, f"{prefix}.#")
    finally:
        await channel.close()


async def stored(url: str, prefix: str) -> int:
    server, _ = _split(url)
    channel = await (await _connection(server)).channel()
    try:
        queue = await channel.declare_queue(prefix, passive=True)
        return int(queue.declaration_result.message_count or 0)
    finally:
        await channel.close()


async def cleanup(url: str, prefix: str) -> None:
    server, exchange = _split(url)
    connection = await _connection(server)
    try:
        channel = await connection.channel()
        await channel.queue_delete(prefix)
        if (server, exchange) in _made_exchange:
            await channel.exchange_delete(exchange)
            _made_exchange.discard((server, exchange))
    finally:
        await connection.close()
        _connections.pop(server, None)


def _message(payload: bytes, i: int, aggregate: str, persistent: bool = True) -> aio_pika.Message:
    """The message the sink sends for event ``i`` (body, properties, headers)."""
    mode = aio_pika.DeliveryMode.PERSISTENT if persistent else aio_pika.DeliveryMode.NOT_PERSISTENT
    return aio_pika.Message(payload, content_type="application/json", delivery_mode=mode,
                            message_id=f"lim-{i}-{uuid.uuid4()}", type="updated", timestamp=time.time(),
                            headers={"Outbox-Id": str(i), "Outbox-Event-Type": "updated",
                                     "Outbox-Aggregate-Type": "order", "Outbox-Aggregate-Id": aggregate,
                                     "Outbox-Attempt": "1"})


@contextlib.asynccontextmanager
async def _bound_exchange(url: str, prefix: str, queue_type: str = "classic",
                          ) -> AsyncIterator[tuple[AbstractExchange, str, Any]]:
    """(a durable topic exchange of its own in confirm mode, a routing key it routes to a durable
    queue, how many messages that queue holds: an async function); both deleted afterwards."""
    server, _ = _split(url)
    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(server)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(name, durable=True, arguments={"x-queue-type": queue_type})
        await queue.bind(exchange, "#")

        async def held() -> int:
            check = await connection.channel()
            return (await check.declare_queue(name, passive=True)).declaration_result.message_count or 0

        try:
            yield exchange, f"{name}.order.updated", held
        finally:
            cleanup_channel = await connection.channel()
            await cleanup_channel.queue_delete(name)
            await cleanup_channel.exchange_delete(name)
    finally:
        await connection.close()


async def run(url: str, count: int, payload: bytes) -> float:
    async with _bound_exchange(url, "lim", QUEUE_TYPE) as (exchange, routing_key, held):
        next_id = iter(range(1, count + 1))

        async def lane() -> None:
            for i in next_id:
                await exchange.publish(_message(payload, i, str(i % INFLIGHT)), routing_key=routing_key,
                                       mandatory=True)

        t0 = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(INFLIGHT)))
        elapsed = time.monotonic() - t0
        stored = await held()
        assert stored == count, f"the queue holds {stored} of {count}"
    return count / elapsed


async def latency(url: str, rate: float, seconds: float, payload: bytes, persistent: bool,
                  queue_type: str = "classic") -> dict[str, float]:
    """Publish -> confirm of one message at a time at ``rate`` a second (see the module's docstring)."""
    async with _bound_exchange(url, "lat", queue_type) as (exchange, routing_key, held):
        confirmed: list[float] = []
        late: list[float] = []
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int, due: float) -> None:
            message = _message(payload, i, str(i), persistent)
            start = time.perf_counter()
            late.append(start - due)
            await exchange.publish(message, routing_key=routing_key, mandatory=True)
            confirmed.append(time.perf_counter() - start)

        arrivals = random.Random(27)
        t0 = due = time.perf_counter()
        i = 0
        while True:
            due += arrivals.expovariate(rate)
            if due - t0 >= seconds:
                break
            wait = due - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            i += 1
            task = asyncio.create_task(one(i, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elapsed = time.perf_counter() - t0
        await asyncio.gather(*tasks)
        stored = await held()
        assert stored == i, f"the queue holds {stored} of {i}"
    confirmed.sort()
    late.sort()
    return {"sent": i, "achieved": i / elapsed, "p50": 1000 * _pct(confirmed, 0.5),
            "p99": 1000 * _pct(confirmed, 0.99), "max": 1000 * confirmed[-1], "late_p99": 1000 * _pct(late, 0.99)}


def _pct(ordered: list[float], q: float) -> float:
    """The nearest-rank percentile (PostgreSQL's percentile_disc, as bench/sink_drain.py takes it)."""
    return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description="RabbitMQ's publish -> confirm latency, one message at a time at a "
                                 "steady rate (see the module's docstring)")
    ap.add_argument("mode", choices=["latency"])
    ap.add_argument("--url", default=DEFAULT_URL, help=f"the broker (default {DEFAULT_URL})")
    ap.add_argument("--rate", type=float, default=1000.0, help="messages a second (default 1000)")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds of each measurement (default 15)")
    ap.add_argument("--repeat", type=int, default=1, help="persistent and transient alternated this many times")
    ap.add_argument("--queue-types", default="classic", metavar="TYPE,TYPE",
                    help="the queue's x-queue-type, each in turn: classic (default) and/or quorum")
    a = ap.parse_args()
    types = [t.strip() for t in a.queue_types.split(",") if t.strip()]
    if not types or any(t not in QUEUE_TYPES for t in types):
        ap.error(f"--queue-types: classic and/or quorum, comma-separated, got {a.queue_types!r}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from sink_drain import PAYLOAD

    print(f"rabbitmq latency {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {a.rate:,.0f} messages/s for {a.seconds:g} s, "
          f"one at a time, confirm mode, mandatory, a durable topic exchange and a durable queue "
          f"({', '.join(types)})", flush=True)
    for n in range(a.repeat):
        for queue_type in types:
            for persistent in (True, False):
                load = os.getloadavg()[0]
                r = asyncio.run(latency(a.url, a.rate, a.seconds, PAYLOAD, persistent, queue_type))
                kind = "persistent" if persistent else "transient "
                print(f"  {n + 1}. {queue_type} {kind} (load {load:.1f}): {r['sent']:,} at {r['achieved']:,.0f}/s, "
                      f"publish -> confirm p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms, max {r['max']:.1f} ms "
                      f"(publishes started late by up to {r['late_p99']:.1f} ms at p99)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
