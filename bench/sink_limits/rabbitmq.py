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
"""

from __future__ import annotations

import asyncio
import time
import uuid
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import aio_pika
from aio_pika.abc import AbstractConnection

INFLIGHT = 200
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
        queue = await channel.declare_queue(prefix, durable=True)
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


async def run(url: str, count: int, payload: bytes) -> float:
    server, _ = _split(url)
    name = f"lim{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(server)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(name, durable=True)
        await queue.bind(exchange, "#")
        routing_key = f"{name}.order.updated"
        next_id = iter(range(1, count + 1))

        async def lane() -> None:
            for i in next_id:
                message = aio_pika.Message(
                    payload, content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=f"lim-{i}-{uuid.uuid4()}", type="updated", timestamp=time.time(),
                    headers={"Outbox-Id": str(i), "Outbox-Event-Type": "updated", "Outbox-Aggregate-Type": "order",
                             "Outbox-Aggregate-Id": str(i % INFLIGHT), "Outbox-Attempt": "1"})
                await exchange.publish(message, routing_key=routing_key, mandatory=True)

        try:
            t0 = time.monotonic()
            await asyncio.gather(*(lane() for _ in range(INFLIGHT)))
            elapsed = time.monotonic() - t0
            check = await connection.channel()
            held = (await check.declare_queue(name, passive=True)).declaration_result.message_count
            assert held == count, f"the queue holds {held} of {count}"
        finally:
            cleanup_channel = await connection.channel()
            await cleanup_channel.queue_delete(name)
            await cleanup_channel.exchange_delete(name)
    finally:
        await connection.close()
    return count / elapsed
