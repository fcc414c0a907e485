"""Safe output (issue 25, case 10): control characters in what producers write (aggregate_id, header
values, a last_error quoting them) are escaped by `outboxpg dead list/show`, `status` and `replay`
and in the worker's log: one line stays one line, and nothing reaches the terminal as an escape
sequence. Output is read as bytes: text mode would turn a bare CR into a line break unseen."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
from commands import CLI, Proc, cli_env
from helpers import claim, fail, insert
from jetstream import new_stream

from outboxpg.cli.errors import EXIT_USAGE
from outboxpg.embedded import EmbeddedNats

Conn = psycopg.Connection[Any]

TERMINAL = "\x1b]0;x\x07\x1b[2J"                  # set the window title, clear the screen
FORGED = "\rlevel=ERROR event=forged"             # a bare CR: back to the start of the line
HOSTILE_ID = f"o-1{TERMINAL}{FORGED}"
# Any control character but the line feeds the commands write themselves.
RAW_CONTROL = re.compile(rb"[\x00-\x09\x0b-\x1f\x7f]|\xc2[\x80-\x9f]|\xe2\x80[\xa8\xa9]")


def cli(*args: str) -> tuple[int, bytes, bytes]:
    p = subprocess.run([*CLI, *args], capture_output=True, env=cli_env(), timeout=60)
    return p.returncode, p.stdout, p.stderr


def assert_clean(out: bytes) -> None:
    assert not RAW_CONTROL.search(out), out


def dead_event(conn: Conn, aggregate_id: str, error: str, **cols: Any) -> int:
    i = insert(conn, "order", aggregate_id, "created", '{"note": "\\u001b[2J"}', **cols)
    (row,) = [r for r in claim(conn, 10) if r["id"] == i]
    assert fail(conn, i, row["lease_token"], error, permanent=True) == "dead"
    return i


def test_the_operator_commands_escape_what_producers_wrote(dsn: str, conn: Conn) -> None:
    i = dead_event(conn, HOSTILE_ID, f"PermanentError: header value {TERMINAL!s}\nDETAIL: {FORGED}",
                   headers='{"X-Note": "a\\u001b]0;pwned\\u0007\\u009b2J"}')
    j = dead_event(conn, "o-2\u2028next", "RuntimeError: plain")
    escaped_id = "o-1\\x1b]0;x\\x07\\x1b[2J\\rlevel=ERROR event=forged"

    code, out, err = cli("dead", "list", "--dsn", dsn)
    assert code == 0 and err == b"", err
    assert_clean(out)
    lines = out.decode().split("\n")
    assert len(lines) == 2 + 2 + 3, lines     # header, rule, two events; blank, summary, final newline
    assert any(f"order/{escaped_id}" in line for line in lines), lines
    assert any("order/o-2\\u2028next" in line for line in lines), lines

    code, out, err = cli("dead", "show", str(i), "--dsn", dsn)
    assert code == 0 and err == b"", err
    assert_clean(out)
    text = out.decode()
    assert f"  aggregate_id         {escaped_id}\n" in text, text
    assert "DETAIL: \\rlevel=ERROR event=forged" in text and "\\nDETAIL" in text, text
    assert '"X-Note": "a\\u001b]0;pwned\\u0007\\x9b2J"' in text, text   # JSON's escapes, then C1
    assert f"of order/{escaped_id}. outboxpg dead requeue {i}" in text, text

    for command in (("dead", "list", "--json"), ("dead", "show", str(j), "--json"), ("status", "--json")):
        code, out, err = cli(*command, "--dsn", dsn)
        assert code == 0, err
        assert_clean(out)
    code, out, err = cli("dead", "show", str(j), "--dsn", dsn, "--json")
    assert b'"o-2\\u2028next"' in out, out

    code, out, err = cli("status", "--dsn", dsn)
    assert code == 0, err
    assert_clean(out)


def test_replay_and_its_errors_escape_them_too(dsn: str, conn: Conn) -> None:
    i = insert(conn, "order", HOSTILE_ID, "created", "{}")
    conn.execute("UPDATE outbox SET state = 'published', published_at = now() WHERE id = %s", (i,))
    code, out, err = cli("replay", "--dsn", dsn, "--aggregate-id", HOSTILE_ID, "--dry-run")
    assert code == 0, err
    assert_clean(out + err)
    assert b"Would replay 1 published event" in out, out
    # A bad --since quoting the producer's text back: one line.
    code, out, err = cli("replay", "--dsn", dsn, "--since", HOSTILE_ID)
    assert code == EXIT_USAGE and out == b"", (out, err)
    assert_clean(err.rstrip(b"\n"))
    assert err.count(b"\n") == 1, err


def test_the_worker_log_keeps_one_line_per_record(dsn: str, conn: Conn, tmp_path: Path,
                                                  nats_server: EmbeddedNats) -> None:
    """A dead letter's log line names the aggregate: its CR and escape sequences are escaped (a
    bare CR used to pass the worker's one-line filter and forge a line)."""
    _, prefix = new_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (prefix,))
    i = insert(conn, "order", HOSTILE_ID, "created", "{}", headers='{"X-Note": "a\\nb"}')   # can never be sent
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--lease", "4", "--publish-timeout", "1")
    try:
        end = time.monotonic() + 20
        while conn.execute("SELECT state FROM outbox WHERE id = %s", (i,)).fetchone() != ("dead",):
            assert time.monotonic() < end and w.p.poll() is None, w.log.read_bytes()
            time.sleep(0.05)
        w.wait_for("event=dead_letter", 10)
    finally:
        assert w.stop() == 0, w.log.read_bytes()
    log = w.log.read_bytes()
    assert_clean(log)
    for line in log.decode().splitlines():
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} level=", line), line
    (dead,) = [line for line in log.decode().splitlines() if "event=dead_letter" in line]
    assert "aggregate=order/o-1\\x1b]0;x\\x07\\x1b[2J\\rlevel=ERROR event=forged event_type=created" in dead, dead
