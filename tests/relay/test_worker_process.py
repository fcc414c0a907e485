"""outboxpg-worker as a process: kill -9, SIGTERM, and its one-line errors."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import WORKER
from jetstream import StreamHandle, make_stream, read_stream
from psycopg.conninfo import conninfo_to_dict

from outboxpg import Event, enqueue_many
from outboxpg.cli.errors import EXIT_CONNECT, EXIT_SCHEMA


def spawn(dsn: str, nats_url: str, name: str, *extra: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [WORKER, "--dsn", dsn, "--nats-url", nats_url, "--name", name, "--batch-size", "50",
         "--concurrency", "2", "--lease", "3", "--publish-timeout", "1", "--summary-interval", "1", *extra],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def fill(dsn: str, n: int, aggregates: int) -> None:
    with psycopg.connect(dsn) as c:
        enqueue_many(c, [Event("order", str(i % aggregates), "updated", {"i": i}) for i in range(n)])


def wait_for(conn: psycopg.Connection[Any], query: str, want: Any, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if conn.execute(query).fetchone()[0] == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out: {query} != {want!r} (last {conn.execute(query).fetchone()[0]!r})")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
async def test_kill_9_mid_batch_loses_nothing_and_duplicates_only_by_msg_id(dsn, conn, nats_server, tmp_path):
    conn.execute("UPDATE outbox_settings SET backoff_base = '50 milliseconds', backoff_cap = '200 milliseconds'")
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    total = 20_000
    fill(dsn, total, aggregates=500)
    victim = spawn(dsn, nats_server.url, "victim", log=tmp_path / "victim.log")
    survivor = None
    try:
        # Freeze the victim at a moment it holds leases (mid-batch), then kill it outright.
        leased: list[int] = []
        deadline = time.monotonic() + 30
        holding = "SELECT count(*) FROM outbox WHERE state = 'processing' AND locked_by = 'victim'"
        while not leased:
            assert time.monotonic() < deadline, "victim never held a lease"
            # Watched running (stopped and resumed every few ms, it took 12 s to get going).
            if conn.execute(holding).fetchone()[0] == 0:
                time.sleep(0.005)
                continue
            victim.send_signal(signal.SIGSTOP)
            # A statement the victim sent just before the stop (a complete) still runs on its
            # backend: let it finish before reading what the victim holds.
            time.sleep(0.2)
            leased = [r[0] for r in conn.execute(
                "SELECT id FROM outbox WHERE state = 'processing' AND locked_by = 'victim'").fetchall()]
            if not leased:
                victim.send_signal(signal.SIGCONT)
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        survivor = spawn(dsn, nats_server.url, "survivor", log=tmp_path / "survivor.log")
        wait_for(conn, "SELECT count(*) FROM outbox WHERE state = 'published'", total, 120)
    finally:
        if victim.poll() is None:
            victim.kill()
        if survivor is not None:
            stop(survivor)
    # What the victim had leased was taken over after its lease expired...
    took_over = conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s) AND locked_by = 'survivor' "
                             "AND state = 'published'", (leased,)).fetchone()[0]
    assert took_over == len(leased)
    # ...and the stream holds every event exactly once: any re-publish carried the same msg_id
    # and JetStream dropped it.
    msgs = await read_stream(stream)
    await stream.nc.close()
    assert len(msgs) == total
    assert {m.msg_id for m in msgs} == {r[0] for r in conn.execute("SELECT msg_id FROM outbox").fetchall()}
    assert conn.execute("SELECT count(*) FROM outbox WHERE state <> 'published'").fetchone()[0] == 0


async def test_sigterm_under_load_exits_0_leaving_nothing_leased(dsn, conn, nats_server, tmp_path):
    stream: StreamHandle = await make_stream(nats_server.url)
    await stream.nc.close()
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    fill(dsn, 30_000, aggregates=2_000)
    log = tmp_path / "worker.log"
    proc = spawn(dsn, nats_server.url, "w", log=log)
    try:
        wait_for(conn, "SELECT count(*) > 1000 FROM outbox WHERE state = 'published'", True, 30)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0, text
    assert elapsed < 3, "exits well within the 3 s lease"
    assert conn.execute("SELECT count(*) FROM outbox WHERE state = 'processing'").fetchone()[0] == 0
    assert "event=shutdown_requested" in text and "event=stopped" in text
    # Every claimed event was reported; the rest waits, pending, for the next worker.
    published = conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0]
    assert 1000 <= published <= 30_000


def run_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WORKER, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_bad_dsn_is_one_line_without_password():
    r = run_worker("--dsn", "host=127.0.0.1 port=1 user=u password=hunter2 dbname=x")
    assert r.returncode == EXIT_CONNECT
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot connect to PostgreSQL" in lines[0], r.stderr
    assert "hunter2" not in r.stderr + r.stdout


def test_database_without_schema_is_one_line(empty_dsn):
    r = run_worker("--dsn", empty_dsn)
    assert r.returncode == EXIT_SCHEMA
    p = conninfo_to_dict(empty_dsn)
    assert r.stderr.strip().splitlines() == [
        f"outboxpg-worker: the outbox schema is not installed in database {p['dbname']} on {p['host']}:{p['port']}: "
        "run outboxpg migrate --dsn ..."]


def test_flags_come_from_environment_and_are_validated(dsn):
    r = run_worker(env={"OUTBOXPG_DSN": dsn, "OUTBOXPG_LEASE": "1", "OUTBOXPG_PUBLISH_TIMEOUT": "5"})
    assert r.returncode == 2
    assert "lease (1s) must be at least twice the publish timeout (5s)" in r.stderr


def test_help_documents_every_flag_with_default():
    r = run_worker("--help")
    assert r.returncode == 0
    for flag in ("--dsn", "--nats-url", "--batch-size", "--concurrency", "--lease", "--poll-interval",
                 "--poll-only", "--ensure-stream", "--publisher"):
        assert flag in r.stdout
    assert "OUTBOXPG_BATCH_SIZE" in r.stdout and "(default: 500)" in r.stdout


def test_custom_publisher_from_module(dsn, conn, tmp_path):
    module = tmp_path / "mypub.py"
    module.write_text("import sys\n"
                      "def publish(event):\n"
                      "    print('GOT', event.id, event.subject, flush=True)\n")
    enqueue_many(conn, [Event("order", "1", "created", {"x": 1})])
    proc = subprocess.Popen([WORKER, "--dsn", dsn, "--publisher", "mypub:publish", "--poll-interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    try:
        wait_for(conn, "SELECT count(*) FROM outbox WHERE state = 'published'", 1, 20)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "GOT 1 outbox.order.created" in out
