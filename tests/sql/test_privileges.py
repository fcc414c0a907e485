"""Least privilege (migrations/0012_outbox_privileges.sql): the outbox_producer, outbox_worker and
outbox_operator group roles, exercised by login roles of their own against a real PostgreSQL.

Roles belong to the cluster, not to a test database: every login role made here has a unique
name and is dropped at the end of its test. The three group roles are made by the migration
(once per cluster) and stay, shared by the template and every cloned test database.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import Listener, allow_subjects, claim, complete, fail, psql_args, psql_env, release
from jetstream import make_stream, read_stream
from psycopg import sql
from psycopg.conninfo import make_conninfo
from roles import Denied, Login, denied, login_roles

from outboxpg import Event, enqueue, enqueue_many, schema, sql_api, sql_files
from outboxpg.embedded import EmbeddedPostgres
from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import FunctionPublisher
from outboxpg.relay.worker import Worker, WorkerConfig

GROUPS = ("outbox_producer", "outbox_worker", "outbox_operator")

# Who may EXECUTE each outbox function, and which run as their owner (SECURITY DEFINER): the
# one list of the SQL API, outboxpg/sql_api.py (tests/sql/test_sql_api.py checks that it lists every
# function of the schema). A later migration that adds a function has to decide there who may
# call it (functions are PUBLIC by default).
EXECUTE = {f.signature: set(f.callers) for f in sql_api.FUNCTIONS if not f.trigger}
# Trigger functions: they fire as the inserting producer without any EXECUTE grant, and cannot be
# called directly (so PUBLIC's EXECUTE on one that a later step created means nothing).
TRIGGER_FUNCTIONS = {f.signature for f in sql_api.FUNCTIONS if f.trigger}
# The functions that run as their owner (they read or write the tables for their caller).
SECURITY_DEFINER = {f.signature for f in sql_api.FUNCTIONS if f.definer}
# Who may read each view.
VIEWS = {"outbox_stats": {"outbox_operator"}, "outbox_dead_letters": {"outbox_operator"},
         "outbox_failing": {"outbox_operator"},
         "outbox_partitions": {"outbox_operator"}, "outbox_health": {"outbox_worker", "outbox_operator"}}
OUTBOX_COLUMNS = {"id", "created_at", "aggregate_type", "aggregate_id", "event_type", "payload", "headers", "subject",
                  "msg_id", "state", "attempts", "next_attempt_at", "locked_by", "claimed_at", "locked_until",
                  "lease_token", "last_error", "published_at", "dead_at", "discarded_at", "discard_reason",
                  "in_flow", "unfinished", "deliver_at", "idempotency_key", "expires_at", "produced_by", "size_bytes",
                  "replay_of"}


# --------------------------------------------------------------------------------------------
# as the logins (tests/roles.py; the `logins` fixture is in conftest.py)
# --------------------------------------------------------------------------------------------

def insert(c: psycopg.Connection[Any], aggregate_id: str, event_type: str = "created") -> int:
    (i,) = c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                     "VALUES ('order', %s, %s, '{}') RETURNING id", (aggregate_id, event_type)).fetchone()
    return int(i)


# --------------------------------------------------------------------------------------------
# the install
# --------------------------------------------------------------------------------------------

def test_group_roles_and_who_may_execute_what(conn: psycopg.Connection[Any]) -> None:
    roles = conn.execute("SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls "
                         "FROM pg_roles WHERE rolname = ANY(%s) ORDER BY 1", (list(GROUPS),)).fetchall()
    assert roles == [(r, False, False, False, False, False) for r in sorted(GROUPS)]

    every = {sig: (secdef, config, public, trigger) for sig, secdef, config, public, trigger in conn.execute(
        """SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig,
                  EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                           WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'),
                  p.prorettype = 'trigger'::regtype
             FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace""").fetchall()}
    triggers = {sig: v for sig, v in every.items() if v[3]}
    functions = {sig: v for sig, v in every.items() if not v[3]}
    assert set(functions) == set(EXECUTE), "every outbox function needs a decision about who may call it"
    assert set(triggers) <= TRIGGER_FUNCTIONS and "outbox_wake_workers()" in triggers
    assert [sig for sig, (_, _, public, _) in functions.items() if public] == []
    for sig, allowed in EXECUTE.items():
        may = {r for r in GROUPS
               if conn.execute("SELECT has_function_privilege(%s, %s::regprocedure, 'EXECUTE')", (r, sig)).fetchone()[0]}
        assert may == allowed, sig

    # SECURITY DEFINER exactly where needed, each with search_path pinned to the schema, pg_temp last.
    assert {sig for sig, (secdef, _, _, _) in every.items() if secdef} == SECURITY_DEFINER
    for sig in SECURITY_DEFINER:
        assert "search_path=public, pg_temp" in every[sig][1], sig
    # The trigger functions run as the inserting producer; they are pinned as well.
    for sig, (_, config, _, _) in triggers.items():
        assert "search_path=public, pg_temp" in config, sig


def test_table_and_view_privileges(conn: psycopg.Connection[Any]) -> None:
    def may(role: str, obj: str, priv: str) -> bool:
        return bool(conn.execute("SELECT has_table_privilege(%s, %s, %s)", (role, obj, priv)).fetchone()[0])

    def columns(role: str, table: str, priv: str) -> set[str]:
        return {r[0] for r in conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
            "AND has_column_privilege(%s, attrelid, attnum, %s)", (table, role, priv)).fetchall()}

    assert columns("outbox_producer", "outbox", "INSERT") == {
        "aggregate_type", "aggregate_id", "event_type", "payload", "subject", "headers", "msg_id", "deliver_at", "idempotency_key", "expires_at"}
    assert columns("outbox_producer", "outbox", "SELECT") == {"id"}
    assert columns("outbox_worker", "outbox", "SELECT") == set()
    assert columns("outbox_operator", "outbox", "SELECT") == OUTBOX_COLUMNS - {"payload", "headers", "lease_token"}
    assert conn.execute("SELECT has_column_privilege('outbox_operator', 'outbox', 'tableoid', 'SELECT')").fetchone() == (True,)
    assert columns("outbox_producer", "outbox", "SELECT") | columns("outbox_producer", "outbox", "INSERT") \
        | columns("outbox_operator", "outbox", "SELECT") == OUTBOX_COLUMNS - {"lease_token"}   # the list is complete
    assert columns("outbox_worker", "outbox_settings", "SELECT") == {"subject_prefix", "backoff_cap",
                                                                     "allowed_subject_prefixes"}
    assert may("outbox_producer", "outbox_settings", "SELECT")          # the commit-order trigger reads it
    for role in GROUPS:
        for priv in ("UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER"):
            assert not may(role, "outbox", priv), (role, priv)
            assert not may(role, "outbox_settings", priv), (role, priv)
        assert not may(role, "outbox_default", "SELECT") and not may(role, "outbox_default", "INSERT")
    for view, readers in VIEWS.items():
        assert {r for r in GROUPS if may(r, view, "SELECT")} == readers, view
    assert may("outbox_operator", "outbox_settings", "SELECT")
    assert conn.execute("SELECT has_sequence_privilege('outbox_producer', 'outbox_id_seq', 'USAGE, SELECT'), "
                        "has_sequence_privilege('outbox_producer', 'outbox_id_seq', 'UPDATE')").fetchone() == (True, False)
    for role in ("outbox_worker", "outbox_operator"):
        assert conn.execute("SELECT has_sequence_privilege(%s, 'outbox_id_seq', 'USAGE, SELECT, UPDATE')",
                            (role,)).fetchone() == (False,)


# --------------------------------------------------------------------------------------------
# producer
# --------------------------------------------------------------------------------------------

def test_producer_may_insert_and_nothing_else(logins: dict[str, Login], conn: psycopg.Connection[Any]) -> None:
    allow_subjects(conn, "custom")
    with logins["producer"].connect() as p, Listener(logins["worker"].dsn) as listener, \
            logins["worker"].connect() as idle:
        first = insert(p, "1")
        second = enqueue(p, "order", "2", "paid", {"amount": 42}, subject="custom.subject",
                         headers={"Trace": "t-1"}, msg_id="m-2")
        with p.transaction():
            n = enqueue_many(p, [Event("order", "3", "created", {"i": 3}),
                                 Event("order", "4", "created", {"i": 4}, headers={"H": "v"}, msg_id="m-4")])
        assert n == 2
        # The insert trigger (running as the producer) wakes an idle worker.
        assert listener.collect() == []
        idle.execute("SELECT outbox_worker_idle()")
        insert(p, "5")
        assert listener.collect() == [""]
        assert idle.execute("SELECT outbox_worker_busy()").fetchone() == (True,)

        denied(p,
               "SELECT * FROM outbox",
               "SELECT payload FROM outbox",
               "SELECT id FROM outbox WHERE state = 'pending'",
               "SELECT * FROM outbox_default",
               "UPDATE outbox SET state = 'published'",
               "DELETE FROM outbox",
               "TRUNCATE outbox",
               # the columns that only the functions set
               "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, state) "
               "VALUES ('order', '9', 'created', '{}', 'published')",
               "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, attempts, next_attempt_at) "
               "VALUES ('order', '9', 'created', '{}', 99, now() + interval '1 year')",
               "INSERT INTO outbox_default (aggregate_type, aggregate_id, event_type, payload) "
               "VALUES ('order', '9', 'created', '{}')",
               "COPY outbox TO STDOUT",
               "SELECT * FROM outbox_claim(10)",
               "SELECT outbox_complete(ARRAY[1]::bigint[], gen_random_uuid())",
               "SELECT outbox_worker_idle()",
               "SELECT outbox_requeue(ARRAY[1]::bigint[])",
               "SELECT * FROM outbox_maintain()",
               "SELECT outbox_next_wakeup()",
               "SELECT outbox_retry_delay(1, '1 second', '1 minute')",
               "SELECT * FROM outbox_stats",
               "SELECT * FROM outbox_health",
               "UPDATE outbox_settings SET max_attempts = 1",
               "SELECT setval('outbox_id_seq', 1)")
        with pytest.raises(Denied):
            with p.cursor() as cur, cur.copy("COPY outbox (aggregate_type, aggregate_id, event_type, payload, state) "
                                             "FROM STDIN") as copy:
                copy.write_row(("order", "9", "created", "{}", "published"))
        # The id column is the one thing a producer can read back (for INSERT ... RETURNING id).
        assert p.execute("SELECT count(*) FROM outbox").fetchone() == (5,)

    rows = conn.execute("SELECT aggregate_id, state::text, subject, headers, msg_id IS NOT NULL FROM outbox "
                        "ORDER BY id").fetchall()
    assert rows == [("1", "pending", None, {}, True), ("2", "pending", "custom.subject", {"Trace": "t-1"}, True),
                    ("3", "pending", None, {}, True), ("4", "pending", None, {"H": "v"}, True),
                    ("5", "pending", None, {}, True)]
    assert conn.execute("SELECT msg_id FROM outbox WHERE id = %s", (second,)).fetchone() == ("m-2",)
    assert first < second


async def test_producer_async_enqueue(logins: dict[str, Login], conn: psycopg.Connection[Any]) -> None:
    async with await psycopg.AsyncConnection.connect(logins["producer"].dsn) as p:
        async with p.transaction():
            i = await enqueue(p, "order", "a", "created", {"x": 1})
            assert await enqueue_many(p, [Event("order", "b", "created", {})]) == 1
    assert conn.execute("SELECT count(*) FROM outbox WHERE id >= %s", (i,)).fetchone() == (2,)


# --------------------------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------------------------

def test_worker_runs_the_whole_cycle_through_the_functions_only(logins: dict[str, Login],
                                                                 conn: psycopg.Connection[Any]) -> None:
    ids = [insert(conn, str(i)) for i in range(5)]
    conn.execute("UPDATE outbox_settings SET partitions_ahead = 4")   # so that maintenance has work
    with logins["worker"].connect() as w:
        w.execute("LISTEN outbox")
        assert w.execute("SELECT subject_prefix, backoff_cap FROM outbox_settings").fetchone() == (
            "outbox", timedelta(minutes=5))
        rows = claim(w, 10, "30 seconds", "w1")
        assert [r["id"] for r in rows] == ids
        assert {r["subject"] for r in rows} == {"outbox.order.created"}
        token = rows[0]["lease_token"]
        assert complete(w, ids[:2], token) == 2
        assert fail(w, ids[2], token, "broker said no") == "pending"
        assert fail(w, ids[3], token, "never publishable", permanent=True) == "dead"
        assert release(w, [ids[4]], token) == 1
        assert complete(w, [ids[2]], token) == 0          # fencing still holds
        # ids[4], released, is due again: "claim now" (a time in the past), not NULL
        assert w.execute("SELECT outbox_next_wakeup() <= clock_timestamp()").fetchone() == (True,)
        w.execute("SELECT outbox_worker_idle()")
        assert w.execute("SELECT outbox_worker_busy()").fetchone() == (True,)
        assert w.execute("SELECT action FROM outbox_maintain()").fetchall() == [("create",)]
        assert w.execute("SELECT action FROM outbox_maintain(true)").fetchall() == []

        # its metrics: counts and ages, no event data
        assert w.execute("SELECT backlog, dead FROM outbox_health").fetchone() == (2, 1)
        partition = conn.execute("SELECT partition FROM outbox_partitions WHERE NOT is_default LIMIT 1").fetchone()[0]
        denied(w,
               "SELECT * FROM outbox",
               "SELECT id FROM outbox",
               "SELECT count(*) FROM outbox",
               f'SELECT * FROM "{partition}"',
               "SELECT * FROM outbox_default",
               "DELETE FROM outbox",
               "UPDATE outbox SET state = 'pending'",
               "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', '1', 'e', '{}')",
               "TRUNCATE outbox",
               "COPY outbox TO STDOUT",
               f"SELECT outbox_requeue(ARRAY[{ids[3]}]::bigint[])",
               f"SELECT outbox_discard(ARRAY[{ids[3]}]::bigint[], 'no')",
               "SELECT outbox_retry_delay(1, '1 second', '1 minute')",
               "SELECT * FROM outbox_settings",
               "SELECT max_attempts FROM outbox_settings",
               "UPDATE outbox_settings SET max_attempts = 1",
               "SELECT * FROM outbox_stats",
               "SELECT * FROM outbox_dead_letters",
               "SELECT * FROM outbox_partitions")
    got = conn.execute("SELECT state::text, attempts, last_error FROM outbox ORDER BY id").fetchall()
    assert got == [("published", 1, None), ("published", 1, None), ("pending", 1, "broker said no"),
                   ("dead", 1, "never publishable"), ("pending", 0, None)]


async def test_the_real_worker_delivers_as_a_worker_login(logins: dict[str, Login], conn: psycopg.Connection[Any],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="outboxpg.worker")
    conn.execute("UPDATE outbox_settings SET partitions_ahead = 4")   # so that maintenance has work
    with logins["producer"].connect() as p:
        with p.transaction():
            enqueue_many(p, [Event("order", str(i % 10), "updated", {"i": i}) for i in range(200)])
    seen: list[tuple[str, int]] = []

    async def publish(event: OutboxEvent) -> None:
        seen.append((event.aggregate_id, event.id))

    worker = Worker(WorkerConfig(dsn=logins["worker"].dsn, batch_size=20, concurrency=2, publish_timeout=2,
                                 lease=10, poll_interval=60), FunctionPublisher(publish))
    task = asyncio.create_task(worker.run())
    try:
        await _until(lambda: _published(conn) == 200, 30, "200 events delivered")
        # Idle (wakeup lock held, LISTENing): a producer's insert wakes it through the trigger.
        await _until(lambda: worker.idle_lock.held and worker.listener.up, 10, "worker idle")
        t0 = time.monotonic()
        with logins["producer"].connect() as p:
            enqueue(p, "order", "late", "created", {})
        await _until(lambda: _published(conn) == 201, 5, "the late event delivered")
        assert time.monotonic() - t0 < 2, "woken by NOTIFY, not by the 60 s poll"
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
    assert worker.stats.delivered == 201
    for agg in {a for a, _ in seen}:
        ids = [i for a, i in seen if a == agg]
        assert ids == sorted(ids), f"aggregate {agg} out of order"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "event=maintenance action=create" in text, text   # outbox_maintain() ran at start
    for problem in ("permission denied", "db_error", "maintenance_failed", "idle_lock_failed", "listen_lost"):
        assert problem not in text, text


async def test_the_worker_cli_with_nats_runs_as_a_worker_login(logins: dict[str, Login], conn: psycopg.Connection[Any],
                                                             nats_server: Any, tmp_path: Path) -> None:
    """The command line: schema check, settings read for the stream check, NATS, maintenance."""
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s, partitions_ahead = 4", (stream.prefix,))
    with logins["producer"].connect() as p:
        enqueue_many(p, [Event("order", str(i % 20), "updated", {"i": i}) for i in range(300)])
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "outboxpg-worker"), "--dsn", logins["worker"].dsn,
         "--nats-url", nats_server.url, "--name", "least-privileged", "--lease", "3", "--publish-timeout", "1",
         "--log-level", "DEBUG"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:
        deadline = time.monotonic() + 60
        # Delivery may end before the maintenance task that starts beside it: wait for both.
        while _published(conn) < 300 or "event=maintenance" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert rc == 0, text
    for problem in ("permission denied", "db_error", "maintenance_failed", "stream_check", "Traceback"):
        assert problem not in text, text
    assert "event=maintenance action=create" in text, text   # outbox_maintain() ran at start
    msgs = await read_stream(stream)
    await stream.nc.close()
    assert len(msgs) == 300


def test_metrics_database_gauges_as_a_worker_login(logins: dict[str, Login], conn: psycopg.Connection[Any]) -> None:
    from outboxpg.relay.metrics import WorkerMetrics

    insert(conn, "1")
    metrics = WorkerMetrics(logins["worker"].dsn, sample_every=0.0)
    # What it could read instead (granted to outbox_worker): the same three figures.
    with logins["worker"].connect() as w:
        assert w.execute("SELECT backlog, dead, oldest_pending_age IS NOT NULL FROM outbox_health").fetchone() == (
            1, 0, True)
    assert metrics.registry.get_sample_value("outboxpg_backlog_events") == 1.0


def test_worker_and_operator_see_what_a_producers_open_transaction_holds_back(logins: dict[str, Login],
                                                                              conn: psycopg.Connection[Any]) -> None:
    """A producer login's transaction stays open: a worker login and an operator login read which
    backend holds what back (through outbox_health and outbox_open_producers, which run as the
    owner: pg_stat_activity shows other roles' transactions only to privileged roles)."""
    with psycopg.connect(logins["producer"].dsn) as p:       # a transaction, left open
        insert(p, "held")
        pid = p.info.backend_pid
        held = [insert(conn, "held", "paid"), insert(conn, "held", "shipped")]
        free = insert(conn, "free")
        time.sleep(0.1)
        with logins["worker"].connect() as w, logins["operator"].connect() as o:
            assert [r["id"] for r in claim(w, 10)] == [free]
            for c in (w, o):
                assert c.execute("SELECT open_producers, oldest_producer_pid, oldest_producer_age > interval '0', "
                                 "held_by_open_transactions, worker_claimed_last_minute FROM outbox_health"
                                 ).fetchone() == (1, pid, True, 2, True)
                assert c.execute("SELECT pid, state, aggregates, all_newer, held_above < %s FROM outbox_open_producers()",
                                 (held[0],)).fetchall() == [(pid, "idle in transaction", 1, False, True)]
            # sql/health.sql matches the producers' locks with the events by the aggregate's key
            assert o.execute("SELECT outbox_aggregate_key('order', 'held') = hashtext('order/held')").fetchone() == (True,)
            denied(w, "SELECT outbox_aggregate_key('order', 'held')", "SELECT * FROM outbox_commit_guard()")
            denied(o, "SELECT * FROM outbox_commit_guard()")
        p.rollback()
    assert [r["id"] for r in claim(conn, 10)] == held   # one run, in order


# --------------------------------------------------------------------------------------------
# operator
# --------------------------------------------------------------------------------------------

def _dead_event(conn: psycopg.Connection[Any], aggregate_id: str) -> int:
    i = insert(conn, aggregate_id)
    rows = claim(conn, 10)
    for r in rows:
        assert fail(conn, r["id"], r["lease_token"], "broken", permanent=True) == "dead"
    return i


def test_operator_reads_the_views_and_repairs(logins: dict[str, Login], conn: psycopg.Connection[Any]) -> None:
    a, b = _dead_event(conn, "a"), _dead_event(conn, "b")
    with logins["operator"].connect() as o:
        assert o.execute("SELECT dead FROM outbox_stats").fetchone() == (2,)
        assert [r[0] for r in o.execute("SELECT id FROM outbox_dead_letters ORDER BY id")] == [a, b]
        assert o.execute("SELECT count(*) FROM outbox_partitions WHERE NOT is_default").fetchone()[0] >= 1
        assert o.execute("SELECT count(*) FROM outbox_health").fetchone()[0] >= 1
        assert o.execute("SELECT max_attempts, subject_prefix FROM outbox_settings").fetchone() == (10, "outbox")
        # the applied steps, for the command line's schema check (the test database was migrated with yoyo)
        assert o.execute("SELECT count(*) > 0 FROM _yoyo_migration").fetchone() == (True,)
        # the events' metadata, for the inspection queries in sql/; never payloads or headers
        assert o.execute("SELECT id, state::text, last_error FROM outbox ORDER BY id").fetchall() == [
            (a, "dead", "broken"), (b, "dead", "broken")]
        assert o.execute("SELECT outbox_requeue(%s::bigint[])", ([a],)).fetchone() == (1,)
        assert o.execute("SELECT outbox_discard(%s::bigint[], 'superseded')", ([b],)).fetchone() == (1,)
        conn.execute("UPDATE outbox_settings SET partitions_ahead = 4")
        assert o.execute("SELECT action FROM outbox_maintain()").fetchall() == [("create",)]
        denied(o,
               "SELECT * FROM outbox",
               "SELECT payload FROM outbox",
               "SELECT headers FROM outbox",
               "SELECT * FROM outbox_default",
               "COPY outbox TO STDOUT",
               "UPDATE outbox SET state = 'pending'",
               "DELETE FROM outbox",
               "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('o', '1', 'e', '{}')",
               "UPDATE outbox_settings SET max_attempts = 1",
               "SELECT * FROM outbox_claim(10)",
               "SELECT outbox_fail(1, gen_random_uuid(), 'x')",
               "SELECT outbox_worker_idle()",
               "SELECT outbox_next_wakeup()")
    assert conn.execute("SELECT state::text, discard_reason FROM outbox ORDER BY id").fetchall() == [
        ("pending", None), ("discarded", "superseded")]


OUTBOXPG = str(Path(sys.executable).parent / "outboxpg")


def outboxpg_cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([OUTBOXPG, *args, "--dsn", dsn], capture_output=True, text=True, timeout=60)


@pytest.fixture
def operator_cli(logins: dict[str, Login], conn: psycopg.Connection[Any]) -> str:
    """The operator login's DSN, with two dead letters to look at."""
    _dead_event(conn, "a")
    _dead_event(conn, "b")
    return logins["operator"].dsn


def test_operator_command_line(operator_cli: str, conn: psycopg.Connection[Any]) -> None:
    for args in (["status"], ["maintain", "--dry-run"], ["dead", "list"]):
        r = outboxpg_cli(operator_cli, *args)
        assert r.returncode == 0, (args, r.stderr)


@pytest.mark.parametrize("args", [["dead", "show", "ID"], ["dead", "requeue", "ID", "--yes"],
                                  ["dead", "discard", "ID", "--reason", "superseded", "--yes"]],
                         ids=["show", "requeue", "discard"])
def test_operator_command_line_repairs(operator_cli: str, conn: psycopg.Connection[Any], args: list[str]) -> None:
    (first,) = conn.execute("SELECT min(id) FROM outbox WHERE state = 'dead'").fetchone()
    r = outboxpg_cli(operator_cli, *[str(first) if a == "ID" else a for a in args])
    assert r.returncode == 0, r.stderr
    if args[1] != "show":
        assert conn.execute("SELECT state::text FROM outbox WHERE id = %s", (first,)).fetchone() == (
            {"requeue": "pending", "discard": "discarded"}[args[1]],)


# --------------------------------------------------------------------------------------------
# a hostile search_path
# --------------------------------------------------------------------------------------------

DECOYS = """
CREATE TABLE {s}.outbox_settings (singleton boolean, max_attempts integer, backoff_base interval,
    backoff_cap interval, default_lease interval, max_claim_batch integer, partition_width interval,
    partitions_ahead integer, retention interval, maintenance_lock_timeout interval, subject_prefix text,
    commit_order_guard boolean);
INSERT INTO {s}.outbox_settings VALUES (true, 1, '100 years', '100 years', '1 second', 1, '1 hour', 0, '0', '1 second', 'evil',
                                       false);
CREATE TABLE {s}.outbox (id bigint, created_at timestamptz, aggregate_type text, aggregate_id text, event_type text,
    payload jsonb, headers jsonb, subject text, msg_id text, state text, attempts integer, next_attempt_at timestamptz,
    locked_by text, claimed_at timestamptz, locked_until timestamptz, lease_token uuid, last_error text,
    published_at timestamptz, dead_at timestamptz, discarded_at timestamptz, discard_reason text);
INSERT INTO {s}.outbox (id, created_at, aggregate_type, aggregate_id, event_type, payload, headers, subject, msg_id,
                       state, attempts, next_attempt_at)
     VALUES (999999, now(), 'decoy', 'd', 'decoy', '{{}}', '{{}}', 'evil.decoy', 'decoy', 'pending', 0, now()),
            (999998, now(), 'decoy', 'e', 'decoy', '{{}}', '{{}}', 'evil.decoy', 'decoy', 'dead', 9, now());
CREATE TEMP TABLE outbox_settings AS SELECT * FROM {s}.outbox_settings;
CREATE TEMP TABLE outbox AS SELECT * FROM {s}.outbox;
-- functions the outbox functions call, and builtins they rely on
CREATE FUNCTION {s}.outbox_retry_delay(integer, interval, interval) RETURNS interval
    LANGUAGE sql AS $$ SELECT interval '100 years' $$;
CREATE FUNCTION {s}.outbox_commit_horizon() RETURNS bigint LANGUAGE sql AS $$ SELECT 0::bigint $$;
CREATE FUNCTION {s}.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$ SELECT timestamptz '2000-01-01' $$;
CREATE FUNCTION {s}.now() RETURNS timestamptz LANGUAGE sql AS $$ SELECT timestamptz '2000-01-01' $$;
CREATE FUNCTION {s}.gen_random_uuid() RETURNS uuid LANGUAGE sql AS $$ SELECT '00000000-0000-0000-0000-000000000000'::uuid $$;
CREATE FUNCTION {s}.format(text, timestamptz, text) RETURNS text LANGUAGE sql AS $$ SELECT 'evil' $$;
-- operators: every uuid equal (a stale lease token would match), no bigint equal
CREATE FUNCTION {s}.uuid_always(uuid, uuid) RETURNS boolean LANGUAGE sql AS $$ SELECT true $$;
CREATE OPERATOR {s}.= (LEFTARG = uuid, RIGHTARG = uuid, FUNCTION = {s}.uuid_always);
CREATE FUNCTION {s}.int8_never(bigint, bigint) RETURNS boolean LANGUAGE sql AS $$ SELECT false $$;
CREATE OPERATOR {s}.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = {s}.int8_never);
"""


def hostile(admin: psycopg.Connection[Any], login: Login) -> psycopg.Connection[Any]:
    """A session of ``login`` with look-alike tables, a temp table, functions and operators first
    on its search_path (pg_catalog after them, so even builtins would be shadowed)."""
    schema_name = f"evil_{login.name}"
    admin.execute(sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(sql.Identifier(schema_name),
                                                                      sql.Identifier(login.name)))
    c = login.connect()
    for stmt in DECOYS.format(s=schema_name).split(";\n"):
        if stmt.strip():
            c.execute(stmt)
    c.execute(sql.SQL("SET search_path = pg_temp, {}, pg_catalog, public").format(sql.Identifier(schema_name)))
    # the session itself does see the decoys
    assert c.execute("SELECT subject_prefix FROM outbox_settings").fetchone() == ("evil",)
    assert c.execute("SELECT now() = '2000-01-01'").fetchone() == (True,)
    return c


def test_hostile_search_path_cannot_steer_the_worker_functions(logins: dict[str, Login],
                                                               conn: psycopg.Connection[Any]) -> None:
    expired = insert(conn, "x")
    assert [r["id"] for r in claim(conn, 10, "1 millisecond", "gone")] == [expired]
    ids = [insert(conn, str(i)) for i in range(4)]
    with hostile(conn, logins["worker"]) as w:
        t0 = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        rows = claim(w, 10)
        # the expired lease was taken back as a failed attempt, with the real backoff and message
        x = conn.execute("SELECT state::text, attempts, last_error, next_attempt_at - %s FROM outbox WHERE id = %s",
                         (t0, expired)).fetchone()
        assert x[:2] == ("pending", 1) and x[2].startswith("lease expired at ") and x[2].endswith("(held by gone)")
        assert timedelta(seconds=0.4) < x[3] < timedelta(seconds=1.1)
        # the real events, the real subject prefix, the real default lease (30 s), a real token
        assert [r["id"] for r in rows] == ids
        assert {r["subject"] for r in rows} == {"outbox.order.created"}
        assert all(timedelta(seconds=29) < r["locked_until"] - t0 < timedelta(seconds=40) for r in rows)
        token = rows[0]["lease_token"]
        assert str(token) != "00000000-0000-0000-0000-000000000000"
        # fencing: a wrong token matches nothing, even with an always-true uuid '=' on the path
        assert complete(w, ids[:1], uuid.uuid4()) == 0
        assert complete(w, ids[:2], token) == 2          # and bigint '=' is the real one
        # the real max_attempts (10, not 1) and the real backoff (about 1 s, not 100 years)
        assert fail(w, ids[2], token, "boom") == "pending"
        assert release(w, [ids[3]], token) == 1
        wake = w.execute("SELECT outbox_next_wakeup() - pg_catalog.clock_timestamp()").fetchone()[0]
        assert -timedelta(seconds=1) < wake <= timedelta(seconds=1.1)   # ids[3] released: due now
        assert {a for (a,) in w.execute("SELECT action FROM outbox_maintain(true)")} <= {"create", "skip", "keep", "drop"}
        denied(w, "SELECT * FROM public.outbox", "SELECT outbox_requeue(ARRAY[1]::bigint[])")
        # the decoys are untouched
        assert w.execute("SELECT count(*) FROM outbox WHERE state = 'pending' AND lease_token IS NULL").fetchone() == (1,)
        assert w.execute(sql.SQL("SELECT count(*) FROM {}.outbox WHERE state = 'pending' AND lease_token IS NULL").format(
            sql.Identifier(f"evil_{logins['worker'].name}"))).fetchone() == (1,)
    got = conn.execute("SELECT state::text, attempts, next_attempt_at - clock_timestamp() < interval '2 seconds' "
                       "FROM outbox WHERE id = ANY(%s) ORDER BY id", (ids,)).fetchall()
    assert got == [("published", 1, True), ("published", 1, True), ("pending", 1, True), ("pending", 0, True)]


def test_hostile_search_path_cannot_steer_the_operator_functions(logins: dict[str, Login],
                                                                 conn: psycopg.Connection[Any]) -> None:
    a, b = _dead_event(conn, "a"), _dead_event(conn, "b")
    with hostile(conn, logins["operator"]) as o:
        assert o.execute("SELECT outbox_requeue(%s::bigint[])", ([a, 999998],)).fetchone() == (1,)
        assert o.execute("SELECT outbox_discard(%s::bigint[], 'superseded')", ([b, 999999],)).fetchone() == (1,)
        # the views are bound to the real tables when they were created
        assert o.execute("SELECT pending, dead, discarded FROM public.outbox_stats").fetchone() == (1, 0, 1)
        assert o.execute("SELECT count(*) FROM public.outbox_dead_letters").fetchone() == (0,)
        assert o.execute("SELECT state FROM outbox WHERE id = 999998").fetchone() == ("dead",)
    assert conn.execute("SELECT id, state::text, attempts, discard_reason FROM outbox ORDER BY id").fetchall() == [
        (a, "pending", 0, None), (b, "discarded", 1, "superseded")]


def test_hostile_search_path_cannot_steer_the_insert_triggers(logins: dict[str, Login],
                                                              conn: psycopg.Connection[Any]) -> None:
    """The triggers run as the producer: a look-alike outbox_settings (commit_order_guard off)
    must not switch the commit-order guard off, nor stop the wakeup."""
    with hostile(conn, logins["producer"]) as p, Listener(logins["worker"].dsn) as listener, \
            logins["worker"].connect() as idle:
        idle.execute("SELECT outbox_worker_idle()")
        with p.transaction():
            (i,) = p.execute("INSERT INTO public.outbox (aggregate_type, aggregate_id, event_type, payload) "
                             "VALUES ('order', '1', 'created', '{}') RETURNING id").fetchone()
            held = conn.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND granted "
                                "AND objsubid = 1 AND classid >= 2147483648", (p.info.backend_pid,)).fetchone()[0]
            assert held == 1                                       # the transaction's horizon
            named = conn.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND granted "
                                 "AND objsubid = 2 AND classid = 1868724337", (p.info.backend_pid,)).fetchone()[0]
            assert named == 1                                      # its aggregate, by name: the guard is on
        assert listener.collect() == [""]
        idle.execute("SELECT outbox_worker_busy()")
    assert conn.execute("SELECT aggregate_id, state::text FROM outbox WHERE id = %s", (i,)).fetchone() == ("1", "pending")


# --------------------------------------------------------------------------------------------
# installing as a non-superuser owner into a schema of its own
# --------------------------------------------------------------------------------------------

def test_install_by_an_unprivileged_owner_into_its_own_schema(outbox_template: Any, empty_dsn: str) -> None:
    """The recommended setup: the SECURITY DEFINER functions run as an ordinary owner role,
    never as a superuser; applications set search_path to the schema. (outbox_template: the
    group roles exist already, made by a superuser's install, as a DBA would make them.)"""
    with login_roles(empty_dsn, owner=None) as owners:
        owner = owners["owner"]
        with psycopg.connect(empty_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE SCHEMA shop AUTHORIZATION {}").format(sql.Identifier(owner.name)))
        in_shop = " options='-c search_path=shop'"
        assert "0012_outbox_privileges" in schema.migrate(owner.dsn + in_shop)
        with login_roles(empty_dsn, producer="outbox_producer", worker="outbox_worker") as apps, \
                psycopg.connect(owner.dsn + in_shop, autocommit=True) as own:
            assert own.execute("SELECT count(*) FROM pg_proc WHERE prosecdef AND proowner = %s::regrole "
                               "AND proconfig @> ARRAY['search_path=shop, pg_temp']",
                               (owner.name,)).fetchone() == (len(SECURITY_DEFINER),)
            with psycopg.connect(apps["producer"].dsn + in_shop, autocommit=True) as p:
                i = insert(p, "1")
            with psycopg.connect(apps["worker"].dsn + in_shop, autocommit=True) as w:
                rows = claim(w, 10)
                assert [r["id"] for r in rows] == [i]
                assert complete(w, [i], rows[0]["lease_token"]) == 1
                denied(w, "SELECT * FROM shop.outbox")
            assert own.execute("SELECT state::text FROM outbox").fetchall() == [("published",)]
            # USAGE on the schema was granted, the schema being private
            assert own.execute("SELECT has_schema_privilege('outbox_worker', 'shop', 'USAGE'), "
                               "has_schema_privilege('outbox_worker', 'shop', 'CREATE')").fetchone() == (True, False)
        assert roll_back_0012(owner.dsn + in_shop)[-1] == "0012_outbox_privileges"
        with psycopg.connect(owner.dsn + in_shop, autocommit=True) as own:
            assert own.execute("SELECT has_schema_privilege('outbox_worker', 'shop', 'USAGE')").fetchone() == (False,)
            own.execute("DROP SCHEMA shop CASCADE")


def test_upgrade_where_later_steps_came_first(outbox_template: Any, empty_dsn: str) -> None:
    """Release schema-1's steps after 0012 (0013: the commit-order trigger, which runs as the
    producer) can come before 0011 and 0012 in a database migrated step by step by hand; 0012
    applied last must leave producers and workers working just the same, and the later releases
    apply on top."""
    files = {p.name.removesuffix(".sql"): p for p in sql_files.migrations_dir().glob("[0-9]*.sql")
             if not p.name.endswith(".rollback.sql")}
    first = {f.removesuffix(".sql") for f in sql_files.releases()[0].files if not f.endswith(".rollback.sql")}
    later = sorted(k for k in first if k > "0012_outbox_privileges")
    assert later, "0013 (the commit-order trigger) comes after 0012"
    order = ([k for k in sorted(first) if k < "0011"] + later + ["0011_outbox_health", "0012_outbox_privileges"]
             + sorted(k for k in files if k not in first))
    with psycopg.connect(empty_dsn, autocommit=True) as admin:
        for step in order:
            with admin.transaction():
                admin.execute(files[step].read_text())
    with login_roles(empty_dsn, producer="outbox_producer", worker="outbox_worker") as apps:
        with apps["producer"].connect() as p:
            i = insert(p, "1")
            with p.transaction():
                enqueue_many(p, [Event("order", "2", "created", {})])
        with apps["worker"].connect() as w:
            rows = claim(w, 10)
            assert len(rows) == 2 and rows[0]["id"] == i
            assert complete(w, [r["id"] for r in rows], rows[0]["lease_token"]) == 2
            denied(w, "SELECT * FROM outbox")


def test_install_refuses_when_a_login_may_create_in_the_schema(outbox_template: Any, empty_dsn: str) -> None:
    """Whoever may CREATE in the install schema could plant an overload the SECURITY DEFINER
    functions would pick up: the install refuses, naming that login and the REVOKE to run."""
    with login_roles(empty_dsn, app="outbox_producer") as apps, \
            psycopg.connect(empty_dsn, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA writable")
        admin.execute(sql.SQL("GRANT CREATE ON SCHEMA writable TO {}").format(sql.Identifier(apps["app"].name)))
        result = subprocess.run(["psql", "-X", "-v", "ON_ERROR_STOP=1", *psql_args(empty_dsn),
                                 "-c", "SET search_path = writable", "-f", "-"],
                                input=sql_files.install_sql(), capture_output=True, text=True,
                                env=psql_env(empty_dsn), timeout=120)
        assert result.returncode != 0, result.stderr
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line or "HINT" in line]
        assert errors and apps["app"].name in errors[0] and "may CREATE in schema writable" in errors[0], errors
        assert any(f"REVOKE CREATE ON SCHEMA writable FROM {apps['app'].name}" in e for e in errors), errors
        assert admin.execute("SELECT to_regclass('writable.outbox')").fetchone() == (None,)
        admin.execute("DROP SCHEMA writable CASCADE")


# --------------------------------------------------------------------------------------------
# roles across databases: a private cluster, where the group roles do not exist yet
# --------------------------------------------------------------------------------------------

def roll_back_0012(dsn: str) -> list[str]:
    """Roll back 0012 and the steps applied after it; returns their ids, 0012 last."""
    applied = [s.id for s in schema.pending(dsn) if s.applied]
    return schema.rollback(dsn, count=len(applied) - applied.index("0012_outbox_privileges"))


def _group_roles(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as c:
        return [r[0] for r in c.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s) ORDER BY 1",
                                        (list(GROUPS),))]


def test_rollback_drops_the_roles_only_when_nothing_uses_them() -> None:
    try:
        pg = EmbeddedPostgres()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    with pg:
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("CREATE DATABASE one")
            admin.execute("CREATE DATABASE two")
        one, two = pg.dsn_for("one"), pg.dsn_for("two")
        assert _group_roles(pg.dsn) == []
        # An installing role that may not create roles is told what a DBA has to do.
        with psycopg.connect(pg.dsn_for("one"), autocommit=True) as admin:
            admin.execute("CREATE ROLE plain_owner LOGIN")
            admin.execute("CREATE SCHEMA plain AUTHORIZATION plain_owner")
        with pytest.raises(psycopg.errors.RaiseException) as refused:
            schema.migrate(make_conninfo(one, user="plain_owner", options="-c search_path=plain"))
        assert "role outbox_producer does not exist and plain_owner may not create it" in str(refused.value)
        assert refused.value.diag.message_hint == "Have a DBA run: CREATE ROLE outbox_producer NOLOGIN; then run this step again."
        with psycopg.connect(pg.dsn_for("one"), autocommit=True) as admin:
            admin.execute("DROP SCHEMA plain CASCADE")
            admin.execute("DROP ROLE plain_owner")
        schema.migrate(one)
        schema.migrate(two)                                   # the roles exist already: no error
        assert _group_roles(pg.dsn) == sorted(GROUPS)
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("CREATE ROLE app LOGIN IN ROLE outbox_worker")

        # One database rolled back: its grants go, the roles stay (database two uses them).
        assert roll_back_0012(one)[-1] == "0012_outbox_privileges"
        assert _group_roles(pg.dsn) == sorted(GROUPS)
        with psycopg.connect(one) as c:
            assert c.execute("SELECT count(*) FROM pg_proc WHERE proname LIKE 'outbox%%' AND prosecdef").fetchone() == (0,)
            assert c.execute("SELECT bool_and(has_function_privilege('app', oid, 'EXECUTE')) FROM pg_proc "
                             "WHERE proname LIKE 'outbox%%'").fetchone() == (True,)   # PUBLIC again
            assert c.execute("SELECT count(*) FROM pg_class c, aclexplode(c.relacl) a WHERE c.relname LIKE 'outbox%%' "
                             "AND a.grantee::regrole::text LIKE 'outbox\\_%%'").fetchone() == (0,)
            assert c.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
                             "AND attacl IS NOT NULL").fetchone() == (0,)     # no column grant left either

        # The last one: the roles go, except outbox_worker, which still has a member.
        assert roll_back_0012(two)[-1] == "0012_outbox_privileges"
        assert _group_roles(pg.dsn) == ["outbox_worker"]
        with psycopg.connect(pg.dsn, autocommit=True) as admin:
            admin.execute("DROP ROLE app")
        schema.migrate(two)
        assert _group_roles(pg.dsn) == sorted(GROUPS)
        roll_back_0012(two)
        assert _group_roles(pg.dsn) == []
        # and all the way down and up again
        schema.rollback(one, count=100)
        schema.migrate(one)
        assert _group_roles(pg.dsn) == sorted(GROUPS)


# --------------------------------------------------------------------------------------------

def _published(conn: psycopg.Connection[Any]) -> int:
    return int(conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0])


async def _until(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)
