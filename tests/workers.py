"""The worker running in this test's event loop (``start``, a ``helpers.Running``), waiting on
what it does (``wait_until``, ``count_in``), and events made by hand for a publisher."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
from helpers import Running
from locks import WAKEUP_LOCK

from outboxpg.events import OutboxEvent
from outboxpg.relay.worker import Worker, WorkerConfig


async def wait_until(pred: Callable[[], Awaitable[bool]], timeout: float, what: str, interval: float = 0.05) -> float:
    """Poll ``pred`` until true; returns the seconds it took. Fails the test after ``timeout``."""
    start = time.monotonic()
    while not await pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
    return time.monotonic() - start


async def scalar(dsn: str, query: str, params: tuple[Any, ...] = ()) -> Any:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        row = await (await c.execute(query, params)).fetchone()
        return row[0] if row else None


def fleet_idle(conn: psycopg.Connection[Any], workers: list[Running]) -> Callable[[], Awaitable[bool]]:
    """For wait_until: is the fleet idle, one worker holding the wakeup lock and the others
    queued for it, every one listening?"""
    async def check() -> bool:
        held = [await w.idle() for w in workers]
        return (sum(held) == 1 and await queued_for_wakeup_lock(conn, len(workers) - 1)()
                and all(w.worker.listener.up for w in workers))
    return check


def queued_for_wakeup_lock(conn: psycopg.Connection[Any], sessions: int = 1) -> Callable[[], Awaitable[bool]]:
    """For wait_until: do ``sessions`` sessions queue for the wakeup lock (granted to another)?"""
    async def check() -> bool:
        row = conn.execute("SELECT count(*) FILTER (WHERE NOT granted) FROM pg_locks "
                           "WHERE locktype = 'advisory' AND classid = %s AND objid = %s AND objsubid = 2",
                           WAKEUP_LOCK).fetchone()
        return row == (sessions,)
    return check


def count_in(dsn: str, state: str) -> Callable[[], Awaitable[int]]:
    async def f() -> int:
        return int(await scalar(dsn, "SELECT count(*) FROM outbox WHERE state = %s", (state,)))
    return f


def start(dsn: str, publisher: Any, **config: Any) -> Running:
    config.setdefault("publish_timeout", 2.0)
    config.setdefault("lease", 10.0)
    return Running(Worker(WorkerConfig(dsn=dsn, **config), publisher))


async def equals(f: Callable[[], Awaitable[int]], n: int) -> bool:
    return await f() == n


def all_in(dsn: str, state: str, n: int) -> Callable[[], Awaitable[bool]]:
    """For wait_until: are ``n`` events in ``state``?"""
    count = count_in(dsn, state)

    async def check() -> bool:
        return await equals(count, n)
    return check


def event(i: int, subject: str, **kw: Any) -> OutboxEvent:
    fields: dict[str, Any] = dict(id=i, subject=subject, aggregate_type="order", aggregate_id=str(i),
                                  event_type="created", payload=b'{"i": %d}' % i, headers={},
                                  msg_id=f"m-{uuid.uuid4()}", attempt=0, created_at=datetime.now(UTC))
    fields.update(kw)
    return OutboxEvent(**fields)
