"""What holds back the xmin horizon (outbox_xmin_holders): a REPEATABLE READ
transaction left idle keeps every dead row version of the outbox alive, and claims slow down with
them. outbox_health, `outboxpg status` and the worker's log name it once it is older than
outbox_settings.xmin_warn_after (set low here)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from commands import run
from helpers import insert, set_settings
from psycopg.rows import dict_row
from roles import login_roles
from workers import start, wait_until

from outboxpg import schema
from outboxpg.embedded import EmbeddedPostgres
from outboxpg.relay.publishers import FunctionPublisher
from outboxpg.relay.worker import WorkerConfig

Conn = psycopg.Connection[Any]

HOLDER_COLUMNS = ("xmin_holders, xmin_holder_kind, xmin_holder_pid, xmin_holder_name, xmin_holder_state, "
                  "xmin_holder_role, xmin_holder_application, xmin_holder_age")


def health(conn: Conn) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(f"SELECT {HOLDER_COLUMNS} FROM outbox_health").fetchone()
    assert row is not None
    return row


def until(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)
    return value


def hold_snapshot(dsn: str, application: str = "nightly report") -> psycopg.Connection[Any]:
    """A REPEATABLE READ transaction that has taken its snapshot, left idle in transaction."""
    c = psycopg.connect(dsn, application_name=application)
    c.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    c.execute("SELECT count(*) FROM pg_class /* the report */")
    return c


@pytest.fixture
def held(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with hold_snapshot(dsn) as c:
        yield c
        c.rollback()


def test_a_held_snapshot_shows_in_outbox_health_past_the_threshold(conn: Conn, dsn: str) -> None:
    assert conn.execute("SELECT xmin_warn_after FROM outbox_settings").fetchone()[0].total_seconds() == 60
    with hold_snapshot(dsn) as c:
        pid = c.info.backend_pid
        # Listed at once, but younger than the threshold (1 minute): no warning.
        holders = conn.execute("SELECT kind, pid, state, past_threshold FROM outbox_xmin_holders()").fetchall()
        assert ("session", pid, "idle in transaction", False) in holders
        assert health(conn)["xmin_holders"] == 0
        set_settings(conn, xmin_warn_after="300 milliseconds")
        h = until(lambda: (r := health(conn))["xmin_holders"] and r, 10, "the holder past 300 ms")
        assert (h["xmin_holders"], h["xmin_holder_kind"], h["xmin_holder_pid"], h["xmin_holder_name"],
                h["xmin_holder_state"], h["xmin_holder_application"]) == (
            1, "session", pid, None, "idle in transaction", "nightly report")
        # Who holds it, never what its query says (another application's data).
        assert h["xmin_holder_role"] == c.info.user
        assert h["xmin_holder_age"].total_seconds() >= 0.3
        c.rollback()
    # Over: the session is idle, out of any transaction, and holds nothing.
    until(lambda: health(conn)["xmin_holders"] == 0, 10, "the holder gone")
    # A transaction that has written holds by its xid even at READ COMMITTED, with no snapshot.
    with psycopg.connect(dsn) as w:
        insert(w, "order", "written")
        h = until(lambda: (r := health(conn))["xmin_holders"] and r, 10, "the writer past 300 ms")
        assert (h["xmin_holder_pid"], h["xmin_holder_state"]) == (w.info.backend_pid, "idle in transaction")
        w.rollback()
    assert health(conn)["xmin_holders"] == 0


def test_the_oldest_holder_comes_first(conn: Conn, dsn: str) -> None:
    set_settings(conn, xmin_warn_after="100 milliseconds")
    with hold_snapshot(dsn, "first") as first:
        conn.execute("SELECT txid_current()")    # the next snapshot's xmin is newer
        with hold_snapshot(dsn, "second") as second:
            h = until(lambda: (r := health(conn))["xmin_holders"] == 2 and r, 10, "both past 100 ms")
            assert (h["xmin_holder_pid"], h["xmin_holder_application"]) == (first.info.backend_pid, "first")
            first.rollback()
            h = health(conn)
            assert (h["xmin_holders"], h["xmin_holder_pid"]) == (1, second.info.backend_pid)
            second.rollback()


def test_the_threshold_must_be_positive(conn: Conn) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        set_settings(conn, xmin_warn_after="0 seconds")


def test_outboxpg_status_warns_about_the_holder(conn: Conn, dsn: str, held: psycopg.Connection[Any]) -> None:
    quiet = run("status", "--dsn", dsn, "--health-only")
    assert quiet.code == 0, quiet
    assert re.search(r"^  xmin horizon \(VACUUM\) +not held past xmin_warn_after$", quiet.out, re.M), quiet.out
    assert "OK: nothing needs attention" in quiet.out
    set_settings(conn, xmin_warn_after="200 milliseconds")
    until(lambda: health(conn)["xmin_holders"], 10, "the holder past 200 ms")
    pid = held.info.backend_pid
    r = run("status", "--dsn", dsn, "--health-only")
    assert r.code == 0, r
    note = [line for line in r.out.splitlines() if line.startswith("  ! the xmin horizon")]
    assert len(note) == 1, r.out
    role = held.info.user
    assert note[0].startswith(f"  ! the xmin horizon is held back by session pid {pid} of role '{role}' "
                              "(application 'nightly report'), idle in transaction, for "), note
    assert note[0].endswith(": VACUUM can remove no dead row version of the outbox while it holds, "
                            "and claims slow down: end the transaction in its application, or SELECT "
                            f"pg_terminate_backend({pid})"), note
    assert "the report" not in r.out      # another session's query is not shown
    assert re.search(rf"^  xmin horizon \(VACUUM\) +held by session pid {pid} of role '{role}' \(application "
                     r"'nightly report'\), idle in transaction, for ", r.out, re.M), r.out
    as_json = run("status", "--dsn", dsn, "--health-only", "--json")
    doc = json.loads(as_json.out)
    assert (doc["health"]["xmin_holders"], doc["health"]["xmin_holder_pid"]) == (1, pid)
    assert any(a.startswith("the xmin horizon is held back by session") for a in doc["attention"])


def test_worker_and_operator_logins_see_another_roles_held_snapshot(dsn: str, conn: Conn) -> None:
    """pg_stat_activity shows other roles' xact_start, state and query only to privileged roles:
    outbox_xmin_holders() runs as its owner, and a worker or operator login reads it."""
    set_settings(conn, xmin_warn_after="100 milliseconds")
    with login_roles(dsn, producer="outbox_producer", worker="outbox_worker", operator="outbox_operator") as logins:
        with hold_snapshot(logins["producer"].dsn, "app") as p:
            pid = p.info.backend_pid
            for login in (logins["worker"], logins["operator"]):
                with login.connect() as c:
                    h = until(lambda c=c: (r := health(c))["xmin_holders"] and r, 10, "the holder, as " + login.name)
                    assert (h["xmin_holder_pid"], h["xmin_holder_state"], h["xmin_holder_application"]) == (
                        pid, "idle in transaction", "app")
                    assert c.execute("SELECT count(*) FROM outbox_xmin_holders() WHERE pid = %s AND past_threshold",
                                     (pid,)).fetchone() == (1,)
            with logins["producer"].connect() as other:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    other.execute("SELECT * FROM outbox_xmin_holders()")
            p.rollback()


async def test_the_worker_logs_a_holder_once_and_a_new_one_again(dsn: str, conn: Conn,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outboxpg.worker")
    set_settings(conn, xmin_warn_after="100 milliseconds")

    async def publish(event: Any) -> None:
        return None

    running = start(dsn, FunctionPublisher(publish), xmin_check_interval=0.05, maintenance_interval=0)
    gateway = running.worker.gateway
    looks = 0
    real = gateway.oldest_xmin_holder

    async def counted() -> Any:
        nonlocal looks
        looks += 1
        return await real()

    gateway.oldest_xmin_holder = counted  # type: ignore[method-assign]

    def held_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "event=xmin_held" in r.getMessage()]

    async def logged(n: int) -> bool:
        return len(held_lines()) >= n

    async def looked(n: int) -> bool:
        return looks >= n

    try:
        first = await asyncio.to_thread(hold_snapshot, dsn, "first")
        await wait_until(lambda: logged(1), 20, "the first holder logged")
        # Several more looks at the same holder (a second one, younger, changes nothing): no new line.
        second = await asyncio.to_thread(hold_snapshot, dsn, "second")
        at = looks
        await wait_until(lambda: looked(at + 10), 20, "ten more looks")
        assert len(held_lines()) == 1, held_lines()
        line = held_lines()[0]
        assert line.startswith(f"event=xmin_held kind='session' pid={first.info.backend_pid} name=None age_s="), line
        assert f"state='idle in transaction' role='{first.info.user}' application='first' note=" in line, line
        assert "the report" not in line, line
        # The first one ends: the second is now the oldest, a new holder, logged once.
        await asyncio.to_thread(first.rollback)
        await wait_until(lambda: logged(2), 20, "the second holder logged")
        at = looks
        await wait_until(lambda: looked(at + 10), 20, "ten more looks")
        lines = held_lines()
        assert len(lines) == 2 and f"pid={second.info.backend_pid} " in lines[1], lines
        await asyncio.to_thread(second.rollback)

        async def cleared() -> bool:
            return any("event=xmin_horizon_clear" in r.getMessage() for r in caplog.records)

        await wait_until(cleared, 20, "xmin_horizon_clear")
        for c in (first, second):
            await asyncio.to_thread(c.close)
    finally:
        await running.stop()
    assert len(held_lines()) == 2


def test_a_prepared_transaction_is_named_by_its_gid() -> None:
    """Two-phase commit left undecided holds the horizon until COMMIT/ROLLBACK PREPARED (a cluster
    of its own: prepared transactions are off by default)."""
    with EmbeddedPostgres(settings={"max_prepared_transactions": "2"}) as pg:
        schema.migrate(pg.dsn)
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            set_settings(admin, xmin_warn_after="100 milliseconds")
            with psycopg.connect(pg.dsn, autocommit=True) as c:
                c.execute("BEGIN")
                insert(c, "order", "2pc")
                c.execute("PREPARE TRANSACTION 'order-2pc'")
            h = until(lambda: (r := health(admin))["xmin_holders"] and r, 10, "the prepared transaction")
            assert (h["xmin_holder_kind"], h["xmin_holder_pid"], h["xmin_holder_name"], h["xmin_holder_state"]) == (
                "prepared transaction", None, "order-2pc", "prepared")
            r = run("status", "--dsn", pg.dsn, "--health-only")
            assert ("the xmin horizon is held back by prepared transaction 'order-2pc', prepared, for " in r.out
                    and "COMMIT PREPARED or ROLLBACK PREPARED 'order-2pc'" in r.out), r.out
            admin.execute("ROLLBACK PREPARED 'order-2pc'")
            assert health(admin)["xmin_holders"] == 0


def test_the_worker_option_is_checked() -> None:
    with pytest.raises(ValueError, match="xmin check interval must be 0"):
        WorkerConfig(dsn="", xmin_check_interval=-1).validate()


def test_sql_health_lists_the_holders(conn: Conn, dsn: str, held: psycopg.Connection[Any]) -> None:
    from helpers import run_files

    set_settings(conn, xmin_warn_after="200 milliseconds")
    until(lambda: health(conn)["xmin_holders"], 10, "the holder past 200 ms")
    [(code, out, err)] = run_files(dsn, ("health",))
    assert code == 0 and "ERROR" not in err, err
    assert re.search(r"^ xmin_holders +\| 1$", out, re.M), out
    assert re.search(r"^ xmin_holder_state +\| idle in transaction$", out, re.M), out
    section = out.split("== what holds back the xmin horizon (VACUUM), the oldest first (outbox_xmin_holders())")[1]
    section = section.split("==")[0]
    row = [line for line in section.splitlines() if f"| {held.info.backend_pid} " in line]
    assert len(row) == 1 and re.search(r"^ session +\| \d+ \| +\| nightly report +\| idle in transaction +\| "
                                       rf"00:00:0\d +\| +\d+ \| t +\| {held.info.user}$", row[0]), section
