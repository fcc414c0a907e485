"""Commands that write name their database: without --dsn or OUTBOXPG_DSN they refuse before
connecting (libpq would pick one by itself: the local socket, a database named after the OS
user), say which one they write to before they do, and a rollback asks first."""

from __future__ import annotations

import pytest
from commands import TARGET, one_line_error, run, run_all, run_on_tty
from psycopg.conninfo import conninfo_to_dict

from outboxpg import sql_files
from outboxpg.cli.errors import EXIT_CONNECT, EXIT_FAILED, EXIT_USAGE

WRITES = {
    ("migrate",): "outboxpg migrate",
    ("migrate", "--rollback", "--yes"): "outboxpg migrate --rollback",
    ("migrate", "--adopt"): "outboxpg migrate --adopt",
    ("dead", "requeue", "7"): "outboxpg dead requeue",
    ("dead", "discard", "7", "--reason", "x"): "outboxpg dead discard",
    ("replay", "--id", "7"): "outboxpg replay",
    ("maintain",): "outboxpg maintain",
}


def test_commands_that_write_need_a_named_database() -> None:
    # PGHOST points nowhere: a command that tried to connect would say "cannot connect".
    for r in run_all(*WRITES, env={"PGHOST": "127.0.0.1", "PGPORT": "1"}):
        assert one_line_error(r, EXIT_USAGE) == (
            f"outboxpg: {WRITES[r.args]} writes to a database: name it with --dsn or OUTBOXPG_DSN "
            "(--dsn '' takes libpq's PG* variables)"), r


@pytest.mark.parametrize("args", [("migrate", "--status"), ("replay", "--id", "7", "--dry-run"),
                                  ("maintain", "--dry-run"), ("status",)])
def test_commands_that_only_read_may_use_the_pg_variables(args: tuple[str, ...]) -> None:
    r = run(*args, env={"PGHOST": "127.0.0.1", "PGPORT": "1"})
    assert "cannot connect to PostgreSQL" in one_line_error(r, EXIT_CONNECT), r


def test_an_empty_dsn_asks_for_the_pg_variables_and_the_target_is_named(empty_dsn: str) -> None:
    p = conninfo_to_dict(empty_dsn)
    env = {"PGHOST": p["host"], "PGPORT": str(p["port"]), "PGUSER": p["user"], "PGDATABASE": p["dbname"]}
    r = run("migrate", "--dsn", "", env=env)
    assert r.code == 0, r
    assert TARGET.fullmatch(r.err) and r.err == (
        f"outboxpg: migrating database {p['dbname']} on {p['host']}:{p['port']} as {p['user']}\n"), r


def test_rollback_names_the_database_and_steps_and_asks(empty_dsn: str) -> None:
    steps = sql_files.step_ids()
    assert run("migrate", "--dsn", empty_dsn).code == 0
    p = conninfo_to_dict(empty_dsn)
    where = f"database {p['dbname']} on {p['host']}:{p['port']}"
    refused = run("migrate", "--rollback", "--steps", "2", "--dsn", empty_dsn)
    assert one_line_error(refused, EXIT_FAILED) == (
        f"outboxpg: refusing to roll back 2 steps of {where} without confirmation: stdin is not a terminal "
        "(pass --yes)")
    no = run_on_tty(["migrate", "--rollback", "--steps", "2", "--dsn", empty_dsn], "n\n")
    assert no.code == EXIT_FAILED and "cancelled: nothing changed" in no.err, no
    assert f"About to roll back in {where} (user {p['user']}), newest first:\n  {steps[-1]}\n  {steps[-2]}\n" in no.err
    assert f"Roll back these 2 steps in {where}? [y/N]" in no.err
    status = run("migrate", "--status", "--dsn", empty_dsn)
    assert status.out.splitlines()[-1] == f"applied  {steps[-1]}", status
    yes = run_on_tty(["migrate", "--rollback", "--dsn", empty_dsn], "y\n")
    assert (yes.code, yes.out) == (0, f"rolled back {steps[-1]}\n"), yes
    assert f"outboxpg: rolling back {where}\n" in yes.err
    assert one_line_error(run("migrate", "--rollback", "--steps", "0", "--dsn", empty_dsn), EXIT_USAGE) == \
        "outboxpg: --steps must be 1 or more, got 0"
