"""Runs of an aggregate's events through the worker to a real JetStream stream: write them, start a
worker that waits for them (``start``: no fallback poll to speak of), and read the stream back to
check each aggregate's ids are in order and once (``assert_in_order_once``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import nats
import psycopg
from helpers import Running
from jetstream import StreamHandle, read_stream
from workers import start as start_worker
from workers import wait_until

from outboxpg import enqueue


def states(conn: psycopg.Connection[Any]) -> dict[int, str]:
    return dict(conn.execute("SELECT id, state::text FROM outbox").fetchall())


async def until_published(conn: psycopg.Connection[Any], n: int, timeout: float) -> None:
    async def done() -> bool:
        return conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0] >= n
    await wait_until(done, timeout, f"{n} events published")


def start(dsn: str, publisher: Any, **config: Any) -> Running:
    """``workers.start`` with a 5 s fallback poll: what a run test sees comes from the claims that
    notifications and reports trigger, not from the poll."""
    config.setdefault("poll_interval", 5.0)
    return start_worker(dsn, publisher, **config)


def write(conn: psycopg.Connection[Any], aggregates: list[str], per_aggregate: int,
          payload: Callable[[str, int], dict[str, Any]] = lambda a, n: {"n": n}) -> dict[str, list[int]]:
    """``per_aggregate`` events for each aggregate ("order" type), interleaved round-robin in one
    transaction; returns each aggregate's ids in order."""
    ids: dict[str, list[int]] = defaultdict(list)
    with conn.transaction():
        for n in range(per_aggregate):
            for agg in aggregates:
                ids[agg].append(enqueue(conn, "order", agg, "step", payload(agg, n)))
    return dict(ids)


async def stream_ids(url: str, stream: StreamHandle) -> dict[str, list[int]]:
    """Outbox ids per aggregate, in stream order."""
    nc = await nats.connect(url)
    try:
        msgs = await read_stream(StreamHandle(nc, nc.jetstream(), stream.name, stream.prefix))
    finally:
        await nc.close()
    per: dict[str, list[int]] = defaultdict(list)
    for m in msgs:
        per[m.aggregate.split("/", 1)[1]].append(m.outbox_id)
    return dict(per)


def assert_in_order_once(got: dict[str, list[int]], expected: dict[str, list[int]]) -> None:
    """Per aggregate: strictly increasing ids (so no duplicates) and exactly the expected ones."""
    for agg, ids in got.items():
        assert all(a < b for a, b in zip(ids, ids[1:])), f"aggregate {agg}: stream order {ids}"
    assert got == {agg: ids for agg, ids in expected.items() if ids}
