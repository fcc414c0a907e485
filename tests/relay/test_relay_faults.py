"""Issue 13, "Nothing stops the relay": what used to leave the worker stopped, duplicating or
waiting, against a real PostgreSQL and a real nats-server.

  a requeue or a discard                wakes an idle worker (it waited for the fallback poll)
  a publisher slower than the lease     keeps its leases (outbox_extend): no duplicate publish
  a NATS client nats-py closed for good is replaced; delivery resumes
  an event too large for NATS           dies at its first attempt with the reason, as NATS counts it
  --nats-url                            takes a comma-separated list; a malformed one exits 2
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import WORKER
from helpers import Running, discard, insert, requeue
from jetstream import NatsProxy, make_stream, read_stream

from outboxpg import Event, enqueue_many
from outboxpg.embedded import free_port
from outboxpg.events import OutboxEvent
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.publishers import FunctionPublisher, NotSent, PermanentError
from outboxpg.relay.worker import Worker, WorkerConfig

Conn = psycopg.Connection[Any]


async def until(pred: Callable[[], bool] | Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Wait until pred() holds; returns how long that took."""
    t0 = time.monotonic()
    while True:
        got = pred()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def state(conn: Conn, i: int) -> str:
    return conn.execute("SELECT state::text FROM outbox WHERE id = %s", (i,)).fetchone()[0]


# -- requeue and discard wake idle workers ------------------------------------------------------

@pytest.mark.parametrize("repair", ["requeue", "discard"])
async def test_a_repair_wakes_an_idle_worker(dsn: str, conn: Conn, repair: str) -> None:
    """A dead letter holds its aggregate; the worker, with nothing else to do, sleeps on LISTEN
    with a 60 s fallback poll. Requeueing the dead event (or discarding it, which frees the
    event behind it) makes events claimable: the worker must hear of it at once."""
    published: list[int] = []
    poison: set[int] = set()

    async def publish(event: OutboxEvent) -> None:
        if event.id in poison:
            poison.discard(event.id)
            raise PermanentError("refused once")
        published.append(event.id)

    dead = insert(conn, "order", "1")
    behind = insert(conn, "order", "1")
    poison.add(dead)
    running = Running(Worker(WorkerConfig(dsn=dsn, poll_interval=60, lease=10, publish_timeout=2,
                                          maintenance_interval=0), publish))
    try:
        await until(lambda: state(conn, dead) == "dead", 10, "the dead letter")
        await until(lambda: running.worker.idle_lock.held, 10, "the worker to go idle")
        await asyncio.sleep(0.3)   # asleep on LISTEN, its next wakeup a minute away
        assert published == []
        t0 = time.monotonic()
        if repair == "requeue":
            assert requeue(conn, [dead]) == 1
            await until(lambda: published == [dead, behind], 10, "the requeued event and the one behind it")
        else:
            assert discard(conn, [dead], "superseded") == 1
            await until(lambda: published == [behind], 10, "the event behind the discarded one")
        took = time.monotonic() - t0
    finally:
        await running.stop()
    assert took < 1.5, f"{repair} delivered after {took:.1f}s: the worker was not woken"


# -- a publisher slower than the lease ----------------------------------------------------------


SLOW_PUBLISHER = '''
import os, time

def publish(event):
    time.sleep(0.05)   # a slow webhook: 50 ms an event, a batch of 100 takes 5 s
    with open(os.environ["SLOW_LOG"], "a") as f:
        f.write(f"{event.msg_id} {os.getpid()}\\n")
'''


def spawn_worker(tmp_path: Path, name: str, *args: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen([WORKER, "--name", name, "--summary-interval", "3600", "--maintenance-interval", "0",
                             *args], stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={**os.environ, **env})
    return proc, log


def stop_worker(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.mark.slow
async def test_a_publisher_slower_than_the_lease_publishes_each_event_once(dsn: str, conn: Conn,
                                                                          tmp_path: Path) -> None:
    """Issue 13 (2): a sync fn(event) taking 50 ms, --lease 4 --publish-timeout 2, batches of
    100 (5 s each), two workers with a lane to spare. The leases of a batch being published are
    extended, so the other worker never takes it back: every event is published exactly once."""
    (tmp_path / "slowpub.py").write_text(SLOW_PUBLISHER)
    sent = tmp_path / "sent.log"
    env = {"PYTHONPATH": str(tmp_path), "SLOW_LOG": str(sent)}
    total = 200
    enqueue_many(conn, [Event("order", f"o{i % 20}", "updated", {"i": i}) for i in range(total)])
    args = ("--dsn", dsn, "--publisher", "slowpub:publish", "--lease", "4", "--publish-timeout", "2",
            "--batch-size", "100", "--concurrency", "2", "--poll-interval", "30")
    workers = [spawn_worker(tmp_path, name, *args, env=env) for name in ("w1", "w2")]
    try:
        def all_published() -> bool:
            for proc, log in workers:
                assert proc.poll() is None, log.read_text()
            return conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0] == total
        await until(all_published, 60, f"{total} events published")
    finally:
        codes = [stop_worker(proc) for proc, _ in workers]   # in-flight batches finish first
    logs = [log.read_text() for _, log in workers]
    assert codes == [0, 0], logs
    lines = sent.read_text().split()[::2]
    assert len(lines) == total and len(set(lines)) == total, \
        f"{len(lines) - len(set(lines))} duplicate publishes:\n" + "\n".join(logs)
    assert conn.execute("SELECT count(*) FROM outbox WHERE attempts <> 1 OR last_error IS NOT NULL").fetchone()[0] == 0
    assert all("lease_lost" not in text and "lost_leases=0" in text for text in logs), logs


async def test_a_sync_call_over_the_timeout_stops_its_batch_and_nothing_is_called_after_it() -> None:
    """A sync publisher runs in a thread; a call that hangs past the timeout fails the batch
    from there on, and no later event of the batch is published behind the worker's back
    (it used to go on calling them after the batch had been reported, leases handed back)."""
    calls: list[int] = []
    gate = threading.Event()

    def publish(event: OutboxEvent) -> None:
        calls.append(event.id)
        if event.id == 2:
            gate.wait(5)   # hangs until the test lets it go

    def ev(i: int, agg: str) -> OutboxEvent:
        return OutboxEvent(id=i, subject="t.order.x", aggregate_type="order", aggregate_id=agg, event_type="x",
                           payload=b"{}", headers={}, msg_id=f"m{i}", attempt=1, created_at=datetime.now(UTC))

    pub = FunctionPublisher(publish, timeout=0.3)
    t0 = time.monotonic()
    out = await pub.publish_batch([ev(1, "a"), ev(2, "b"), ev(3, "a"), ev(4, "c")])
    took = time.monotonic() - t0
    assert out[0] is None
    assert isinstance(out[1], TimeoutError)
    assert all(isinstance(o, NotSent) for o in out[2:]), out
    assert took < 2, took
    gate.set()
    await asyncio.sleep(0.3)
    assert calls == [1, 2], "called after the batch was given up"


# -- a NATS client closed for good --------------------------------------------------------------

@pytest.mark.parametrize("how", ["server-err", "closed-from-outside"])
async def test_a_nats_client_closed_for_good_is_replaced_and_delivery_resumes(dsn: str, conn: Conn, nats_server: Any,
                                                                              how: str) -> None:
    """nats-py closes its client for good on an -ERR from the server (e.g. the one a message over
    max_payload gets) and when it is closed from outside. The worker used to stay up with it,
    every publish failing with ConnectionClosedError until the events were dead. Now the
    publisher connects a new client and the worker claims again once it is there."""
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    proxy = NatsProxy(nats_server.port)
    url = await proxy.start()
    pub = NatsPublisher(url, ack_timeout=2)
    running = Running(Worker(WorkerConfig(dsn=dsn, poll_interval=5, lease=10, publish_timeout=2,
                                          maintenance_interval=0), pub))

    def published() -> int:
        return conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0]

    try:
        before = [insert(conn, "order", str(i % 2)) for i in range(6)]
        await until(lambda: published() == 6, 15, "the first events")
        old = pub.nc
        assert old is not None
        if how == "server-err":
            proxy.inject(b"-ERR 'Unknown Protocol Operation'\r\n")
        else:
            await old.close()
        await until(lambda: old.is_closed, 10, "nats-py to close its client")
        after = [insert(conn, "order", str(i % 2)) for i in range(6)]
        took = await until(lambda: published() == 12, 15, "the events written after the close")
        assert pub.replacements == 1 and pub.nc is not old and pub.nc.is_connected
    finally:
        await running.stop()
        await proxy.close()
    assert took < 5, took
    stored = await read_stream(stream)
    assert sorted(m.outbox_id for m in stored) == before + after     # each once
    for agg in ("order/0", "order/1"):
        ids = [m.outbox_id for m in stored if m.aggregate == agg]
        assert ids == sorted(ids)
    assert conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s) AND attempts <> 1", (after,)).fetchone()[0] == 0
    await stream.nc.close()


# -- sizes, as NATS counts them -----------------------------------------------------------------

def header_block(headers: dict[str, str]) -> int:
    """The HPUB header block: "NATS/1.0\\r\\n", "<name>: <value>\\r\\n" each (values trimmed, as
    the client sends them), "\\r\\n". nats-server counts it, with the payload, against
    max_payload, and JetStream refuses a block over 65,535 bytes."""
    return len(b"NATS/1.0\r\n\r\n") + sum(len(f"{k}: {v.strip()}\r\n".encode()) for k, v in headers.items())


def sized_event(i: int, subject: str, payload_len: int, headers: dict[str, str]) -> OutboxEvent:
    return OutboxEvent(id=i, subject=subject, aggregate_type="order", aggregate_id=f"a{i}", event_type="created",
                       payload=b"x" * payload_len, headers=headers, msg_id=f"size-{uuid.uuid4()}", attempt=1,
                       created_at=datetime.now(UTC))


def wire_headers(event: OutboxEvent) -> dict[str, str]:
    return {**event.headers, "Nats-Msg-Id": event.msg_id, "Outbox-Id": str(event.id),
            "Outbox-Event-Type": event.event_type, "Outbox-Aggregate-Type": event.aggregate_type,
            "Outbox-Aggregate-Id": event.aggregate_id, "Outbox-Attempt": str(event.attempt)}


async def test_a_message_of_exactly_max_payload_goes_one_byte_more_dies_without_touching_the_connection(
        nats_server: Any) -> None:
    """Counted as the server counts: header values are trimmed on the wire (a padded value
    costs nothing for its padding), the subject does not count. Exactly max_payload is
    stored; one byte more is a PermanentError at once and the connection is untouched."""
    stream = await make_stream(nats_server.url)
    pub = NatsPublisher(nats_server.url, ack_timeout=5)
    await pub.start()
    try:
        assert pub.nc is not None
        limit = pub.nc.max_payload
        subject = f"{stream.prefix}.order.created." + "s" * 200        # a long subject: not counted
        padded = {"Trace": "t-1" + " " * 300}
        probe = sized_event(1, subject, 0, padded)
        fits = sized_event(1, subject, limit - header_block(wire_headers(probe)), padded)
        assert header_block(wire_headers(fits)) + len(fits.payload) == limit
        over = sized_event(2, subject, len(fits.payload) + 1, padded)
        client = pub.nc
        out = await pub.publish_batch([fits, over])
        assert out[0] is None, out[0]
        assert isinstance(out[1], PermanentError) and "max_payload" in str(out[1]), out[1]
        assert pub.nc is client and client.is_connected and client.stats["reconnects"] == 0
        assert await pub.publish_batch([sized_event(3, subject, 10, {})]) == [None]
        info = await stream.js.stream_info(stream.name)
        assert info.state.messages == 2
    finally:
        await pub.close()
        await stream.nc.close()


async def test_headers_over_64_kib_die_at_the_first_attempt(nats_server: Any) -> None:
    """JetStream refuses a header block over 65,535 bytes (error 10097), whatever max_payload
    says: that is never going to work, so it is a PermanentError before anything is sent
    (it used to be sent, refused, and retried until out of attempts). 65,535 is stored."""
    stream = await make_stream(nats_server.url)
    pub = NatsPublisher(nats_server.url, ack_timeout=5)
    await pub.start()
    try:
        subject = f"{stream.prefix}.order.created"
        probe = sized_event(1, subject, 10, {"Big": ""})
        room = 65535 - header_block(wire_headers(probe))
        fits = sized_event(1, subject, 10, {"Big": "b" * room})
        assert header_block(wire_headers(fits)) == 65535
        over = sized_event(2, subject, 10, {"Big": "b" * (room + 1)})
        out = await pub.publish_batch([fits, over])
        assert out[0] is None, out[0]
        assert isinstance(out[1], PermanentError) and "64 KiB" in str(out[1]), out[1]
        info = await stream.js.stream_info(stream.name)
        assert info.state.messages == 1
    finally:
        await pub.close()
        await stream.nc.close()


# -- --nats-url ---------------------------------------------------------------------------------

SECRET = "Nats-pw-never-shown"


def run_worker(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_"))}
    return subprocess.run([WORKER, *args], capture_output=True, text=True, timeout=timeout, env={**clean, **(env or {})})


@pytest.mark.parametrize("url, says", [
    ("nat://127.0.0.1:4222", "has the scheme 'nat'"),
    ("garbage", "has no scheme"),
    ("nats://127.0.0.1:4222,,nats://127.0.0.1:4223", "an empty server"),
    ("nats://127.0.0.1:port", "malformed NATS URL"),
    ("nats://", "no valid host name"),
    (f"nats://outbox:{SECRET}@127.0.0.1:4222/extra", "has a path"),
    ("ws://127.0.0.1:80,nats://127.0.0.1:4222", "mixes websocket"),
])
@pytest.mark.parametrize("given", ["flag", "env"])
def test_a_malformed_nats_url_exits_2_at_start_in_one_line(dsn: str, url: str, says: str, given: str) -> None:
    """It used to be retried forever ("invalid connect url option", a DNS error for 'nat')."""
    args = ["--dsn", dsn] + (["--nats-url", url] if given == "flag" else [])
    r = run_worker(*args, env={"OUTBOXPG_NATS_URL": url} if given == "env" else None)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("outboxpg-worker: "), r.stderr
    assert says in lines[0], lines[0]
    assert SECRET not in r.stderr


async def test_a_comma_separated_list_of_servers_is_used(dsn: str, conn: Conn, nats_server: Any,
                                                        tmp_path: Path) -> None:
    """The first server in the list is down: the worker connects to the other one."""
    stream = await make_stream(nats_server.url)
    await stream.nc.close()
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    i = insert(conn, "order", "1")
    urls = f"nats://127.0.0.1:{free_port()}, {nats_server.url}"
    proc, log = spawn_worker(tmp_path, "listed", "--dsn", dsn, "--nats-url", urls, "--lease", "4",
                             "--publish-timeout", "1", env={})
    try:
        await until(lambda: state(conn, i) == "published" or proc.poll() is not None, 20, "the event published")
    finally:
        code = stop_worker(proc)
    assert code == 0 and state(conn, i) == "published", log.read_text()
