"""Published means stored (issue 25, case 5): the worker marks an event published only on a JetStream
PubAck (a stream and a sequence) from a stream its start check found or one JetStream says
captures the subject; and `--ensure-stream` never widens its stream beyond subject_prefix and
outbox_settings.allowed_subject_prefixes. Run as `outboxpg-worker`, against a real PostgreSQL and
nats-server, with core NATS services subscribed where a producer's subject leads."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
from commands import Proc
from helpers import allow_subjects, insert, set_settings
from jetstream import capture_under, delete_stream, new_stream, stream_subjects

from outboxpg.embedded import EmbeddedNats

Conn = psycopg.Connection[Any]


@contextlib.contextmanager
def responders(url: str, answers: dict[str, bytes]) -> Iterator[list[str]]:
    """Core NATS services (no stream): each subscribed on '<prefix>.>', answering every request
    with its bytes, in a thread of its own. Yields the subjects they were asked on."""
    asked: list[str] = []
    ready, stop = threading.Event(), threading.Event()

    async def serve() -> None:
        nc = await nats.connect(url)
        for prefix, answer in answers.items():
            async def respond(msg: Any, answer: bytes = answer) -> None:
                asked.append(msg.subject)
                await nc.publish(msg.reply, answer)
            await nc.subscribe(f"{prefix}.>", cb=respond)
        await nc.flush()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await nc.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield asked
    finally:
        stop.set()
        thread.join(10)


def wait_states(conn: Conn, ids: list[int], wanted: set[str], timeout: float = 30) -> dict[int, tuple[Any, ...]]:
    end = time.monotonic() + timeout
    while True:
        rows = {r[0]: r[1:] for r in conn.execute(
            "SELECT id, state::text, attempts, last_error FROM outbox WHERE id = ANY(%s)", (ids,)).fetchall()}
        if all(rows[i][0] in wanted for i in ids):
            return rows
        assert time.monotonic() < end, rows
        time.sleep(0.05)


def test_an_answer_from_a_core_nats_service_is_not_an_ack(dsn: str, conn: Conn, tmp_path: Path,
                                                          nats_server: EmbeddedNats, fast_retries: None) -> None:
    """A service subscribed on a producer's subject answering {"ok": true} was taken as an ack and
    the event marked published, although no stream stored it. So was any JSON without "error".
    Now: retried, then dead, with the reason; the events that go to the stream are published."""
    t = uuid.uuid4().hex[:8]
    outbox, prefix = new_stream(nats_server.url)   # the outbox's stream: '<prefix>.>'
    other, _ = new_stream(nats_server.url)         # a real stream that captures neither subject
    set_settings(conn, subject_prefix=prefix, max_attempts=2)
    allow_subjects(conn, f"payments{t}", f"forged{t}")
    side = capture_under(nats_server.url, f"payments{t}", f"forged{t}")
    good = insert(conn, "order", "o-1", "created")
    core = insert(conn, "payment", "p-1", "captured", subject=f"payments{t}.capture")
    forged = insert(conn, "payment", "p-2", "captured", subject=f"forged{t}.x")
    answers = {f"payments{t}": b'{"ok": true}',
               # names a stream that exists, but does not capture the subject
               f"forged{t}": b'{"stream": "%s", "seq": 1}' % other.encode()}
    with responders(nats_server.url, answers) as asked:
        w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--lease", "4", "--publish-timeout", "1")
        try:
            rows = wait_states(conn, [good, core, forged], {"published", "dead"})
        finally:
            assert w.stop() == 0, w.text()
            asyncio.run(delete_stream(nats_server.url, outbox))
            asyncio.run(delete_stream(nats_server.url, other))
            asyncio.run(delete_stream(nats_server.url, side))
    assert rows[good][0] == "published"
    assert rows[core][:2] == ("dead", 2), rows[core]
    assert "not a JetStream ack (no stream and seq)" in rows[core][2], rows[core]
    assert rows[forged][:2] == ("dead", 2), rows[forged]
    assert (f"answer naming stream '{other}' is not a JetStream ack for 'forged{t}.x' (no stream captures it)"
            in rows[forged][2]), rows[forged]
    assert asked.count(f"payments{t}.capture") == 2 and asked.count(f"forged{t}.x") == 2, asked


def test_ensure_stream_adds_only_allowed_explicit_subjects(dsn: str, conn: Conn, tmp_path: Path,
                                                           nats_server: EmbeddedNats) -> None:
    """`--ensure-stream` added every explicit subject producers wrote: 'payments.capture' became
    part of the outbox's stream, and another client's request to it got a JetStream ack. Now only
    those under allowed_subject_prefixes go in; one written while its prefix was allowed and
    disallowed since is left out, and the start check says so."""
    t = uuid.uuid4().hex[:8]
    set_settings(conn, subject_prefix=f"p{t}")
    allow_subjects(conn, f"billing{t}", f"payments{t}")
    billing = insert(conn, "invoice", "i-1", "issued", subject=f"billing{t}.invoice.issued")
    insert(conn, "payment", "p-1", "captured", subject=f"payments{t}.capture")
    allow_subjects(conn, f"billing{t}")   # payments disallowed since: its event is still there
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--ensure-stream", f"S{t}",
             "--lease", "4", "--publish-timeout", "1")
    try:
        wait_states(conn, [billing], {"published"})
        w.wait_for("event=stream_check", 10)
    finally:
        assert w.stop() == 0, w.text()
        try:
            subjects = asyncio.run(stream_subjects(nats_server.url, f"S{t}"))
        finally:
            asyncio.run(delete_stream(nats_server.url, f"S{t}"))
    assert subjects == sorted([f"p{t}.>", f"billing{t}.invoice.issued"]), subjects
    (check,) = [line for line in w.text().splitlines() if "event=stream_check" in line]
    assert (f"no JetStream stream captures the explicit subject of 1 unfinished event: 'payments{t}.capture' "
            "(1 event), outside subject_prefix and outbox_settings.allowed_subject_prefixes") in check, check
    assert "--ensure-stream does not add them" in check


@pytest.mark.parametrize("prefixes", [["billing"], []])
def test_the_worker_login_reads_the_allowed_prefixes(dsn: str, conn: Conn, logins: dict[str, Any],
                                                     prefixes: list[str]) -> None:
    allow_subjects(conn, *prefixes)
    with psycopg.connect(logins["worker"].dsn) as c:
        assert c.execute("SELECT allowed_subject_prefixes FROM outbox_settings").fetchone() == (prefixes,)
