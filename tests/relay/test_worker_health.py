"""/healthz and /readyz on the metrics port, and what a worker tells at INFO while it delivers:

- a worker process with PostgreSQL stopped under it: /readyz 503 naming PostgreSQL, /healthz
  200, both 200 once PostgreSQL is back; the same with the nats-server (naming the broker);
- no stream capturing its subjects: not ready, naming the stream;
- a stuck event loop or a closed publisher fails /healthz;
- the first delivery is logged at INFO, once, and the first summary comes 5 s after it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
from commands import WORKER
from helpers import Running, insert
from jetstream import StreamHandle, make_stream, read_stream
from workers import all_in, wait_until

from outboxpg import schema
from outboxpg.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from outboxpg.events import OutboxEvent
from outboxpg.relay.metrics import WorkerMetrics
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.worker import EARLY_SUMMARY, Worker, WorkerConfig


def get(port: int, path: str) -> tuple[int, str]:
    """(HTTP status, body) of GET path on the metrics port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def until_answer(port: int, path: str, status: int, timeout: float, proc: subprocess.Popen[bytes] | None = None,
                 log: Path | None = None) -> str:
    """Poll ``path`` until it answers ``status``; returns the body."""
    deadline = time.monotonic() + timeout
    last: tuple[int, str] | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the worker exited ({proc.returncode}):\n{log.read_text() if log else ''}")
        try:
            last = get(port, path)
        except OSError as exc:   # not listening yet
            last = (0, repr(exc))
        if last[0] == status:
            return last[1]
        time.sleep(0.1)
    tail = log.read_text()[-3000:] if log else ""
    raise AssertionError(f"{path} did not answer {status} within {timeout}s (last {last!r})\n{tail}")


@pytest.fixture
def own_postgres() -> Iterator[EmbeddedPostgres]:
    """A migrated cluster of this test's own (database 'app'), which the test may stop and start."""
    with EmbeddedPostgres() as pg:
        with psycopg.connect(pg.dsn, autocommit=True) as c:
            c.execute("CREATE DATABASE app")
        schema.migrate(pg.dsn_for("app"))
        yield pg


def spawn(dsn: str, nats_url: str, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([WORKER, "--dsn", dsn, "--nats-url", nats_url, "--metrics-port", str(port),
                             "--lease", "4", "--publish-timeout", "1", "--maintenance-interval", "0",
                             "--poll-interval", "60", *extra],
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM the worker this test started (by its PID) and wait; kill it after 20 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


async def test_readyz_follows_postgresql_and_the_nats_server_while_healthz_stays_up(
        own_postgres: EmbeddedPostgres, own_nats_server: EmbeddedNats, tmp_path: Path) -> None:
    pg, nats_server = own_postgres, own_nats_server
    dsn = pg.dsn_for("app")
    stream = await make_stream(nats_server.url)
    await stream.nc.close()
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    port = free_port()
    log = tmp_path / "worker.log"
    proc = spawn(dsn, nats_server.url, port, log)
    try:
        assert until_answer(port, "/readyz", 200, 20, proc, log) == "ok\n"
        assert get(port, "/healthz") == (200, "ok\n")
        assert get(port, "/metrics")[0] == 200   # still there, beside them

        # PostgreSQL stopped under the worker (pg_ctl stop of this test's own cluster).
        await asyncio.to_thread(pg.halt, "fast")
        body = until_answer(port, "/readyz", 503, 15, proc, log)
        assert body.startswith("PostgreSQL: ") and body.count("\n") == 1, body
        assert get(port, "/healthz") == (200, "ok\n")
        await asyncio.to_thread(pg.launch)
        assert until_answer(port, "/readyz", 200, 15, proc, log) == "ok\n"
        assert get(port, "/healthz") == (200, "ok\n")
        # And it delivers again.
        with psycopg.connect(dsn, autocommit=True) as c:
            first = insert(c, "order", "1")
            await wait_until(all_in(dsn, "published", 1), 15, "an event delivered after PostgreSQL came back")

        # The nats-server stopped under the worker (its own process, by PID: EmbeddedNats.stop).
        await asyncio.to_thread(nats_server.stop)
        body = until_answer(port, "/readyz", 503, 15, proc, log)
        assert body.startswith("broker: NATS ") and "PostgreSQL" not in body and body.count("\n") == 1, body
        assert get(port, "/healthz") == (200, "ok\n")
        await asyncio.to_thread(nats_server.start)
        assert until_answer(port, "/readyz", 200, 20, proc, log) == "ok\n"
        assert get(port, "/healthz") == (200, "ok\n")
        with psycopg.connect(dsn, autocommit=True) as c:
            second = insert(c, "order", "1")
            await wait_until(all_in(dsn, "published", 2), 15, "an event delivered after NATS came back")
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-3000:]
    nc = await nats.connect(nats_server.url)
    try:
        stored = await read_stream(StreamHandle(nc, nc.jetstream(), stream.name, stream.prefix))
    finally:
        await nc.close()
    assert [m.outbox_id for m in stored] == [first, second]


async def test_waiting_for_a_stream_the_worker_is_alive_but_not_ready(
        dsn: str, conn: psycopg.Connection[Any], nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """Without a stream for its subjects the worker exits 5; with --wait-for-stream it waits, alive
    and not ready, /readyz saying why."""
    conn.execute("UPDATE outbox_settings SET subject_prefix = 'nostream_health'")
    port = free_port()
    log = tmp_path / "worker.log"
    proc = spawn(dsn, nats_server.url, port, log, "--wait-for-stream")
    try:
        until_answer(port, "/healthz", 200, 20, proc, log)
        deadline = time.monotonic() + 20
        while "event=waiting_for_stream " not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        status, body = get(port, "/readyz")
        assert status == 503 and body.startswith("stream: "), body
        assert "nostream_health" in body and body.count("\n") == 1, body
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()[-3000:]


class _Closable:
    """A publisher of one's own that says when it is closed (``closed``) and not connected (``health_problem``)."""

    def __init__(self) -> None:
        self.closed = False
        self.problem: str | None = None

    async def publish_batch(self, events: list[OutboxEvent]) -> list[None]:
        return [None] * len(events)

    def health_problem(self) -> str | None:
        return self.problem


async def test_healthz_fails_on_a_stuck_event_loop_or_a_closed_publisher(dsn: str) -> None:
    metrics = WorkerMetrics(dsn)
    metrics.health.stall_after = 0.5
    port = free_port()
    server, _thread = metrics.serve(port)
    publisher = _Closable()
    running = Running(Worker(WorkerConfig(dsn=dsn, publish_timeout=1, lease=4, maintenance_interval=0), publisher,
                             metrics))
    try:
        assert await asyncio.to_thread(until_answer, port, "/readyz", 200, 15) == "ok\n"
        # The loop blocked for 1.5 s (as a synchronous call in a coroutine would): asked from
        # another thread meanwhile, /healthz fails.
        seen: list[tuple[int, str]] = []
        asker = threading.Timer(1.0, lambda: seen.append(get(port, "/healthz")))
        asker.start()
        time.sleep(1.5)   # noqa: ASYNC251 - blocking the loop is the point
        asker.join(5)
        assert len(seen) == 1 and seen[0][0] == 503, seen
        assert re.fullmatch(r"event loop stuck: no heartbeat for \ds\n", seen[0][1]), seen
        assert await asyncio.to_thread(until_answer, port, "/healthz", 200, 5) == "ok\n"

        publisher.problem = "the queue is unreachable"
        assert await asyncio.to_thread(get, port, "/readyz") == (503, "broker: the queue is unreachable\n")
        publisher.problem = None
        publisher.closed = True
        assert await asyncio.to_thread(get, port, "/healthz") == (503, "publisher closed\n")
    finally:
        await running.stop()
        server.shutdown()
        server.server_close()
    assert metrics.health.readiness() == "stopping"


async def test_the_first_delivery_is_logged_once_and_the_first_summary_comes_early(
        dsn: str, conn: psycopg.Connection[Any], nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outboxpg.worker")
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    running = Running(Worker(WorkerConfig(dsn=dsn, publish_timeout=1, lease=4, maintenance_interval=0,
                                          summary_interval=60), NatsPublisher(nats_server.url, ack_timeout=1)))
    try:
        await wait_until(running.idle, 15, "the worker idle")
        assert "event=first_delivery" not in caplog.text and "event=summary" not in caplog.text
        first = insert(conn, "order", "1", "created")
        await wait_until(lambda: _logged(caplog, "event=first_delivery"), 10, "the first delivery logged")
        delivered_at = time.monotonic()
        for i in range(3):
            insert(conn, "order", str(i), "updated")
        await wait_until(all_in(dsn, "published", 4), 10, "all delivered")
        await wait_until(lambda: _logged(caplog, "event=summary "), EARLY_SUMMARY + 5, "the first summary")
        took = time.monotonic() - delivered_at
    finally:
        await running.stop()
        await stream.nc.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "outboxpg.worker"]
    firsts = [line for line in lines if line.startswith("event=first_delivery ")]
    assert firsts == [f"event=first_delivery worker={running.worker.cfg.name} id={first} "
                      f"subject={stream.prefix}.order.created event_type=created"], lines
    assert EARLY_SUMMARY - 1 < took < EARLY_SUMMARY + 2, took
    summary = next(line for line in lines if line.startswith("event=summary "))
    assert " delivered=4 " in summary, summary


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return text in caplog.text


def test_subprocess_log_says_first_delivery_at_info(dsn: str, conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    """The command at its default log level: event=start, then event=first_delivery, then an early summary."""
    module = tmp_path / "quietpub.py"
    module.write_text("def publish(event):\n    pass\n")
    log = tmp_path / "worker.log"
    insert(conn, "order", "1", "created")
    proc = subprocess.Popen([WORKER, "--dsn", dsn, "--publisher", "quietpub:publish", "--maintenance-interval", "0"],
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"), cwd=tmp_path)
    try:
        deadline = time.monotonic() + EARLY_SUMMARY + 15
        while "event=summary " not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    finally:
        code = stop(proc)
    text = log.read_text()
    assert code == 0, text
    events = re.findall(r"level=INFO logger=outboxpg\.worker event=(\w+)", text)
    assert events[events.index("start"):][:3] == ["start", "first_delivery", "summary"], text
    assert re.search(r" event=summary .* delivered=1 ", text), text
