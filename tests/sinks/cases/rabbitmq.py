"""The RabbitMQ case: a private rabbitmq-server (tests/rabbitmq_broker.py: its own node, ports,
config and data in a temp dir) for the session, stopped and started with its data kept, with
``max_message_size`` 1 MiB; per test a durable topic exchange (declared by the worker's
--ensure-sink) and a durable queue bound to it with ``#``, both deleted after; the worker through
a TcpProxy; read back by taking every message off the queue, in queue order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import aio_pika
import pytest
from conformance import SinkCase, Stored
from proxy import TcpProxy
from rabbitmq_broker import PrivateRabbitMQ, private_broker_missing, unique

# The private broker's max_message_size: a payload one byte over it is refused by the server.
MAX_MESSAGE_SIZE = 1024 * 1024


class RabbitMQCase(SinkCase):
    name = "rabbitmq"
    worker_args = ("--ensure-sink",)
    too_large = b'"' + b"x" * MAX_MESSAGE_SIZE + b'"'
    refused_reason = "max_message_size"

    def __init__(self, broker: PrivateRabbitMQ, proxy: TcpProxy, exchange: str, queue: str) -> None:
        self.broker, self.proxy, self.exchange, self.queue = broker, proxy, exchange, queue
        self.url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/?exchange={exchange}"

    async def read_back(self) -> list[Stored]:
        connection = await aio_pika.connect(self.broker.url)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(self.queue, durable=True)
            out: list[Stored] = []
            while (m := await queue.get(no_ack=True, fail=False)) is not None:
                headers = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in (m.headers or {}).items()}
                out.append(Stored(msg_id=m.message_id or "", subject=m.routing_key or "", headers=headers,
                                  payload=m.body))
            return out
        finally:
            await connection.close()

    async def stop(self) -> None:
        await asyncio.to_thread(self.broker.stop)

    async def start(self) -> None:
        await asyncio.to_thread(self.broker.start)


@pytest.fixture(scope="session")
def rabbitmq_private_broker() -> Iterator[PrivateRabbitMQ]:
    """The session's private broker (max_message_size 1 MiB), for the case and test_rabbitmq.py."""
    missing = private_broker_missing()
    if missing:
        pytest.skip(missing)
    broker = PrivateRabbitMQ(max_message_size=MAX_MESSAGE_SIZE)
    try:
        broker.start()
        yield broker
    finally:
        broker.close()


@pytest.fixture
async def rabbitmq_case(rabbitmq_private_broker: PrivateRabbitMQ) -> AsyncIterator[RabbitMQCase]:
    if rabbitmq_private_broker.process is None:
        await asyncio.to_thread(rabbitmq_private_broker.start)   # a test before stopped it and failed
    exchange, queue = unique("outboxpg-conformance"), unique("outboxpg-conformance")
    connection = await aio_pika.connect(rabbitmq_private_broker.url)
    try:
        channel = await connection.channel()
        ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        await (await channel.declare_queue(queue, durable=True)).bind(ex, "#")
    finally:
        await connection.close()
    proxy = TcpProxy("127.0.0.1", rabbitmq_private_broker.port)
    try:
        await proxy.start()
        yield RabbitMQCase(rabbitmq_private_broker, proxy, exchange, queue)
    finally:
        await proxy.close()
        if rabbitmq_private_broker.process is None:
            await asyncio.to_thread(rabbitmq_private_broker.start)
        connection = await aio_pika.connect(rabbitmq_private_broker.url)
        try:
            channel = await connection.channel()
            await channel.queue_delete(queue)
            await channel.exchange_delete(exchange)
        finally:
            await connection.close()
