"""Test helpers for JetStream: a stream per test, reading back what it holds, a proxy in front of the server."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig


@dataclass
class StreamHandle:
    nc: Client
    js: JetStreamContext
    name: str
    prefix: str


async def make_stream(url: str, duplicate_window: float = 600.0, *, atomic: bool = False,
                      **config: Any) -> StreamHandle:
    """A fresh stream capturing '<prefix>.>' for a unique prefix (set it as subject_prefix);
    ``atomic``: with allow_atomic (atomic batch publish); ``config``: more StreamConfig fields."""
    tag = uuid.uuid4().hex[:10]
    nc = await nats.connect(url)
    js = nc.jetstream()
    name, prefix = f"T{tag}", f"t{tag}"
    await js.add_stream(StreamConfig(name=name, subjects=[f"{prefix}.>"], duplicate_window=duplicate_window,
                                     allow_atomic=True if atomic else None, **config))
    return StreamHandle(nc, js, name, prefix)


async def _new_stream(url: str) -> tuple[str, str]:
    handle = await make_stream(url)
    await handle.nc.close()
    return handle.name, handle.prefix


def new_stream(url: str) -> tuple[str, str]:
    """A stream of its own capturing '<prefix>.>', from code outside an event loop: (name, prefix)."""
    return asyncio.run(_new_stream(url))


async def stream_subjects(url: str, name: str) -> list[str]:
    """The subjects stream ``name`` captures, sorted."""
    nc = await nats.connect(url)
    try:
        return sorted((await nc.jetstream().stream_info(name)).config.subjects or [])
    finally:
        await nc.close()


async def add_stream(url: str, name: str, subjects: list[str]) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(StreamConfig(name=name, subjects=subjects))
    finally:
        await nc.close()


def capture_under(url: str, *prefixes: str) -> str:
    """A stream capturing one subject under each prefix ('<prefix>.elsewhere'), none an event
    uses: the worker's start check finds the allowed prefixes captured, the events' own subjects
    not. Returns its name (delete_stream it)."""
    name = f"U{uuid.uuid4().hex[:10]}"
    asyncio.run(add_stream(url, name, [f"{p}.elsewhere" for p in prefixes]))
    return name


async def delete_stream(url: str, name: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


@dataclass
class StoredMsg:
    seq: int
    subject: str
    msg_id: str
    outbox_id: int
    aggregate: str
    data: bytes


async def read_stream(handle: StreamHandle) -> list[StoredMsg]:
    """Every message in the stream, in stream order: through an ephemeral pull consumer, a
    thousand a fetch (one get_msg request per message took seconds for the larger tests)."""
    info = await handle.js.stream_info(handle.name)
    want = info.state.messages
    out: list[StoredMsg] = []
    if want == 0:
        return out
    sub = await handle.js.pull_subscribe(f"{handle.prefix}.>", stream=handle.name,
                                         config=ConsumerConfig(ack_policy=AckPolicy.NONE,
                                                               deliver_policy=DeliverPolicy.ALL))
    try:
        while len(out) < want:
            for m in await sub.fetch(batch=min(1000, want - len(out)), timeout=10):
                h = m.headers or {}
                out.append(StoredMsg(seq=m.metadata.sequence.stream, subject=m.subject, msg_id=h["Nats-Msg-Id"],
                                     outbox_id=int(h["Outbox-Id"]),
                                     aggregate=f'{h["Outbox-Aggregate-Type"]}/{h["Outbox-Aggregate-Id"]}',
                                     data=m.data))
    finally:
        consumer = (await sub.consumer_info()).name
        await sub.unsubscribe()
        await handle.js.delete_consumer(handle.name, consumer)
    return out


class NatsProxy:
    """A TCP proxy to a nats-server. ``cut()`` drops every connection through it at once,
    losing whatever it read and had not yet forwarded (as a network failure would); with
    ``version``, it rewrites the version in the server's INFO, so that the client believes it
    talks to that server."""

    def __init__(self, target_port: int, version: str | None = None) -> None:
        self.target_port, self.version = target_port, version
        self.writers: list[asyncio.StreamWriter] = []
        self.clients: list[asyncio.StreamWriter] = []   # the client side of each connection
        self.server: asyncio.Server | None = None
        self.cuts = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.writers += [writer, up_writer]
        self.clients.append(writer)
        if self.version is not None:
            info = await up_reader.readline()
            real = info.split(b'"version":"', 1)[1].split(b'"', 1)[0]
            writer.write(info.replace(b'"version":"' + real, b'"version":"' + self.version.encode()))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self.cuts += 1
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()
        self.clients.clear()

    def inject(self, line: bytes) -> None:
        """Send ``line`` to every client as if the server had (e.g. b"-ERR 'Unknown Protocol
        Operation'\r\n", on which nats-py closes its client for good). Only between messages:
        call it while nothing is in flight."""
        for w in self.clients:
            if not w.is_closing():
                w.write(line)

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
