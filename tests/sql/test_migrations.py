"""Installing and removing the schema: yoyo migrations up and down, plain psql (the release steps one
by one, or `outboxpg sql`: the files of schema/ as one script)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from catalog import catalog, differences
from helpers import psql_args, psql_env

from outboxpg import schema, sql_files

LEFTOVERS = """
    SELECT 'relation ' || relname FROM pg_class WHERE relname LIKE 'outbox%%' OR relname LIKE '%%outbox%%idx'
    UNION ALL SELECT 'function ' || proname FROM pg_proc WHERE proname LIKE 'outbox%%'
    UNION ALL SELECT 'type ' || typname FROM pg_type WHERE typname LIKE '%%outbox%%'
    UNION ALL SELECT 'trigger ' || tgname FROM pg_trigger WHERE tgname LIKE 'outbox%%'
"""


def leftovers(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as c:
        return [r[0] for r in c.execute(LEFTOVERS).fetchall()]


def migration_files() -> list[Path]:
    return sorted(p for p in sql_files.migrations_dir().glob("[0-9]*.sql") if not p.name.endswith(".rollback.sql"))


def all_step_ids() -> list[str]:
    return [p.name.removesuffix(".sql") for p in migration_files()]


def round_trip(dsn: str) -> None:
    """Insert, claim and complete one event: the installed schema works."""
    with psycopg.connect(dsn, autocommit=True) as c:
        (i,) = c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                         "VALUES ('order', '1', 'created', '{}') RETURNING id").fetchone()  # type: ignore[misc]
        rows = c.execute("SELECT id, lease_token, subject FROM outbox_claim(10)").fetchall()
        assert [(r[0], r[2]) for r in rows] == [(i, "outbox.order.created")]
        assert c.execute("SELECT outbox_complete(ARRAY[%s]::bigint[], %s)", (i, rows[0][1])).fetchone() == (1,)
        assert c.execute("SELECT state::text FROM outbox WHERE id = %s", (i,)).fetchone() == ("published",)


def psql() -> str:
    exe = shutil.which("psql")
    if exe is None:
        pytest.skip("psql (the PostgreSQL client) is not installed on this machine")
    return exe


def run_psql(dsn: str, *args: str, input: str | None = None) -> str:
    result = subprocess.run([psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", *psql_args(dsn), *args],
                            input=input, capture_output=True, text=True, env=psql_env(dsn), timeout=60)
    assert result.returncode == 0, f"psql {args} failed ({result.returncode}):\n{result.stderr}"
    return result.stdout


# --------------------------------------------------------------------------------------------
# yoyo: outboxpg.schema
# --------------------------------------------------------------------------------------------

def test_migrate_rollback_everything_and_migrate_again(empty_dsn: str) -> None:
    steps = all_step_ids()
    assert leftovers(empty_dsn) == []
    applied = schema.migrate(empty_dsn)
    assert applied == steps
    assert all(s.applied for s in schema.pending(empty_dsn))
    round_trip(empty_dsn)

    rolled = schema.rollback(empty_dsn, count=len(steps))
    assert rolled == steps[::-1]
    assert leftovers(empty_dsn) == []
    assert not any(s.applied for s in schema.pending(empty_dsn))

    assert schema.migrate(empty_dsn) == steps
    round_trip(empty_dsn)


def test_migrate_twice_is_a_no_op(empty_dsn: str) -> None:
    assert schema.migrate(empty_dsn) == all_step_ids()
    before = catalog(empty_dsn)
    assert schema.migrate(empty_dsn) == []
    assert catalog(empty_dsn) == before


def test_rollback_of_the_last_step_only(empty_dsn: str) -> None:
    steps = all_step_ids()
    schema.migrate(empty_dsn)
    assert schema.rollback(empty_dsn) == [steps[-1]]
    assert [s.id for s in schema.pending(empty_dsn) if not s.applied] == [steps[-1]]
    round_trip(empty_dsn)  # the earlier steps still work
    assert schema.migrate(empty_dsn) == [steps[-1]]
    assert all(s.applied for s in schema.pending(empty_dsn))


def test_every_step_rolls_back_on_its_own(empty_dsn: str, dsn: str) -> None:
    steps = all_step_ids()
    schema.migrate(empty_dsn)
    for step in reversed(steps):
        assert schema.rollback(empty_dsn, count=1) == [step]
    assert leftovers(empty_dsn) == []
    assert schema.rollback(empty_dsn, count=1) == []
    # and up again, one step at a time through the same files, ends where a fresh install does
    assert schema.migrate(empty_dsn) == steps
    assert catalog(empty_dsn) == catalog(dsn)


# --------------------------------------------------------------------------------------------
# plain psql, no Python involved
# --------------------------------------------------------------------------------------------

PSQL_SESSION = r"""
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', '42', 'created', '{"total": 42}') RETURNING id AS event_id \gset
SELECT id AS claimed_id, lease_token, subject FROM outbox_claim(10) \gset
SELECT outbox_complete(ARRAY[:claimed_id]::bigint[], :'lease_token') AS done \gset
SELECT :event_id = :claimed_id, :'subject', :done, state FROM outbox WHERE id = :event_id;
"""


def test_psql_only_install_and_session(empty_dsn: str) -> None:
    for path in migration_files():
        run_psql(empty_dsn, "-1", "-f", str(path))
    out = run_psql(empty_dsn, "-At", input=PSQL_SESSION)
    assert out.strip() == "t|outbox.order.created|1|published"
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("SELECT state::text, published_at IS NOT NULL FROM outbox").fetchall() == [("published", True)]
        # no yoyo bookkeeping in a database installed by hand
        assert c.execute("SELECT count(*) FROM pg_class WHERE relname LIKE '%%yoyo%%'").fetchone() == (0,)


def test_psql_rollback_files_undo_the_install(empty_dsn: str) -> None:
    for path in migration_files():
        run_psql(empty_dsn, "-1", "-f", str(path))
    for path in reversed(migration_files()):
        run_psql(empty_dsn, "-1", "-f", str(path.with_name(path.name.removesuffix(".sql") + ".rollback.sql")))
    assert leftovers(empty_dsn) == []


def _cli_sql() -> str:
    console = Path(sys.executable).parent / "outboxpg"
    cmd = [str(console), "sql"] if console.exists() else [sys.executable, "-m", "outboxpg.cli", "sql"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_outboxpg_sql_piped_to_psql_installs_an_equivalent_schema(empty_dsn: str, dsn: str) -> None:
    script = _cli_sql()
    assert script == sql_files.install_sql()
    assert "depends:" not in script
    run_psql(empty_dsn, "-f", "-", input=script)
    installed, migrated = catalog(empty_dsn), catalog(dsn)
    assert installed == migrated, "\n".join(differences(installed, migrated))
    round_trip(empty_dsn)


def test_install_sql_is_all_or_nothing(empty_dsn: str) -> None:
    # a failing step leaves nothing behind: the script is one transaction
    broken = sql_files.install_sql().replace("COMMIT;", "SELECT 1/0;\nCOMMIT;")
    result = subprocess.run([psql(), "-X", "-q", *psql_args(empty_dsn), "-f", "-"], input=broken,
                            capture_output=True, text=True, env=psql_env(empty_dsn), timeout=60)
    assert result.returncode != 0 and "division by zero" in result.stderr
    assert leftovers(empty_dsn) == []


def test_install_into_another_schema(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA obx")
    run_psql(empty_dsn, "-c", "SET search_path = obx", "-f", "-", input=sql_files.install_sql())
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        assert c.execute("SELECT to_regclass('public.outbox')").fetchone() == (None,)
        # used from a session whose search_path does not include obx
        (i,) = c.execute("INSERT INTO obx.outbox (aggregate_type, aggregate_id, event_type, payload) "
                         "VALUES ('order', '1', 'created', '{}') RETURNING id").fetchone()  # type: ignore[misc]
        rows = c.execute("SELECT id, lease_token FROM obx.outbox_claim(5)").fetchall()
        assert [r[0] for r in rows] == [i]
        assert c.execute("SELECT obx.outbox_complete(ARRAY[%s]::bigint[], %s)", (i, rows[0][1])).fetchone() == (1,)
        c.execute("UPDATE obx.outbox_settings SET partitions_ahead = 5")
        created = c.execute("SELECT partition FROM obx.outbox_maintain() WHERE action = 'create'").fetchall()
        assert len(created) == 2
        assert c.execute("SELECT count(*) FROM pg_class WHERE relname LIKE 'outbox_p%%' AND relkind = 'r' "
                         "AND relnamespace = 'obx'::regnamespace").fetchone() == (6,)
