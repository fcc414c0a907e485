"""Events with a subject of their own (issue 10): a stream made for <subject_prefix>.> does not
capture 'billing.invoice.issued' (which producers may write once an operator allows 'billing' in
outbox_settings.allowed_subject_prefixes). `outboxpg-worker --ensure-stream` adds the explicit
subjects of the unfinished events under the allowed prefixes to its stream, never others (issue
25); without it, the start-up check says in one WARNING line which explicit subjects no stream
captures; `outboxpg status` names the subject of events failing with "no responders", and with
`--nats-url` checks every subject before anything fails. The subjects come from
outbox_unfinished_subjects() (schema/80_observability.sql)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import Proc, run
from helpers import allow_subjects, fail_times, insert, set_settings
from jetstream import capture_under, delete_stream, new_stream, stream_subjects
from roles import login_roles

from outboxpg.embedded import EmbeddedNats

Conn = psycopg.Connection[Any]
NO_STREAM = "RuntimeError: no JetStream stream captures this subject (no responders)"


def tag() -> str:
    return uuid.uuid4().hex[:8]


def wait_published(conn: Conn, ids: list[int], timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s) AND state = 'published'",
                       (ids,)).fetchone()[0] != len(ids):
        assert time.monotonic() < end, conn.execute("SELECT id, state, last_error FROM outbox").fetchall()
        time.sleep(0.05)


def test_the_function_lists_default_and_explicit_subjects_of_unfinished_events(conn: Conn) -> None:
    set_settings(conn, subject_prefix="shop")
    allow_subjects(conn, "billing")
    insert(conn, "order", "1", "created")
    insert(conn, "order", "2", "created")
    insert(conn, "invoice", "i-1", "issued", subject="billing.invoice.issued")
    done = insert(conn, "invoice", "i-2", "issued", subject="billing.done")
    conn.execute("UPDATE outbox SET state = 'published', published_at = now() WHERE id = %s", (done,))
    rows = conn.execute("SELECT subject, explicit, events FROM outbox_unfinished_subjects()").fetchall()
    assert rows == [("shop.order.created", False, 2), ("billing.invoice.issued", True, 1)]
    assert conn.execute("SELECT count(*) FROM outbox_unfinished_subjects(1)").fetchone() == (1,)


def test_a_worker_and_an_operator_login_may_call_it(dsn: str, conn: Conn) -> None:
    allow_subjects(conn, "billing")
    insert(conn, "invoice", "i-1", "issued", subject="billing.invoice.issued")
    with login_roles(dsn, worker="outbox_worker", operator="outbox_operator", producer="outbox_producer") as logins:
        for role in ("worker", "operator"):
            with psycopg.connect(logins[role].dsn) as c:
                assert c.execute("SELECT subject FROM outbox_unfinished_subjects()").fetchall() == \
                    [("billing.invoice.issued",)]
        with psycopg.connect(logins["producer"].dsn) as c, pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute("SELECT * FROM outbox_unfinished_subjects()")


def test_ensure_stream_adds_the_explicit_subjects_the_events_use(dsn: str, conn: Conn, tmp_path: Path,
                                                                  nats_server: EmbeddedNats) -> None:
    t = tag()
    prefix, name, explicit = f"p{t}", f"S{t}", f"billing{t}.invoice.issued"
    set_settings(conn, subject_prefix=prefix)
    allow_subjects(conn, f"billing{t}")
    ids = [insert(conn, "order", "o-1", "created"),
           insert(conn, "invoice", "i-1", "issued", subject=explicit),
           insert(conn, "order", "o-2", "created", subject=f"{prefix}.custom")]   # under the prefix already
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--ensure-stream", name, "--lease", "4",
             "--publish-timeout", "1")
    try:
        w.wait_for("event=start", 20)
        wait_published(conn, ids)
    finally:
        assert w.stop() == 0, w.text()
        try:
            subjects = asyncio.run(stream_subjects(nats_server.url, name))
        finally:
            asyncio.run(delete_stream(nats_server.url, name))
    assert subjects == sorted([f"{prefix}.>", explicit]), subjects
    assert f"created stream {name} subjects=['{prefix}.>', '{explicit}']" in w.text(), w.text()
    assert "event=stream_check" not in w.text(), w.text()


def test_ensure_stream_leaves_a_subject_that_another_stream_captures(dsn: str, conn: Conn, tmp_path: Path,
                                                                     nats_server: EmbeddedNats) -> None:
    other, other_prefix = new_stream(nats_server.url)   # captures '<other_prefix>.>'
    t = tag()
    name = f"S{t}"
    set_settings(conn, subject_prefix=f"p{t}")
    allow_subjects(conn, other_prefix)
    i = insert(conn, "invoice", "i-1", "issued", subject=f"{other_prefix}.invoice.issued")
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--ensure-stream", name)
    try:
        w.wait_for("event=start", 20)
        wait_published(conn, [i])
    finally:
        assert w.stop() == 0, w.text()
        asyncio.run(delete_stream(nats_server.url, name))
        asyncio.run(delete_stream(nats_server.url, other))
    assert f"created stream {name} subjects=['p{t}.>']" in w.text(), w.text()
    assert "event=ensure_stream_failed" not in w.text() and "event=stream_check" not in w.text(), w.text()


def test_start_check_warns_once_about_explicit_subjects_no_stream_captures(dsn: str, conn: Conn, tmp_path: Path,
                                                                            nats_server: EmbeddedNats) -> None:
    stream, prefix = new_stream(nats_server.url)
    t = tag()
    set_settings(conn, subject_prefix=prefix, backoff_base="1 s", backoff_cap="1 s")
    allow_subjects(conn, f"billing{t}", f"audit{t}")
    side = capture_under(nats_server.url, f"billing{t}", f"audit{t}")
    ok = insert(conn, "order", "o-1", "created")
    for n in range(3):
        insert(conn, "invoice", f"i-{n}", "issued", subject=f"billing{t}.invoice.issued")
    insert(conn, "audit", "a-1", "logged", subject=f"audit{t}.x")
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--lease", "4", "--publish-timeout", "1")
    try:
        w.wait_for("event=start", 20)
        wait_published(conn, [ok])
    finally:
        assert w.stop() == 0, w.text()
        asyncio.run(delete_stream(nats_server.url, stream))
        asyncio.run(delete_stream(nats_server.url, side))
    checks = [line for line in w.text().splitlines() if "event=stream_check" in line]
    assert len(checks) == 1, w.text()
    assert "level=WARNING" in checks[0]
    assert (f"no JetStream stream captures the explicit subjects of 4 unfinished events: "
            f"'billing{t}.invoice.issued' (3 events), 'audit{t}.x' (1 event): each publish of them fails") \
        in checks[0], checks[0]
    assert "--ensure-stream NAME" in checks[0]
    # ... and the first failed publish says why, at WARNING too.
    assert "level=WARNING" in w.text().split("event=publish_failed", 1)[0].rsplit("\n", 1)[-1]


def test_status_names_the_subject_of_events_failing_for_want_of_a_stream(conn: Conn, dsn: str) -> None:
    allow_subjects(conn, "billing")
    i = insert(conn, "invoice", "i-1", "issued", subject="billing.invoice.issued")
    fail_times(conn, i, NO_STREAM, 1)   # at the first failure already: it cannot come right by itself
    out = run("status", "--dsn", dsn).out
    assert ("! 1 event fails: no JetStream stream captures its subject ('billing.invoice.issued'; 1 attempts so "
            "far): add it to a stream (outboxpg-worker --ensure-stream NAME adds the explicit subjects of "
            "unfinished events under allowed_subject_prefixes)") in out, out
    assert "subjects in JetStream" not in out   # not asked: no --nats-url


def test_status_with_nats_url_checks_every_subject_before_anything_fails(conn: Conn, dsn: str,
                                                                          nats_server: EmbeddedNats) -> None:
    stream, prefix = new_stream(nats_server.url)
    t = tag()
    try:
        set_settings(conn, subject_prefix=prefix)
        allow_subjects(conn, f"billing{t}")
        insert(conn, "order", "o-1", "created")
        insert(conn, "invoice", "i-1", "issued", subject=f"billing{t}.invoice.issued")
        insert(conn, "order", "o-2", "created", subject=f"{prefix}.own")
        r = run("status", "--dsn", dsn, "--nats-url", nats_server.url)
        assert r.code == 0, r
        assert "subjects in JetStream        3 checked; 1 captured by no stream" in r.out, r.out
        assert (f"! no JetStream stream captures the subject of 1 unfinished event: 'billing{t}.invoice.issued' "
                "(1 event): their publishes fail (no responders) until a stream captures them") in r.out, r.out
        obj = run("status", "--dsn", dsn, "--nats-url", nats_server.url, "--json", "--health-only").json()
        assert obj["subjects"] == {"checked": 3, "error": None, "missing": [
            {"subject": f"billing{t}.invoice.issued", "explicit": True, "events": 1}]}

        conn.execute("DELETE FROM outbox WHERE subject = %s", (f"billing{t}.invoice.issued",))
        r = run("status", "--dsn", dsn, "--nats-url", nats_server.url, "--health-only")
        assert "subjects in JetStream        2 checked; each captured by a stream" in r.out, r.out
        assert "no JetStream stream captures" not in r.out
    finally:
        asyncio.run(delete_stream(nats_server.url, stream))


def test_status_with_an_unreachable_nats_says_so_in_one_attention_line(conn: Conn, dsn: str) -> None:
    from outboxpg.embedded import free_port

    insert(conn, "order", "o-1", "created")
    r = run("status", "--dsn", dsn, "--nats-url", f"nats://127.0.0.1:{free_port()}", "--health-only")
    assert r.code == 0, r
    assert "subjects in JetStream        1 checked; the check failed (see attention)" in r.out, r.out
    assert "! cannot check the subjects against JetStream (--nats-url): " in r.out, r.out
    assert "Traceback" not in r.out + r.err
