"""The transactional inbox (schema/inbox/, outboxpg.inbox): installed alone into an empty database,
first receive true and a repeat false, a concurrent duplicate that waits for the first transaction
(threads on real connections), a duplicate across a slot boundary, retention by dropping partitions,
and the consumer role's privileges."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from helpers import psql_args, psql_env, wait_until
from roles import login_roles

from outboxpg import catalog, inbox, schema, sql_files
from outboxpg.inbox import InboxNotInstalled

ROOT = sql_files.schema_dir().resolve().parent


@pytest.fixture
def inbox_dsn(empty_dsn: str) -> str:
    """An empty database (no outbox) with the inbox installed by yoyo."""
    assert schema.migrate_inbox(empty_dsn) == [sql_files.INBOX_FIRST_STEP]
    return empty_dsn


@pytest.fixture
def iconn(inbox_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(inbox_dsn, autocommit=True) as c:
        yield c


def _slot_left(c: psycopg.Connection[Any]) -> float:
    """Seconds until the next slot boundary."""
    return c.execute("SELECT extract(epoch FROM date_bin(retention, clock_timestamp(), '2000-01-01 00:00+00') "
                     "+ retention - clock_timestamp())::float8 FROM outbox_inbox_settings").fetchone()[0]


def _set_retention(c: psycopg.Connection[Any], value: str) -> None:
    c.execute("UPDATE outbox_inbox_settings SET retention = %s", (value,))


def test_the_step_is_what_schema_inbox_gives() -> None:
    upgrade, rollback = sql_files.inbox_first_step()
    base = sql_files.inbox_migrations_dir() / sql_files.INBOX_FIRST_STEP
    assert base.with_suffix(".sql").read_text(encoding="utf-8") == upgrade, "run python tools/inbox_step.py"
    assert base.with_name(base.name + ".rollback.sql").read_text(encoding="utf-8") == rollback


def test_installs_alone_first_true_then_false(iconn: psycopg.Connection[Any]) -> None:
    assert iconn.execute("SELECT to_regclass('outbox') IS NULL").fetchone()[0], "no outbox in this database"
    with iconn.transaction():
        assert inbox.receive(iconn, "billing", "m-1") is True
    with iconn.transaction():
        assert inbox.receive(iconn, "billing", "m-1") is False
        assert inbox.receive(iconn, "shipping", "m-1") is True      # each consumer its own
    # A receive in a transaction that rolls back is forgotten with it.
    with pytest.raises(RuntimeError), iconn.transaction():
        assert inbox.receive(iconn, "billing", "m-2") is True
        raise RuntimeError("the side effect failed")
    with iconn.transaction():
        assert inbox.receive(iconn, "billing", "m-2") is True


async def test_async_connection(inbox_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(inbox_dsn) as aconn:
        assert await inbox.receive(aconn, "billing", "a-1") is True
        assert await inbox.receive(aconn, "billing", "a-1") is False
        await aconn.commit()


def test_not_installed_says_so(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as c, pytest.raises(InboxNotInstalled, match="outboxpg migrate --inbox"):
        inbox.receive(c, "billing", "m-1")


def _receive_in_thread(dsn: str, msg_id: str) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    ready = threading.Event()

    def run() -> None:
        with psycopg.connect(dsn) as c:
            out["pid"] = c.info.backend_pid
            ready.set()
            out["answer"] = inbox.receive(c, "billing", msg_id)
            c.commit()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10)
    return t, out


def _waits_on_a_lock(c: psycopg.Connection[Any], pid: int) -> bool:
    return c.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
def test_a_concurrent_duplicate_waits_for_the_first(inbox_dsn: str, iconn: psycopg.Connection[Any],
                                                    first_ends: str) -> None:
    with psycopg.connect(inbox_dsn) as first:
        assert inbox.receive(first, "billing", "race-1") is True      # held open
        t, out = _receive_in_thread(inbox_dsn, "race-1")
        wait_until(lambda: _waits_on_a_lock(iconn, out["pid"]), message="the duplicate waits")
        time.sleep(0.2)
        assert "answer" not in out and t.is_alive()
        getattr(first, first_ends)()
    t.join(10)
    assert out["answer"] is (first_ends == "rollback")
    rows = iconn.execute("SELECT count(*) FROM outbox_inbox WHERE msg_id = 'race-1'").fetchone()[0]
    assert rows == 2                                                   # one receive's two rows


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
def test_a_duplicate_across_the_slot_boundary(inbox_dsn: str, iconn: psycopg.Connection[Any],
                                              first_ends: str) -> None:
    """The first copy is received just before a slot boundary and held open; its duplicate arrives
    just after it (the next slot): it waits, then answers as in the same slot."""
    _set_retention(iconn, "3 seconds")
    iconn.execute("SELECT outbox_inbox_maintain()")
    while _slot_left(iconn) < 1.0:
        time.sleep(0.05)
    time.sleep(max(0.0, _slot_left(iconn) - 0.4))
    with psycopg.connect(inbox_dsn) as first:
        assert inbox.receive(first, "billing", "edge-1") is True
        time.sleep(_slot_left(iconn) + 0.1)                            # the next slot
        t, out = _receive_in_thread(inbox_dsn, "edge-1")
        wait_until(lambda: _waits_on_a_lock(iconn, out["pid"]), message="the duplicate waits")
        getattr(first, first_ends)()
    t.join(10)
    assert out["answer"] is (first_ends == "rollback")
    buckets = iconn.execute("SELECT DISTINCT bucket FROM outbox_inbox WHERE msg_id = 'edge-1'").fetchall()
    assert len(buckets) == (3 if first_ends == "commit" else 2)       # the two receives were in two slots
    # A later duplicate, in the next slot too, committed first copy or not: false.
    with iconn.transaction():
        assert inbox.receive(iconn, "billing", "edge-1") is False


def test_retention_drops_whole_partitions(iconn: psycopg.Connection[Any]) -> None:
    """An id is remembered in its slot and the next one; once the slot after those begins,
    outbox_inbox_maintain drops the partitions and the id is forgotten."""
    for (name,) in iconn.execute("SELECT quote_ident(partition) FROM outbox_inbox_partitions WHERE NOT is_default").fetchall():
        iconn.execute(f"DROP TABLE {name}")        # slots of 7 days would hold those of 1 second
    _set_retention(iconn, "1 second")
    while _slot_left(iconn) < 0.5:
        time.sleep(0.05)
    created = iconn.execute("SELECT action, partition FROM outbox_inbox_maintain()").fetchall()
    assert [a for a, _ in created] and {a for a, _ in created} <= {"create", "drop"}
    assert inbox.receive(iconn, "billing", "old-1") is True
    homes = {r[0] for r in iconn.execute("SELECT tableoid::regclass::text FROM outbox_inbox WHERE msg_id = 'old-1'")}
    assert len(homes) == 2 and "outbox_inbox_default" not in homes
    time.sleep(_slot_left(iconn) + 0.05)                               # the next slot: still remembered
    assert inbox.receive(iconn, "billing", "old-1") is False
    time.sleep(_slot_left(iconn) + 1.05)                               # two slots on
    dry = iconn.execute("SELECT action, partition FROM outbox_inbox_maintain(true) WHERE action = 'drop'").fetchall()
    homes = {h.strip('"') for h in homes}
    assert homes <= {p for _, p in dry}
    done = iconn.execute("SELECT action, partition FROM outbox_inbox_maintain() WHERE action = 'drop'").fetchall()
    assert {p for _, p in done} == {p for _, p in dry}
    left = {r[0] for r in iconn.execute("SELECT partition FROM outbox_inbox_partitions")}
    assert not homes & left
    assert iconn.execute("SELECT count(*) FROM outbox_inbox WHERE msg_id = 'old-1'").fetchone()[0] <= 2
    assert inbox.receive(iconn, "billing", "old-1") is True            # forgotten, as designed


def test_rows_in_the_default_partition_move_to_their_own(iconn: psycopg.Connection[Any]) -> None:
    iconn.execute("DROP TABLE " + iconn.execute(
        "SELECT quote_ident(partition) FROM outbox_inbox_partitions WHERE NOT is_default AND range_start <= now() "
        "AND range_end > now()").fetchone()[0])
    assert inbox.receive(iconn, "billing", "d-1") is True
    assert iconn.execute("SELECT count(*) FROM outbox_inbox_default").fetchone()[0] == 1
    moved = iconn.execute("SELECT detail FROM outbox_inbox_maintain() WHERE action = 'create'").fetchall()
    assert moved == [("moved 1 rows from outbox_inbox_default",)]
    assert iconn.execute("SELECT count(*) FROM outbox_inbox_default").fetchone()[0] == 0
    assert inbox.receive(iconn, "billing", "d-1") is False


def test_a_consumer_may_receive_and_maintain_but_not_drop(inbox_dsn: str) -> None:
    with login_roles(inbox_dsn, consumer="outbox_consumer", stranger=None) as logins:
        with logins["consumer"].connect() as c:
            with c.transaction():
                assert inbox.receive(c, "billing", "p-1") is True
                assert inbox.receive(c, "billing", "p-1") is False
            assert c.execute("SELECT count(*) FROM outbox_inbox_maintain()").fetchone()[0] >= 0
            assert c.execute("SELECT count(*) FROM outbox_inbox_partitions").fetchone()[0] >= 3
            partition = c.execute("SELECT quote_ident(partition) FROM outbox_inbox_partitions WHERE NOT is_default "
                                  "LIMIT 1").fetchone()[0]
            for stmt in (f"DROP TABLE {partition}", "DROP TABLE outbox_inbox_default",
                         f"ALTER TABLE outbox_inbox DETACH PARTITION {partition}",
                         "TRUNCATE outbox_inbox", "DELETE FROM outbox_inbox", "SELECT * FROM outbox_inbox",
                         "UPDATE outbox_inbox SET msg_id = 'x'", "UPDATE outbox_inbox_settings SET retention = '1s'",
                         "INSERT INTO outbox_inbox (consumer, msg_id, bucket, received_at) VALUES ('a', 'b', now(), now())"):
                with pytest.raises((psycopg.errors.InsufficientPrivilege, psycopg.errors.WrongObjectType)):
                    c.execute(stmt)
        with logins["stranger"].connect() as c, pytest.raises(psycopg.errors.InsufficientPrivilege):
            inbox.receive(c, "billing", "p-2")


def _outboxpg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outboxpg.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_migrate_inbox_then_psql_install_is_the_same(empty_dsn: str, second_empty_dsn: str) -> None:
    r = _outboxpg("migrate", "--inbox", "--dsn", empty_dsn)
    assert (r.returncode, r.stdout) == (0, f"applied {sql_files.INBOX_FIRST_STEP}\n"), r.stderr
    assert _outboxpg("migrate", "--inbox", "--dsn", empty_dsn).stdout == "inbox is up to date\n"
    assert _outboxpg("migrate", "--inbox", "--status", "--dsn", empty_dsn).stdout == \
        f"applied  {sql_files.INBOX_FIRST_STEP}\n"
    script = _outboxpg("sql", "--inbox").stdout
    assert script == sql_files.inbox_install_sql() and "outbox_inbox_receive" in script
    psql = shutil.which("psql")
    if psql is None:
        pytest.skip("psql (the PostgreSQL client) is not installed on this machine")
    p = subprocess.run([psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", *psql_args(second_empty_dsn), "-f", "-"],
                       input=script, capture_output=True, text=True, env=psql_env(second_empty_dsn), timeout=60)
    assert p.returncode == 0, p.stderr
    with psycopg.connect(empty_dsn) as a, psycopg.connect(second_empty_dsn) as b:
        migrated, installed = catalog.fingerprint(a, "public"), catalog.fingerprint(b, "public")
    assert {k for k in migrated if "inbox" in k} and {k: v for k, v in migrated.items() if "yoyo" not in k} == installed
    with psycopg.connect(second_empty_dsn) as c:
        assert inbox.receive(c, "billing", "m-1") is True


def test_beside_the_outbox_and_rolled_back(dsn: str) -> None:
    """In a database with the outbox: its own steps, which the outbox's migrate leaves alone."""
    assert schema.migrate_inbox(dsn) == [sql_files.INBOX_FIRST_STEP]
    assert schema.migrate(dsn) == []
    assert schema.to_roll_back(schema._recorded(dsn), 1) != [sql_files.INBOX_FIRST_STEP]
    assert schema.rollback_inbox(dsn) == [sql_files.INBOX_FIRST_STEP]
    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT count(*) FROM pg_class WHERE relname LIKE 'outbox\\_inbox%'").fetchone()[0] == 0
        assert c.execute("SELECT to_regclass('outbox') IS NOT NULL").fetchone()[0]
    assert schema.migrate_inbox(dsn) == [sql_files.INBOX_FIRST_STEP]
