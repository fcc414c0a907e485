"""An operator's day (issue 10): `outboxpg status` run by the wrong login, on the wrong database,
and while events fail over and over; the worker's log of failing publishes; `outboxpg dead show`
of a large payload. The CLI runs as a subprocess, as in tests/cli/test_cli.py."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import psycopg
import pytest
from commands import one_line_error, run, run_all
from helpers import allow_subjects, claim, fail, fail_times, insert
from psycopg.conninfo import conninfo_to_dict
from roles import Login

from outboxpg.cli.errors import EXIT_SCHEMA
from outboxpg.events import OutboxEvent
from outboxpg.relay.worker import Worker, WorkerConfig

Conn = psycopg.Connection[Any]


# -- the wrong login, the wrong database ------------------------------------------------------

def test_status_as_a_producer_login_names_the_operator_role(logins: dict[str, Login]) -> None:
    producer, worker = logins["producer"], logins["worker"]
    status, dead_list, as_worker = run_all(("status", "--dsn", producer.dsn), ("dead", "list", "--dsn", producer.dsn),
                                           ("dead", "list", "--dsn", worker.dsn))
    assert one_line_error(status, 1) == (
        f"outboxpg: role '{producer.name}' may not read outbox_health (permission denied for view outbox_health): "
        f"log in as a member of outbox_operator (GRANT outbox_operator TO \"{producer.name}\"; see docs/privileges.md)")
    assert one_line_error(dead_list, 1).startswith(
        f"outboxpg: role '{producer.name}' may not read outbox_dead_letters (permission denied for view "
        "outbox_dead_letters): log in as a member of outbox_operator")
    assert f"GRANT outbox_operator TO \"{worker.name}\"" in one_line_error(as_worker, 1)
    assert producer.dsn.split("password=")[-1] not in status.err


def test_schema_not_installed_names_the_database(empty_dsn: str) -> None:
    p = conninfo_to_dict(empty_dsn)
    for r in run_all(("status", "--dsn", empty_dsn), ("dead", "list", "--dsn", empty_dsn)):
        assert one_line_error(r, EXIT_SCHEMA) == (
            f"outboxpg: the outbox schema is not installed in database {p['dbname']} on {p['host']}:{p['port']}: "
            "run outboxpg migrate --dsn ...")


# -- events failing right now -----------------------------------------------------------------

def test_status_shows_events_failing_now_grouped_by_reason(dsn: str, conn: Conn) -> None:
    allow_subjects(conn, "elsewhere")
    stuck = insert(conn, "order", "o-stuck", "created", subject="elsewhere.orders")
    fail_times(conn, stuck, "RuntimeError: no JetStream stream captures this subject (no responders)", 4)
    timeouts = [insert(conn, "order", f"o-{n}", "paid") for n in range(3)]
    for i in timeouts:
        fail_times(conn, i, "TimeoutError: no ack within 10 s\nsecond line", 1)
    ok = insert(conn, "order", "o-fine", "created")

    text, js = run_all(("status", "--dsn", dsn), ("status", "--dsn", dsn, "--json"))
    assert text.code == 0, text
    section = text.out.split("\nfailing now", 1)[1].split("\n\n", 1)[0]
    rows = [line.split() for line in section.splitlines()[3:]]
    assert [r[:3] for r in rows] == [["3", "1", "1"], ["1", "4", "4"]], section
    assert "TimeoutError: no ack within 10 s" in section and "second line" not in section
    assert "RuntimeError: no JetStream stream captures this subject (no responders)" in section
    # No stream for a subject: the attention line names the subject (tests/relay/test_stream_subjects.py).
    assert "! 1 event fails: no JetStream stream captures its subject ('elsewhere.orders'; 4 attempts so far)" \
        in text.out, text.out
    assert "TimeoutError" not in text.out.split("\nattention\n", 1)[1]
    assert "OK: nothing needs attention" not in text.out

    obj = js.json()
    failing = {f["reason"]: f for f in obj["failing"]}
    assert set(failing) == {"TimeoutError: no ack within 10 s",
                            "RuntimeError: no JetStream stream captures this subject (no responders)"}
    t = failing["TimeoutError: no ack within 10 s"]
    assert (t["events"], t["min_attempts"], t["max_attempts"], t["recurring"]) == (3, 1, 1, False)
    assert sorted(t["ids"]) == timeouts and t["event_types"] == ["paid"]
    s = failing["RuntimeError: no JetStream stream captures this subject (no responders)"]
    assert (s["events"], s["max_attempts"], s["recurring"], s["ids"]) == (1, 4, True, [stuck])
    assert any("no JetStream stream captures its subject" in a for a in obj["attention"])
    assert ok not in [i for f in obj["failing"] for i in f["ids"]]


def test_status_failing_as_an_operator_login(dsn: str, conn: Conn, logins: dict[str, Login]) -> None:
    i = insert(conn, "order", "o-1", "created")
    fail_times(conn, i, "boom", 3)
    obj = run("status", "--dsn", logins["operator"].dsn, "--json", "--health-only").json()
    assert [(f["reason"], f["events"], f["recurring"]) for f in obj["failing"]] == [("boom", 1, True)]


# -- the worker's log of failing publishes -----------------------------------------------------

async def test_worker_logs_a_failure_reason_once_then_summarises(dsn: str, conn: Conn, fast_retries: None,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    ids = [insert(conn, "order", f"a-{n}", "created") for n in range(4)] + [insert(conn, "order", "b-1", "created")]

    def publish(event: OutboxEvent) -> None:
        if event.aggregate_id == "b-1":
            raise ValueError("schema registry refused it")
        raise RuntimeError(f"downstream said no to event {event.id}\ntrace: ...")

    caplog.set_level(logging.INFO, logger="outboxpg.worker")
    worker = Worker(WorkerConfig(dsn=dsn, poll_interval=0.2, summary_interval=0.3, maintenance_interval=0,
                                 batch_size=10), publish)
    task = asyncio.create_task(worker.run())
    try:
        end = time.monotonic() + 60
        while True:
            (low,) = conn.execute("SELECT min(attempts) FROM outbox WHERE id = ANY(%s)", (ids,)).fetchone()  # type: ignore[misc]
            summaries = [r for r in caplog.records if r.getMessage().startswith("event=publish_failures ")]
            if low >= 4 and summaries:
                break
            assert time.monotonic() < end and not task.done(), (low, caplog.text)
            await asyncio.sleep(0.1)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)

    firsts = [r for r in caplog.records if r.getMessage().startswith("event=publish_failed ") and r.levelno == logging.WARNING]
    # One WARNING per reason (ids and numbers do not make a reason new), not one per attempt.
    assert len(firsts) == 2, [r.getMessage() for r in firsts]
    messages = " ".join(r.getMessage() for r in firsts)
    assert "downstream said no to event" in messages and "schema registry refused it" in messages
    assert "trace: ..." not in messages
    summaries = [r for r in caplog.records if r.getMessage().startswith("event=publish_failures ")]
    assert all(r.levelno == logging.WARNING for r in summaries)
    counted = sum(int(re.search(r" failures=(\d+)", r.getMessage()).group(1))  # type: ignore[union-attr]
                  for r in summaries if "schema registry" in r.getMessage())
    assert counted >= 3, [r.getMessage() for r in summaries]
    # Fewer log lines than failed attempts: the log does not flood.
    (attempts,) = conn.execute("SELECT sum(attempts) FROM outbox WHERE id = ANY(%s)", (ids,)).fetchone()  # type: ignore[misc]
    assert len(firsts) + len(summaries) < attempts


# -- dead show --------------------------------------------------------------------------------

@pytest.fixture
def big_dead(conn: Conn) -> int:
    payload = '{"blob": "' + "x" * 100_000 + '", "tail": "the end"}'
    i = insert(conn, "order", "o-big", "created", payload=payload)
    (row,) = claim(conn, 1)
    assert fail(conn, i, row["lease_token"], "payload too large", True) == "dead"
    return i


def test_dead_show_cuts_large_payloads_and_hides_internal_columns(dsn: str, big_dead: int) -> None:
    default, small, whole, js = run_all(("dead", "show", str(big_dead), "--dsn", dsn),
                                        ("dead", "show", str(big_dead), "--dsn", dsn, "--max-bytes", "100"),
                                        ("dead", "show", str(big_dead), "--dsn", dsn, "--max-bytes", "0"),
                                        ("dead", "show", str(big_dead), "--dsn", dsn, "--json", "--max-bytes", "100"))
    assert default.code == 0, default
    assert len(default.out.encode()) < 6000, len(default.out)
    assert "the end" not in default.out
    m = re.search(r"\.\.\. \((\d+) more bytes of (\d+) not shown: --max-bytes 0 shows them all\)", default.out)
    assert m and int(m.group(2)) > 100_000 and int(m.group(2)) - int(m.group(1)) <= 4096, default.out
    for hidden in ("in_flow", "unfinished"):
        assert not any(line.split()[:1] == [hidden] for line in default.out.splitlines()), default.out
    assert "x" * 50 in small.out and "x" * 101 not in small.out and "more bytes of" in small.out
    assert "the end" in whole.out and "not shown" not in whole.out
    obj = js.json()
    assert "in_flow" not in obj and "unfinished" not in obj
    assert obj["payload_bytes"] > 100_000 and obj["payload_cut_bytes"] == obj["payload_bytes"] - 100
    assert isinstance(obj["payload"], str) and len(obj["payload"].encode()) == 100


def test_dead_show_small_payload_is_whole_and_json_unchanged(dsn: str, conn: Conn) -> None:
    i = insert(conn, "order", "o-1", "created", payload='{"a": 1}')
    (row,) = claim(conn, 1)
    fail(conn, i, row["lease_token"], "nope", True)
    text, js = run_all(("dead", "show", str(i), "--dsn", dsn), ("dead", "show", str(i), "--dsn", dsn, "--json"))
    assert '"a": 1' in text.out and "not shown" not in text.out
    assert js.json()["payload"] == {"a": 1} and js.json()["payload_cut_bytes"] == 0


def test_status_grammar_for_one_dead_letter(dsn: str, conn: Conn) -> None:
    i = insert(conn, "order", "o-1", "created")
    (row,) = claim(conn, 1)
    fail(conn, i, row["lease_token"], "nope", True)
    obj = run("status", "--dsn", dsn, "--json").json()
    assert obj["attention"] == ["1 dead letter holds back later events of its aggregate: outboxpg dead list"]
