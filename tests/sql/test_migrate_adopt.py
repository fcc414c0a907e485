"""Databases installed by hand (issue 10): `outboxpg sql | psql`, then `outboxpg migrate`,
`--status` and `--adopt`; `--status` as an outbox_operator (read only); the NOTICE of a rollback
that keeps the group roles. The CLI runs as a subprocess, as in tests/cli/test_cli.py."""

from __future__ import annotations

import dataclasses
import subprocess
import uuid

import psycopg
from commands import after_target, one_line_error, run
from helpers import psql_args, psql_env
from psycopg import sql
from roles import login_roles

from outboxpg import sql_files

STEPS = sql_files.step_ids()


def psql_install(dsn: str, upto: int | None = None) -> None:
    """As a DBA would: the install script (outboxpg sql), or the first ``upto`` files, through psql."""
    if upto is None:
        script = sql_files.install_sql()
    else:
        script = "\\set ON_ERROR_STOP on\n" + "".join(
            f"\\i {sql_files.migrations_dir() / (step + '.sql')}\n" for step in STEPS[:upto])
    r = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", *psql_args(dsn)], input=script, text=True,
                       capture_output=True, env=psql_env(dsn))
    assert r.returncode == 0, r.stderr


def where(dsn: str) -> str:
    p = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"database {p['dbname']} on {p['host']}:{p['port']}"


def test_hand_installed_database_is_adopted(empty_dsn: str) -> None:
    psql_install(empty_dsn)
    migrate = run("migrate", "--dsn", empty_dsn)
    assert one_line_error(migrate, 1) == (
        f"outboxpg: the outbox schema is already installed in {where(empty_dsn)}, but yoyo has no record of it "
        "(installed with psql?): run outboxpg migrate --adopt to check it against the migration files and record "
        "it, then outboxpg migrate")
    status = run("migrate", "--status", "--dsn", empty_dsn)
    assert status.code == 0, status
    assert status.out.splitlines() == [
        f"the outbox schema is installed in {where(empty_dsn)} but yoyo has no record of it (installed with psql?): "
        "outboxpg migrate --adopt checks it against the files and records it",
        *(f"not recorded  {s}" for s in STEPS)]

    adopt = run("migrate", "--adopt", "--dsn", empty_dsn)
    assert adopt.code == 0 and after_target(adopt.err) == "", adopt
    assert adopt.out.splitlines() == [*(f"recorded {s}" for s in STEPS),
                                      f"checked against the migration files: the install matches {len(STEPS)} "
                                      "steps, recorded in yoyo's bookkeeping"]
    assert run("migrate", "--status", "--dsn", empty_dsn).out.splitlines() == [f"applied  {s}" for s in STEPS]
    again, up_to_date, status_cmd = (run("migrate", "--adopt", "--dsn", empty_dsn), run("migrate", "--dsn", empty_dsn),
                                     run("status", "--dsn", empty_dsn))
    assert again.out.startswith(f"nothing to adopt: yoyo records {len(STEPS)} of the {len(STEPS)} steps already")
    assert (up_to_date.code, up_to_date.out) == (0, "schema is up to date\n"), up_to_date
    assert status_cmd.code == 0, status_cmd
    # yoyo can roll back what it recorded, as if it had applied it
    rolled = run("migrate", "--rollback", "--dsn", empty_dsn, "--yes")
    assert rolled.out == f"rolled back {STEPS[-1]}\n", rolled
    assert run("migrate", "--dsn", empty_dsn).out == f"applied {STEPS[-1]}\n"


def test_partly_hand_installed_database_records_what_is_there(empty_dsn: str) -> None:
    psql_install(empty_dsn, upto=len(STEPS) - 2)
    adopt = run("migrate", "--adopt", "--dsn", empty_dsn)
    assert adopt.code == 0, adopt
    assert adopt.out.splitlines()[-1] == (f"checked against the migration files: the install matches {len(STEPS) - 2} "
                                          "steps, recorded in yoyo's bookkeeping; outboxpg migrate applies the other 2")
    assert run("migrate", "--dsn", empty_dsn).out.splitlines() == [f"applied {s}" for s in STEPS[-2:]]


def test_a_schema_that_differs_from_the_files_is_not_adopted(empty_dsn: str) -> None:
    psql_install(empty_dsn)
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        # A "fix" made by hand to a function the first step installs.
        c.execute("CREATE OR REPLACE FUNCTION outbox_retry_delay(attempt integer, base interval, cap interval) "
                  "RETURNS interval LANGUAGE sql IMMUTABLE AS $$ SELECT base $$")
        c.execute("CREATE TABLE orders (id text PRIMARY KEY)")      # the application's own: does not count
    adopt = run("migrate", "--adopt", "--dsn", empty_dsn)
    adopt = dataclasses.replace(adopt, err=after_target(adopt.err))   # said before it looked
    line = one_line_error(adopt, 1)
    assert line.startswith(f"outboxpg: not adopted: the outbox schema in {where(empty_dsn)} does not match the "
                           "migration files of this version (different function outbox_retry_delay("), line
    assert line.endswith("; nothing recorded") and "orders" not in line
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        assert c.execute("SELECT to_regclass('_yoyo_migration')").fetchone() == (None,)   # yoyo not even set up


def test_migrate_status_as_an_operator_is_read_only(dsn: str) -> None:
    with login_roles(dsn, operator="outbox_operator") as made:
        r = run("migrate", "--status", "--dsn", made["operator"].dsn)
    assert r.code == 0 and r.err == "", r
    assert r.out.splitlines() == [f"applied  {s}" for s in STEPS]


def test_rollback_shows_the_notice_about_kept_roles(dsn: str) -> None:
    member = f"outboxpg_test_relay_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(member)))
        c.execute(sql.SQL("GRANT outbox_worker TO {}").format(sql.Identifier(member)))
    try:
        back = len(STEPS) - STEPS.index("0012_outbox_privileges")
        r = run("migrate", "--rollback", "--steps", str(back), "--dsn", dsn, "--yes")
        assert r.code == 0, r
        assert r.out.splitlines() == [f"rolled back {s}" for s in STEPS[:-back - 1:-1]]
        assert f"NOTICE:  outboxpg: keeping role outbox_worker: members: {member}" in r.err, r.err
        assert "Traceback" not in r.err
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(member)))
