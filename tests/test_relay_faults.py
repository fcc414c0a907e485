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
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from helpers import discard, insert, requeue
from outboxpg import Event, enqueue_many
from outboxpg.events import NotSent, OutboxEvent, PermanentError
from outboxpg.publishers import FunctionPublisher
from outboxpg.worker import Worker, WorkerConfig

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


class Running:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.task = asyncio.create_task(worker.run())

    async def stop(self) -> None:
        self.worker.stop()
        await asyncio.wait_for(self.task, 30)


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

WORKER = str(Path(sys.executable).parent / "outboxpg-worker")

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
                           payload=b"{}", headers={}, msg_id=f"m{i}", attempt=1, created_at=datetime.now(timezone.utc))

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
