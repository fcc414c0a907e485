"""One relay over several databases (outboxpg.relay.fleet): a Worker per database sharing one
NatsPublisher on a real nats-server, each database a real PostgreSQL database of its own.

- a database whose statements hang behind a held lock delays only itself: the others' events
  reach JetStream while its worker waits on the lock, and it delivers again once the lock goes;
- a database that refuses connections (ALLOW_CONNECTIONS false, its sessions terminated) delays
  only itself, and delivery from it resumes once it takes connections again;
- removing a database from a running fleet finishes it, the others run on, and the shared
  publisher stays open until the fleet closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
from jetstream import StreamHandle, make_stream
from psycopg import sql
from workers import count_in, equals, wait_until

from outboxpg.embedded import EmbeddedNats
from outboxpg.relay.fleet import Fleet
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.worker import WorkerConfig


@pytest.fixture
async def stream(nats_server: EmbeddedNats) -> AsyncIterator[StreamHandle]:
    handle = await make_stream(nats_server.url)
    yield handle
    await handle.js.delete_stream(handle.name)
    await handle.nc.close()


def prepare(dsn: str, prefix: str, events: int, tag: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("UPDATE outbox_settings SET subject_prefix = %s", (prefix,))
        write(c, events, tag)


def write(c: psycopg.Connection[Any], events: int, tag: str) -> None:
    c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
              "SELECT 'order', %s || '-' || n, 'created', '{}' FROM generate_series(1, %s) n", (tag, events))


def config(dsn: str) -> WorkerConfig:
    return WorkerConfig(dsn=dsn, name="fleet-test", publish_timeout=2.0, lease=10.0, maintenance_interval=0,
                        xmin_check_interval=0, poll_interval=0.5)


async def stored(stream: StreamHandle) -> int:
    return int((await stream.js.stream_info(stream.name)).state.messages)


async def test_a_locked_database_holds_back_only_itself(more_databases: Callable[[int], list[str]],
                                                        stream: StreamHandle, nats_server: EmbeddedNats) -> None:
    locked, *others = more_databases(3)
    for n, dsn in enumerate([locked, *others]):
        prepare(dsn, stream.prefix, 0, f"d{n}")
    fleet = Fleet(NatsPublisher(nats_server.url, ack_timeout=2.0), max_in_flight=2)
    await fleet.open()
    for n, dsn in enumerate([locked, *others]):
        fleet.start(f"db{n}", config(dsn))
    holder = await psycopg.AsyncConnection.connect(locked)
    try:
        await wait_until(lambda: _all_idle(fleet), 15, "every database's worker idle")
        # What a claim reads, in the order a claim takes them (the intake row, then the events):
        # the other order deadlocks with a claim that holds the intake row and waits for outbox.
        await holder.execute("LOCK TABLE outbox_intake, outbox IN ACCESS EXCLUSIVE MODE")
        # Within a poll interval (0.5 s) the locked database's worker sends a statement that waits.
        await wait_until(lambda: _waits_on_lock(locked), 10, "the locked database's worker stuck on the lock")
        for n, dsn in enumerate(others):
            with psycopg.connect(dsn, autocommit=True) as c:
                write(c, 200, f"other{n}")
        for dsn in others:
            await wait_until(lambda d=dsn: equals(count_in(d, "published"), 200), 15,  # type: ignore[misc]
                             "the other databases' events published while one is locked")
        assert await stored(stream) == 400
        assert await _waits_on_lock(locked)
    finally:
        await holder.rollback()
        await holder.close()
    with psycopg.connect(locked, autocommit=True) as c:
        write(c, 50, "locked")
    await wait_until(lambda: equals(count_in(locked, "published"), 50), 15, "the locked database's events")
    assert await stored(stream) == 450
    await fleet.close()
    assert fleet.publisher.closed


async def test_a_database_refusing_connections_holds_back_only_itself(
        more_databases: Callable[[int], list[str]], stream: StreamHandle, nats_server: EmbeddedNats) -> None:
    down, up = more_databases(2)
    prepare(down, stream.prefix, 0, "down")
    prepare(up, stream.prefix, 0, "up")
    fleet = Fleet(NatsPublisher(nats_server.url, ack_timeout=2.0), max_in_flight=2)
    await fleet.open()
    fleet.start("down", config(down))
    fleet.start("up", config(up))
    name = psycopg.conninfo.conninfo_to_dict(down)["dbname"]
    admin = psycopg.connect(up, autocommit=True)
    try:
        await wait_until(lambda: _all_idle(fleet), 15, "both workers idle")
        with psycopg.connect(down, autocommit=True) as c:
            write(c, 20, "before")   # written, then the database goes away before any claim
            admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(sql.Identifier(name)))
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                          "AND pid <> pg_backend_pid()", (name,))
        for round_ in range(3):
            with psycopg.connect(up, autocommit=True) as c:
                write(c, 100, f"up{round_}")
            await wait_until(lambda r=round_: equals(count_in(up, "published"), 100 * (r + 1)),  # type: ignore[misc]
                             10, "the reachable database's events while the other refuses connections")
            await asyncio.sleep(0.5)
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(sql.Identifier(name)))
        await wait_until(lambda: equals(count_in(down, "published"), 20), 15, "the database back, its events")
        assert await stored(stream) == 320
    finally:
        admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(sql.Identifier(name)))
        admin.close()
        await fleet.close()


async def test_a_removed_database_stops_and_the_others_run_on(more_databases: Callable[[int], list[str]],
                                                              stream: StreamHandle, nats_server: EmbeddedNats) -> None:
    first, second = more_databases(2)
    prepare(first, stream.prefix, 30, "first")
    prepare(second, stream.prefix, 30, "second")
    fleet = Fleet(NatsPublisher(nats_server.url, ack_timeout=2.0), max_in_flight=4)
    await fleet.open()
    fleet.start("first", config(first))
    fleet.start("second", config(second))
    await wait_until(lambda: equals(count_in(first, "published"), 30), 15, "first's events")
    await wait_until(lambda: equals(count_in(second, "published"), 30), 15, "second's events")
    await fleet.remove("first")
    assert list(fleet.workers) == ["second"]
    with psycopg.connect(first, autocommit=True) as c:
        write(c, 5, "after")
        # Its LISTEN, wakeup lock and pool are gone with it.
        assert c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                         "AND application_name LIKE 'outboxpg-worker%'").fetchone() == (0,)
    with psycopg.connect(second, autocommit=True) as c:
        write(c, 5, "after")
    await wait_until(lambda: equals(count_in(second, "published"), 35), 10, "second still delivered")
    await asyncio.sleep(0.5)
    assert await count_in(first, "pending")() == 5
    assert not fleet.publisher.closed
    await fleet.close()


async def _waits_on_lock(dsn: str) -> bool:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        row = await (await c.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                     "AND application_name = 'outboxpg-worker fleet-test' "
                                     "AND wait_event_type = 'Lock'")).fetchone()
        return row is not None and row[0] > 0


async def _all_idle(fleet: Fleet) -> bool:
    return all(w.idle_lock.held and w.listener.up for w in fleet.workers.values())
