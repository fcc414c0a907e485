"""The Redis Streams case: a redis-server of the case's own (tests/sinks/redisd.py: an AOF fsynced
on every write, so stop() and start() keep what it stored), with proto-max-bulk-len at its
minimum of 1 MiB so that a payload can be too large; the worker through a TcpProxy, a stream per
subject (the sink's default); read back with XRANGE of every stream, merged by entry id (the
conformance tests' events of one aggregate share one subject, so one stream)."""

from __future__ import annotations

import heapq
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conformance import SinkCase, Stored
from proxy import TcpProxy
from redisd import RedisServer, redis_server_binary

MAX_BULK = 1024 * 1024


def _entry_key(entry_id: bytes) -> tuple[int, int]:
    ms, _, seq = entry_id.partition(b"-")
    return int(ms), int(seq)


class RedisCase(SinkCase):
    name = "redis"
    too_large = b'"' + b"x" * MAX_BULK + b'"'
    refused_reason = "proto-max-bulk-len"
    dedups = True
    # The sink stores a run in one script call, a batch of 10 such runs in one round trip: the
    # slow-server test needs each answer late enough to keep a batch past a third of the 12 s lease
    # (4 s), and early enough to leave room before the 6 s publish timeout on a busy machine. A
    # timeout costs more than one late answer here: the new connection's handshake is late too.
    slow_latency = 4.3
    # A run is one script call: 30 calls, about 8 one after another per aggregate, for 600 events.
    strike_latency = 0.1

    def __init__(self, server: RedisServer, proxy: TcpProxy) -> None:
        self.server = server
        self.proxy = proxy
        self.url = f"redis://127.0.0.1:{proxy.port}"

    async def read_back(self) -> list[Stored]:
        client = self.server.client()
        try:
            streams = [key async for key in client.scan_iter(_type="stream")]
            per_stream = [[(_entry_key(i), fields) for i, fields in await client.xrange(key)] for key in streams]
        finally:
            await client.aclose()
        out: list[Stored] = []
        for _, fields in heapq.merge(*per_stream, key=lambda entry: entry[0]):
            text = {k.decode(): v for k, v in fields.items()}
            payload = text.pop("payload")
            headers = {k: v.decode() for k, v in text.items()}
            out.append(Stored(msg_id=headers["msg_id"], subject=headers["subject"], headers=headers, payload=payload))
        return out

    async def stop(self) -> None:
        await self.server.stop()

    async def start(self) -> None:
        await self.server.start()


@pytest.fixture
async def redis_case(tmp_path: Path) -> AsyncIterator[RedisCase]:
    redis_server_binary()   # skips, naming it, where redis-server is not installed
    server = RedisServer(tmp_path / "redis-case", ["--proto-max-bulk-len", str(MAX_BULK)])
    await server.start()
    proxy = TcpProxy("127.0.0.1", server.port)
    try:
        await proxy.start()
        yield RedisCase(server, proxy)
    finally:
        await proxy.close()
        await server.stop()

