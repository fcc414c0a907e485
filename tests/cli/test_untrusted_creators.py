"""Installs that cannot be taken over (issue 25, case 3), the worker's side: once roles besides the
owners' may CREATE in the install schema (a GRANT made after the install, which migrate could not
refuse), they could plant objects the SECURITY DEFINER functions run as the owner. outboxpg-worker
refuses to start, in one line naming the REVOKE, and outboxpg status says so in an attention
line; run as the documented worker and operator logins."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import WORKER, Proc, run
from psycopg import sql
from roles import Login, login_roles

from outboxpg.cli.errors import EXIT_FAILED

Conn = psycopg.Connection[Any]


def install_schema(conn: Conn) -> str:
    row = conn.execute("SELECT pronamespace::regnamespace::text FROM pg_proc WHERE proname = 'outbox_claim'").fetchone()
    assert row is not None
    return str(row[0])


def start_worker(login: Login) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WORKER, "--dsn", login.dsn, "--publisher", "outboxpg.relay.publishers:print_event"],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("grantee", ["stranger", "PUBLIC"])
def test_the_worker_refuses_and_status_says_so_while_others_may_create(dsn: str, conn: Conn, tmp_path: Path,
                                                                       logins: dict[str, Login], grantee: str) -> None:
    schema = install_schema(conn)
    with login_roles(dsn, stranger=None) as strangers:
        who = strangers["stranger"].name if grantee == "stranger" else "PUBLIC"
        target = sql.SQL("PUBLIC") if grantee == "PUBLIC" else sql.Identifier(who)
        conn.execute(sql.SQL("GRANT CREATE ON SCHEMA {} TO {}").format(sql.Identifier(schema), target))
        try:
            refused = start_worker(logins["worker"])
            status = run("status", "--dsn", logins["operator"].dsn, "--health-only")
        finally:
            conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA {} FROM {}").format(sql.Identifier(schema), target))
    advice = (f"{who} may CREATE in schema {schema}, where the outbox's SECURITY DEFINER functions look up names "
              f"(whoever may create there can run code as the owner): REVOKE CREATE ON SCHEMA {schema} FROM {who} "
              "(docs/privileges.md)")
    assert (refused.returncode, refused.stdout) == (EXIT_FAILED, ""), refused
    assert refused.stderr == f"outboxpg-worker: refusing to start: {advice}\n", refused.stderr
    assert status.code == 0, status
    assert f"  ! workers refuse to start: {advice}\n" in status.out, status.out

    # Revoked: the worker starts, and status has nothing to say about it.
    w = Proc(tmp_path, "--dsn", logins["worker"].dsn, "--publisher", "outboxpg.relay.publishers:print_event")
    try:
        w.wait_for("event=start", 20)
    finally:
        assert w.stop() == 0, w.text()
    assert "may CREATE" not in run("status", "--dsn", logins["operator"].dsn, "--health-only").out
