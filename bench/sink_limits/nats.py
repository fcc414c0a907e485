"""NATS JetStream (nats://, tls://) for bench/sink_drain.py.

``run``: the nats-py client alone, no database: ``count`` messages of ``payload`` with the headers
the worker sends (Nats-Msg-Id and the Outbox-* ids), each counted once its PubAck came (the
stream stored it: the worker's acknowledgement level), through the client's own pipelined API
(``js.publish_async``, up to PENDING unacknowledged at once), into a stream of its own (deleted
after). ``prepare``/``stored``/``cleanup``: the stream
the worker publishes into (as ``--ensure-stream`` makes it) and how many messages it holds;
``stored_at``: when the stream stored each event (its messages' own timestamps, by Nats-Msg-Id).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta

import nats
from nats.aio.client import Client

from outboxpg.relay.nats.connection import supports_atomic_batch
from outboxpg.relay.nats.streams import ensure_stream

PENDING = 4000   # nats-py's default publish_async_max_pending
WORKER_ARGS: list[str] = []

_clients: dict[str, Client] = {}


async def _client(url: str) -> Client:
    nc = _clients.get(url)
    if nc is None or nc.is_closed:
        nc = _clients[url] = await nats.connect(url)
    return nc


def _stream(prefix: str) -> str:
    return prefix.upper()


async def prepare(url: str, prefix: str) -> None:
    """A stream capturing ``<prefix>.>``, as the worker's --ensure-stream makes it (allow_atomic on 2.12+)."""
    nc = await _client(url)
    await ensure_stream(nc.jetstream(), _stream(prefix), [f"{prefix}.>"], timedelta(seconds=600),
                        atomic=supports_atomic_batch(nc))


async def stored(url: str, prefix: str) -> int:
    nc = await _client(url)
    return int((await nc.jetstream().stream_info(_stream(prefix))).state.messages)


async def stored_at(url: str, prefix: str) -> dict[str, float]:
    nc = await _client(url)
    js = nc.jetstream()
    held = (await js.stream_info(_stream(prefix))).state.messages
    times: dict[str, float] = {}
    sub = await js.subscribe(f"{prefix}.>", ordered_consumer=True)
    try:
        for _ in range(held):
            m = await sub.next_msg(timeout=10)
            if m.headers and "Nats-Msg-Id" in m.headers:
                times[m.headers["Nats-Msg-Id"]] = m.metadata.timestamp.timestamp()
    finally:
        await sub.unsubscribe()
    return times


async def cleanup(url: str, prefix: str) -> None:
    nc = await _client(url)
    try:
        await nc.jetstream().delete_stream(_stream(prefix))
    finally:
        await nc.close()
        _clients.pop(url, None)


async def run(url: str, count: int, payload: bytes) -> float:
    prefix = f"lim{uuid.uuid4().hex[:8]}"
    await prepare(url, prefix)
    nc = await _client(url)
    js = nc.jetstream(publish_async_max_pending=PENDING)
    subject = f"{prefix}.order.updated"
    try:
        t0 = time.monotonic()
        futures = [await js.publish_async(subject, payload, headers={
            "Nats-Msg-Id": f"lim-{i}-{uuid.uuid4()}", "Outbox-Id": str(i), "Outbox-Event-Type": "updated",
            "Outbox-Aggregate-Type": "order", "Outbox-Aggregate-Id": str(i % 200), "Outbox-Attempt": "1"})
            for i in range(1, count + 1)]
        acks = await asyncio.gather(*futures)
        elapsed = time.monotonic() - t0
        assert len(acks) == count and await stored(url, prefix) == count
    finally:
        await cleanup(url, prefix)
    return count / elapsed
