"""PostgreSQL failover: a real primary with a real streaming standby (pg_basebackup -R), the
primary stopped immediately and the standby promoted (pg_ctl promote), as an operator would.

- the worker, given a multi-host DSN with target_session_attrs=read-write, delivers again within
  2 s of the promotion after a long outage, without a restart (capped reconnects, pool checked);
- --standby-flushed publishes nothing a standby has not flushed;
- an id the new primary hands out again is a different Nats-Msg-Id: consumers' dedup holds.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import Running, insert
from jetstream import make_stream, read_stream
from psycopg import sql

from outboxpg import schema
from outboxpg.cli.errors import EXIT_CONNECT
from outboxpg.embedded import EmbeddedPostgres, EmbeddedStandby, free_port
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.worker import Worker, WorkerConfig

WORKER = str(Path(sys.executable).parent / "outboxpg-worker")

Pair = tuple[EmbeddedPostgres, EmbeddedStandby]


@pytest.fixture
def replicated() -> Iterator[Pair]:
    """A migrated primary and its streaming standby (application_name 'standby1'), both stopped
    and removed afterwards."""
    with EmbeddedPostgres() as primary:
        with psycopg.connect(primary.dsn, autocommit=True) as c:
            c.execute("CREATE DATABASE app")
        schema.migrate(primary.dsn_for("app"))
        with EmbeddedStandby(primary, name="standby1") as standby:
            yield primary, standby


def multi_host(pair: Pair) -> str:
    """The DSN a user gives for failover: both hosts, the one that accepts writes wins."""
    primary, standby = pair
    return (f"host=127.0.0.1,127.0.0.1 port={primary.port},{standby.port} user=postgres dbname=app "
            "target_session_attrs=read-write")


def caught_up(primary: EmbeddedPostgres) -> None:
    """Wait until the standby has replayed everything the primary wrote so far."""
    with psycopg.connect(primary.dsn_for("app"), autocommit=True) as c:
        target = c.execute("SELECT pg_current_wal_lsn()").fetchone()[0]   # type: ignore[index]
        deadline = time.monotonic() + 20
        while not c.execute("SELECT coalesce(bool_and(replay_lsn >= %s), false) FROM pg_stat_replication",
                            (target,)).fetchone()[0]:   # type: ignore[index]
            assert time.monotonic() < deadline, "the standby did not catch up within 20 s"
            time.sleep(0.01)


async def until(pred: Callable[[], bool | Awaitable[bool]], timeout: float, what: str) -> float:
    """Wait until pred() holds; how long that took."""
    t0 = time.monotonic()
    while True:
        got = pred()
        if not isinstance(got, bool):
            got = await got
        if got:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def prepare(dsn: str, prefix: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("UPDATE outbox_settings SET subject_prefix = %s, backoff_base = '50 milliseconds', "
                  "backoff_cap = '200 milliseconds'", (prefix,))


async def test_the_worker_delivers_within_2_s_of_a_promotion_after_a_long_outage(replicated: Pair, nats_server: Any,
                                                                                 tmp_path: Path) -> None:
    """outboxpg-worker with a postgresql:// URI naming both hosts: the primary is stopped
    (immediate) for 8 s, the standby promoted; an event committed on the new primary is
    delivered within 2 s, by the same process (its LISTEN connection and its pool moved over)."""
    primary, standby = replicated
    stream = await make_stream(nats_server.url)
    prepare(primary.dsn_for("app"), stream.prefix)
    uri = (f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/app"
           "?target_session_attrs=read-write")
    log = tmp_path / "worker.log"
    worker = subprocess.Popen([WORKER, "--dsn", uri, "--nats-url", nats_server.url, "--lease", "4",
                               "--publish-timeout", "1", "--maintenance-interval", "0", "--poll-interval", "60"],
                              stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:
        with psycopg.connect(primary.dsn_for("app"), autocommit=True) as c:
            before = insert(c, "order", "1")

        await until(lambda: delivered_count(stream, 1), 15, "the first event")
        caught_up(primary)
        primary.halt("immediate")
        await asyncio.sleep(8)   # the outage: the worker keeps failing to reach a primary
        assert worker.poll() is None, log.read_text()
        standby.promote()
        promoted = time.monotonic()
        with psycopg.connect(standby.dsn_for("app"), autocommit=True) as c:
            after = insert(c, "order", "1")
        await until(lambda: delivered_count(stream, 2), 10, "the event committed on the new primary")
        took = time.monotonic() - promoted
        ids = [m.outbox_id for m in await read_stream(stream)]
    finally:
        worker.terminate()
        worker.wait(30)
        await stream.nc.close()
    assert took < 2.0, f"delivered {took:.1f}s after the promotion:\n{log.read_text()[-3000:]}"
    assert worker.returncode == 0, log.read_text()[-3000:]
    assert ids == [before, after]
    # One line per record, though libpq's errors for a multi-host DSN run over several.
    assert all(line.startswith("20") for line in log.read_text().splitlines()), log.read_text()[-3000:]


async def test_standby_flushed_publishes_nothing_the_standby_has_not_flushed(replicated: Pair, nats_server: Any,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """--standby-flushed standby1: with the standby stopped, an event is claimed but not
    published (the log says why, the batch is handed back after the publish timeout); started
    again, the standby catches up and the event is published. Then an asynchronous failover
    with the standby behind: every published event is on the new primary."""
    caplog.set_level(logging.INFO, logger="outboxpg.worker")
    primary, standby = replicated
    stream = await make_stream(nats_server.url)
    prepare(primary.dsn_for("app"), stream.prefix)
    publisher = NatsPublisher(nats_server.url, ack_timeout=1)
    running = Running(Worker(WorkerConfig(dsn=multi_host(replicated), standby_flushed="standby1", lease=3,
                                          publish_timeout=1, poll_interval=60, maintenance_interval=0), publisher))
    try:
        with psycopg.connect(primary.dsn_for("app"), autocommit=True) as c:
            first = insert(c, "order", "1")
            await until(lambda: stream_ids(stream, [first]), 10, "the first event, the standby streaming")
            await asyncio.to_thread(standby.halt, "fast")
            held = insert(c, "order", "2")
            await until(lambda: "event=standby_flush_timeout" in caplog.text, 10, "the batch handed back")
            assert "event=standby_flush_waiting standby=standby1 connected=0" in caplog.text
            assert [m.outbox_id for m in await read_stream(stream)] == [first], "published before the standby had it"
            await asyncio.to_thread(standby.launch)
            await until(lambda: stream_ids(stream, [first, held]), 15, "the event once the standby flushed it")
            # Handed back (outbox_release), never failed: however many claims waited for the
            # standby, only the one that published counts an attempt. (Read now, not while it
            # waited: a claim holding it again meanwhile counts one until it is handed back.)
            await until(lambda: _state_is(primary.dsn_for("app"), held, "published"), 10, "the event reported")
            assert c.execute("SELECT attempts FROM outbox WHERE id = %s", (held,)).fetchone()[0] == 1  # type: ignore[index]
            assert "event=standby_flush_resumed standby=standby1" in caplog.text
            # Now an asynchronous failover: the standby misses the last events, which are lost
            # with the primary; none of them was published.
            await asyncio.to_thread(standby.halt, "fast")
            handed_back = caplog.text.count("event=standby_flush_timeout")
            lost = [insert(c, "order", str(n)) for n in range(3, 8)]
            await until(lambda: caplog.text.count("event=standby_flush_timeout") > handed_back, 10,
                        "the last events handed back")
            lost_msg_ids = {r[0] for r in c.execute("SELECT msg_id FROM outbox WHERE id = ANY(%s)", (lost,))}
        await asyncio.to_thread(primary.halt, "immediate")
        await asyncio.to_thread(standby.launch)
        await asyncio.to_thread(standby.promote)
        with psycopg.connect(standby.dsn_for("app"), autocommit=True) as c:
            survived = {r[0] for r in c.execute("SELECT msg_id FROM outbox")}
        published = {m.msg_id for m in await read_stream(stream)}
    finally:
        await running.stop()
        await stream.nc.close()
    assert not lost_msg_ids & survived, "the standby had the last events: no failover loss to test"
    assert len(published) == 2 and published <= survived, "a published event was lost in the failover"


async def stream_ids(stream: Any, want: list[int]) -> bool:
    return await delivered_count(stream, 1) and [m.outbox_id for m in await read_stream(stream)] == want


async def test_an_id_reissued_after_a_failover_is_another_nats_msg_id(replicated: Pair, nats_server: Any) -> None:
    """Asynchronous replication: events committed and published while the standby was away are
    lost with the primary; the new primary's sequence is behind and hands out some of their ids
    again. Each reissued Outbox-Id carries a new Nats-Msg-Id (the row's msg_id, a random UUID
    fixed at insert): JetStream stores both events, and a consumer deduplicating on
    Nats-Msg-Id sees two events, as there are."""
    primary, standby = replicated
    stream = await make_stream(nats_server.url)
    prepare(primary.dsn_for("app"), stream.prefix)
    publisher = NatsPublisher(nats_server.url, ack_timeout=2)
    running = Running(Worker(WorkerConfig(dsn=multi_host(replicated), lease=4, publish_timeout=1, poll_interval=1,
                                          maintenance_interval=0), publisher))
    try:
        with psycopg.connect(primary.dsn_for("app"), autocommit=True) as c:
            insert(c, "order", "0")
            await until(lambda: delivered_count(stream, 1), 10, "the first event")
            await asyncio.to_thread(caught_up, primary)
            await asyncio.to_thread(standby.halt, "fast")
            for i in range(100):   # the sequence logs ahead by 32: 100 ids move it past what the standby saw
                insert(c, "order", str(i % 10))
        await until(lambda: delivered_count(stream, 101), 15, "the events the standby never got")
        await asyncio.to_thread(primary.halt, "immediate")
        await asyncio.to_thread(standby.launch)
        await asyncio.to_thread(standby.promote)
        with psycopg.connect(standby.dsn_for("app"), autocommit=True) as c:
            for i in range(100):
                insert(c, "order", str(i % 10))
        await until(lambda: delivered_count(stream, 201), 15, "the events of the new primary")
    finally:
        await running.stop()
    messages = await read_stream(stream)
    await stream.nc.close()
    by_id: dict[int, list[str]] = {}
    for m in messages:
        by_id.setdefault(m.outbox_id, []).append(m.msg_id)
    reissued = {i: ids for i, ids in by_id.items() if len(ids) > 1}
    assert reissued, "the new primary reissued no id: the scenario did not happen"
    assert all(len(set(ids)) == len(ids) for ids in reissued.values()), reissued
    assert len({m.msg_id for m in messages}) == len(messages) == 201


async def delivered_count(stream: Any, n: int) -> bool:
    """Whether the stream holds at least ``n`` messages."""
    info = await stream.js.stream_info(stream.name)
    return bool(info.state.messages >= n)


def test_a_multi_host_dsn_that_reaches_no_host_says_why_for_each_in_one_line() -> None:
    """psycopg's first line names only the last host tried: the worker's line names them all."""
    dead = [free_port(), free_port()]
    out = subprocess.run([WORKER, "--dsn", f"postgresql://127.0.0.1:{dead[0]},127.0.0.1:{dead[1]}/app"
                                           "?target_session_attrs=read-write"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_CONNECT
    assert out.stderr == (f'outboxpg-worker: cannot connect to PostgreSQL: connection failed: connection to server at '
                          f'"127.0.0.1", port {dead[0]} failed: Connection refused; connection to server at '
                          f'"127.0.0.1", port {dead[1]} failed: Connection refused\n')


def test_standby_flushed_refuses_to_start_for_a_role_that_cannot_read_flush_lsn(
        dsn: str, conn: psycopg.Connection[Any]) -> None:
    """flush_lsn is NULL to a role without pg_read_all_stats: the worker would wait forever."""
    role = f"relay_{uuid.uuid4().hex[:8]}"
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE outbox_worker").format(sql.Identifier(role)))
    try:
        out = subprocess.run([WORKER, "--dsn", f"{dsn} user={role}", "--standby-flushed", "any",
                              "--nats-url", "nats://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stderr) == (1, f"outboxpg-worker: --standby-flushed: role {role!r} may not read "
                                                   f"pg_stat_replication.flush_lsn: GRANT pg_read_all_stats TO "
                                                   f'"{role}"\n')
        conn.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(role)))
        started = subprocess.Popen([WORKER, "--dsn", f"{dsn} user={role}", "--standby-flushed", "any", "--publisher",
                                    "builtins:print", "--maintenance-interval", "0"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            assert started.stderr is not None
            first = started.stderr.readline()
            assert "event=start " in first and " standby_flushed=any " in first, first
        finally:
            started.terminate()
            started.wait(30)
    finally:
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


async def _state_is(dsn: str, event_id: int, state: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT state::text FROM outbox WHERE id = %s", (event_id,)).fetchone()
    return row is not None and row[0] == state
