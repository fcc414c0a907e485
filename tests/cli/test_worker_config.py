"""outboxpg-worker given bad configuration (issue 5), as a process: what it prints, how it exits,
and that where it waits it backs off instead of spinning. The behaviour table is in
docs/reference/cli.md ("When the worker cannot start").

  wrong DSN (refused port, unknown user or database, bad password, malformed)  exit 2, one line
  a database without the outbox schema                                         exit 3, one line
  a login that may not run the worker's functions                              exit 1, one line
  EXECUTE revoked while running                                                backoff up to 5 s per claim, recovers
  NATS refusing connections at start                                           a warning per try, 0.2 s .. 5 s apart
  no JetStream stream for the subjects / JetStream off                         a warning at start; events retried with backoff
No line ever shows the DSN's or the NATS URL's password.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import WORKER, Proc
from jetstream import add_stream, delete_stream, make_stream, new_stream
from psycopg import sql
from psycopg.conninfo import make_conninfo
from roles import login_roles

from outboxpg import enqueue
from outboxpg.cli.errors import EXIT_BROKER, EXIT_CONNECT, EXIT_SCHEMA, EXIT_USAGE
from outboxpg.embedded import EmbeddedPostgres, find_nats_server, free_port

SECRET = "S3cr3t-pw-never-shown"
Conn = psycopg.Connection[Any]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WORKER, *args], capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_"))})


def one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("outboxpg-worker: "), r.stderr
    assert SECRET not in r.stderr + r.stdout
    return lines[0]


def wait_state(conn: Conn, i: int, state: str, timeout: float) -> float:
    t0 = time.monotonic()
    while conn.execute("SELECT state::text FROM outbox WHERE id = %s", (i,)).fetchone() != (state,):
        assert time.monotonic() - t0 < timeout, f"event {i} not {state} within {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture
def printer(tmp_path: Path) -> dict[str, str]:
    """--publisher for tests that need no NATS: prints each event."""
    (tmp_path / "hi_printer.py").write_text("def publish(event):\n    print('GOT', event.id, flush=True)\n")
    return {"PYTHONPATH": str(tmp_path)}


# -- PostgreSQL ---------------------------------------------------------------------------------

def test_wrong_dsns_exit_3_in_one_line_without_the_password(dsn: str) -> None:
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    bad = {
        "refused port": f"host=127.0.0.1 port={free_port()} user=u password={SECRET} dbname=x",
        "unknown user": make_conninfo(dsn, user="outboxpg_no_such_user", password=SECRET),
        "unknown database": make_conninfo(dsn, dbname=f"{dbname}_missing", password=SECRET),
        "URI": f"postgresql://u:{SECRET}@127.0.0.1:{free_port()}/x",
        "unresolvable host": f"host=outboxpg-no-such-host.invalid password={SECRET}",
    }
    procs = {k: subprocess.Popen([WORKER, "--dsn", v], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, v in bad.items()}
    for what, p in procs.items():
        out, err = p.communicate(timeout=60)
        line = one_line(subprocess.CompletedProcess(p.args, p.returncode, out, err), EXIT_CONNECT)
        assert line.startswith("outboxpg-worker: cannot connect to PostgreSQL: "), (what, line)
    # Not a connection string: bad usage. "--dsn=--" is taken as the string "--" (argparse would
    # make it an empty list).
    assert "invalid connection string" in one_line(run("--dsn=--"), EXIT_USAGE)
    assert "invalid connection string" in one_line(run("--dsn", f"host=127.0.0.1 password='{SECRET}"), EXIT_USAGE)
    # None at all: libpq would pick a database by itself.
    assert one_line(run(), EXIT_USAGE) == ("outboxpg-worker: the worker writes to a database: name it with --dsn or "
                                           "OUTBOXPG_DSN (--dsn '' takes libpq's PG* variables)")


def test_bad_password_exits_3_without_showing_it() -> None:
    with EmbeddedPostgres() as pg, psycopg.connect(pg.dsn, autocommit=True) as c:
        c.execute(sql.SQL("ALTER ROLE postgres PASSWORD {}").format(sql.Literal("the-right-one")))
        hba = pg.datadir / "pg_hba.conf"
        hba.write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        c.execute("SELECT pg_reload_conf()")
        time.sleep(0.2)
        r = run("--dsn", f"{pg.dsn} password={SECRET}")
        line = one_line(r, EXIT_CONNECT)
        assert 'password authentication failed for user "postgres"' in line, line
        r = run("--dsn", pg.dsn)   # no password at all
        assert "no password supplied" in one_line(r, EXIT_CONNECT)


def test_database_without_the_schema_exits_4_naming_it(empty_dsn: str) -> None:
    p = psycopg.conninfo.conninfo_to_dict(empty_dsn)
    assert one_line(run("--dsn", empty_dsn), EXIT_SCHEMA) == (
        f"outboxpg-worker: the outbox schema is not installed in database {p['dbname']} on {p['host']}:{p['port']}: "
        "run outboxpg migrate --dsn ...")


@pytest.fixture
def worker_login(dsn: str) -> Iterator[Any]:
    with login_roles(dsn, worker="outbox_worker", nobody=None) as made:
        yield made


def test_a_login_without_the_worker_role_exits_1_naming_what_it_lacks(dsn: str, worker_login: Any) -> None:
    line = one_line(run("--dsn", worker_login["nobody"].dsn), 1)
    assert f"role '{worker_login['nobody'].name}' may not execute outbox_claim, outbox_complete" in line, line
    assert "nor read outbox_settings" in line and "GRANT outbox_worker TO" in line, line


def test_execute_on_claim_revoked_exits_1_at_start(conn: Conn, worker_login: Any) -> None:
    conn.execute("REVOKE EXECUTE ON FUNCTION outbox_claim(integer, interval, text, bigint, text, boolean) FROM outbox_worker")
    line = one_line(run("--dsn", worker_login["worker"].dsn), 1)
    assert line.endswith("may not execute outbox_claim: make it a member of outbox_worker "
                         f"(GRANT outbox_worker TO \"{worker_login['worker'].name}\"; see docs/privileges.md)"), line


def test_execute_revoked_while_running_backs_off_and_recovers(conn: Conn, worker_login: Any, tmp_path: Path,
                                                              printer: dict[str, str]) -> None:
    login = worker_login["worker"]
    w = Proc(tmp_path, "--dsn", login.dsn, "--publisher", "hi_printer:publish", "--poll-interval", "0.5",
             env=printer)
    try:
        w.wait_for("event=start", 20)
        time.sleep(0.3)
        conn.execute("REVOKE EXECUTE ON FUNCTION outbox_claim(integer, interval, text, bigint, text, boolean) FROM outbox_worker")
        # Connections cache nothing about privileges: the next claim is refused.
        i = enqueue(conn, "order", "1", "created", {})
        w.wait_for("event=db_error during=claim", 10)
        t0 = time.monotonic()
        time.sleep(2)
        refused = w.count("event=db_error during=claim")
        # 0.1, 0.2, 0.4, ... up to 5 s between claims: 4 or 5 in 2 s; a spinning loop would make thousands.
        assert 3 <= refused <= 7, w.text()
        assert "permission denied for function outbox_claim" in w.text()
        conn.execute("GRANT EXECUTE ON FUNCTION outbox_claim(integer, interval, text, bigint, text, boolean) TO outbox_worker")
        took = wait_state(conn, i, "published", 10)
        assert took < 6, "picked up again within the 5 s backoff cap"
        assert time.monotonic() - t0 < 20
    finally:
        assert w.stop() == 0, w.text()
    assert SECRET not in w.text() and login.dsn.split("password=")[1].split()[0] not in w.text()
    assert "Traceback" not in w.text()


# -- NATS ---------------------------------------------------------------------------------------

def test_nats_refusing_at_start_is_a_warning_per_try_with_backoff_and_sigterm_exits_0(dsn: str,
                                                                                     tmp_path: Path) -> None:
    url = f"nats://outbox:{SECRET}@127.0.0.1:{free_port()}"
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", url)
    try:
        w.wait_for("event=nats_connect_failed", 20)
        time.sleep(2.5)
        tries = w.count("event=nats_connect_failed")
        # Pauses 0.2, 0.4, 0.8, 1.6, 3.2 s: 4 or 5 tries in about 2.5 s (nats-py alone: one every
        # 0.5 s, and silent).
        assert 3 <= tries <= 6, w.text()
        t0 = time.monotonic()
        assert w.stop() == 0, w.text()
        assert time.monotonic() - t0 < 3
    finally:
        w.stop()
    text = w.text()
    assert SECRET not in text and "nats://outbox:***@127.0.0.1" in text, text
    assert "ConnectionRefusedError" in text and "Traceback" not in text


async def test_nats_coming_up_later_is_used_at_once(dsn: str, conn: Conn, own_nats_server: Any,
                                                   tmp_path: Path) -> None:
    stream = await make_stream(own_nats_server.url)
    await stream.nc.close()
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    i = enqueue(conn, "order", "1", "created", {})
    own_nats_server.stop()
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", own_nats_server.url, "--lease", "4", "--publish-timeout", "1")
    try:
        await asyncio.to_thread(w.wait_for, "event=nats_connect_failed", 20)
        await asyncio.sleep(1)
        own_nats_server.start()
        took = await asyncio.to_thread(wait_state, conn, i, "published", 15)
        assert took < 8, w.text()
    finally:
        assert w.stop() == 0, w.text()


def test_no_stream_for_the_prefix_exits_5_in_one_line(dsn: str, conn: Conn, nats_server: Any) -> None:
    conn.execute("UPDATE outbox_settings SET subject_prefix = 'nostream_hi'")
    i = enqueue(conn, "order", "1", "created", {})
    r = run("--dsn", dsn, "--nats-url", nats_server.url, "--log-level", "WARNING")
    assert one_line(r, EXIT_BROKER) == (
        f"outboxpg-worker: no JetStream stream captures 'nostream_hi.>' on {nats_server.url}, where every event "
        "without a subject of its own goes: pass --ensure-stream NAME to create one, or add the subjects to a "
        "stream (nats stream add), or --wait-for-stream to wait for one")
    # An allowed prefix nothing captures anything under: the same, naming it.
    name, prefix = new_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s, allowed_subject_prefixes = '{nostream_billing}'",
                 (prefix,))
    r = run("--dsn", dsn, "--nats-url", nats_server.url, "--log-level", "WARNING")
    assert "no JetStream stream captures anything under the allowed subject prefix 'nostream_billing'" in \
        one_line(r, EXIT_BROKER)
    assert conn.execute("SELECT state::text, attempts FROM outbox WHERE id = %s", (i,)).fetchone() == ("pending", 0)


def test_wait_for_stream_says_so_once_and_starts_when_one_appears(dsn: str, conn: Conn, nats_server: Any,
                                                                   tmp_path: Path) -> None:
    conn.execute("UPDATE outbox_settings SET subject_prefix = 'late_hi'")
    i = enqueue(conn, "order", "1", "created", {})
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--wait-for-stream")
    try:
        w.wait_for("event=waiting_for_stream", 20)
        assert w.count("event=waiting_for_stream") == 1 and "event=start " not in w.text()
        asyncio.run(add_stream(nats_server.url, "LATE_HI", ["late_hi.>"]))
        w.wait_for("event=stream_found", 20)
        assert wait_state(conn, i, "published", 20) >= 0
        assert w.count("event=waiting_for_stream") == 1
    finally:
        assert w.stop() == 0, w.text()
        asyncio.run(delete_stream(nats_server.url, "LATE_HI"))
    assert "Traceback" not in w.text()


def test_an_explicit_subject_no_stream_captures_is_a_warning_and_retries_back_off(
        dsn: str, conn: Conn, nats_server: Any, tmp_path: Path) -> None:
    """A subject a producer wrote (under an allowed prefix) that no stream captures stops only its
    own events: refusing to start over it would let one producer stop every worker's restart."""
    name, prefix = new_stream(nats_server.url)
    asyncio.run(add_stream(nats_server.url, "SIDE_HI", ["side_hi.other.>"]))
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s, allowed_subject_prefixes = '{side_hi}', "
                 "backoff_base = '300 ms', backoff_cap = '1 s', max_attempts = 1000", (prefix,))
    i = enqueue(conn, "order", "1", "created", {}, subject="side_hi.x")
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--lease", "4", "--publish-timeout", "1",
             "--poll-interval", "0.5")
    try:
        w.wait_for("event=stream_check problem=\"no JetStream stream captures the explicit subject", 20)
        time.sleep(2)
        attempts, error = conn.execute("SELECT attempts, last_error FROM outbox WHERE id = %s", (i,)).fetchone()
        # Retried on the backoff schedule (0.15-0.3 s, 0.3-0.6 s, then 0.5-1 s): at most 6 in 2 s.
        assert 2 <= attempts <= 7, attempts
        assert error == "RuntimeError: no JetStream stream captures this subject (no responders)"
    finally:
        assert w.stop() == 0, w.text()
        asyncio.run(delete_stream(nats_server.url, "SIDE_HI"))
    assert "Traceback" not in w.text()


def test_jetstream_switched_off_exits_5_and_a_server_that_is_not_nats_exits_3(dsn: str, conn: Conn) -> None:
    port = free_port()
    server = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        r = run("--dsn", dsn, "--nats-url", f"nats://127.0.0.1:{port}", "--ensure-stream", "HI",
                "--log-level", "WARNING")
        assert one_line(r, EXIT_BROKER) == (
            f"outboxpg-worker: JetStream is not enabled on nats://127.0.0.1:{port}: start nats-server with -js "
            "(or a jetstream {} block in its configuration)")
        assert "event=ensure_stream_failed" not in r.stderr
    finally:
        server.terminate()
        server.wait(10)
    # PostgreSQL's port: it waits for the client to speak first; NATS greets at once.
    pg_port = conn.info.port
    r = run("--dsn", dsn, "--nats-url", f"nats://127.0.0.1:{pg_port}", "--log-level", "WARNING")
    assert one_line(r, EXIT_CONNECT) == (
        f"outboxpg-worker: --nats-url nats://127.0.0.1:{pg_port}: not a NATS server: 127.0.0.1:{pg_port} sent "
        "nothing within 2 s of connecting (a NATS server greets at once)")
