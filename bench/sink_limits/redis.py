"""Redis Streams (redis://, rediss://) for bench/sink_drain.py.

``run``: redis-py's asyncio client alone, no database, at the sink's acknowledgement level and in
its shape: every message goes through the sink's own de-duplication script (EVALSHA of
outboxpg.sinks.redis.ADD_SCRIPT: GET the dedupe key, XADD, SET the key with its expiry; the sink
always uses it), with the fields the worker writes (msg_id, subject, the Outbox-* ids, the
payload), answered before it counts; batches of 500 one-event runs, each batch 500 script calls
written at once on one connection and their answers read (what the sink sends for a claimed
batch of 500 aggregates' single events, packed as the sink packs them: redis-py's own pipeline
costs more client CPU per command than the sink does), 4 batches in flight at once (the worker's
default --concurrency), each on a connection of its own. events/s.

``stored``/``cleanup``: the streams of the worker's subjects (a stream per subject, the sink's
default: ``<prefix>.*``), their entries counted; ``stored_at``: when Redis stored each event
(the millisecond of its entry id, which XADD takes from the server's clock); cleanup deletes
them and the dedupe keys of the events they hold (``outboxpg:dedupe:<msg_id>``).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio

from outboxpg.sinks.redis import ADD_SCRIPT, DEFAULT_DEDUPE_PREFIX, _pack

BATCH = 500
CONCURRENCY = 4
WINDOW = b"600"
WORKER_ARGS: list[str] = []


def _client(url: str) -> redis.asyncio.Redis:
    return redis.asyncio.from_url(url.split("?", 1)[0], protocol=2, socket_timeout=60)


async def _streams(client: redis.asyncio.Redis, prefix: str) -> list[bytes]:
    return [key async for key in client.scan_iter(match=f"{prefix}.*", _type="stream", count=1000)]


async def prepare(url: str, prefix: str) -> None:
    """Nothing to make: XADD creates a stream with its first entry."""


async def stored(url: str, prefix: str) -> int:
    client = _client(url)
    try:
        return sum([int(await client.xlen(key)) for key in await _streams(client, prefix)])
    finally:
        await client.aclose()


async def stored_at(url: str, prefix: str) -> dict[str, float]:
    client = _client(url)
    times: dict[str, float] = {}
    try:
        for key in await _streams(client, prefix):
            last = b"-"
            while entries := await client.xrange(key, min=last, count=1000):
                for entry_id, fields in entries:
                    times[fields[b"msg_id"].decode()] = int(entry_id.split(b"-", 1)[0]) / 1000
                last = b"(" + entries[-1][0]
    finally:
        await client.aclose()
    return times


async def cleanup(url: str, prefix: str, dedupe_prefix: str = DEFAULT_DEDUPE_PREFIX) -> None:
    client = _client(url)
    try:
        for key in await _streams(client, prefix):
            last = b"-"
            while entries := await client.xrange(key, min=last, count=1000):
                msg_ids = [fields[b"msg_id"] for _id, fields in entries]
                await client.delete(*(dedupe_prefix.encode() + m for m in msg_ids))
                last = b"(" + entries[-1][0]
            await client.delete(key)
    finally:
        await client.aclose()


async def run(url: str, count: int, payload: bytes) -> float:
    prefix = f"lim{uuid.uuid4().hex[:8]}"
    dedupe_prefix = f"{prefix}:dedupe:"
    subject = f"{prefix}.order.updated".encode()
    client = _client(url)
    sha = (await client.script_load(ADD_SCRIPT)).encode()
    next_batch = iter(range(0, count, BATCH))

    async def lane() -> None:
        pool = client.connection_pool
        conn = await pool.get_connection()
        try:
            for first in next_batch:
                commands = []
                for i in range(first, min(first + BATCH, count)):
                    msg_id = f"lim-{i}-{uuid.uuid4()}".encode()
                    commands.append(_pack([
                        b"EVALSHA", sha, b"2", subject, dedupe_prefix.encode() + msg_id, WINDOW, b"",
                        b"16", b"msg_id", msg_id, b"subject", subject, b"Outbox-Id", str(i).encode(),
                        b"Outbox-Event-Type", b"updated", b"Outbox-Aggregate-Type", b"order",
                        b"Outbox-Aggregate-Id", str(i).encode(), b"Outbox-Attempt", b"1", b"payload", payload]))
                await conn.send_packed_command(b"".join(commands))
                for _ in commands:
                    reply = await conn.read_response()
                    assert not reply[0].startswith((b"!", b"=")), reply
        finally:
            await pool.release(conn)

    try:
        t0 = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))
        elapsed = time.monotonic() - t0
        assert await stored(url, prefix) == count
    finally:
        await cleanup(url, prefix, dedupe_prefix)
        await client.aclose()
    return count / elapsed
