"""Producers stay in their lane: run as the documented roles (two producer logins, app1 and
app2, a worker and an operator), no producer can cancel, pin, strand, reorder, flood or read what
is another's; an install cannot be taken over by whoever may create objects in its schema."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from helpers import claim, complete, insert
from psycopg import sql
from roles import Login, denied, login_roles

from outboxpg import enqueue, sql_files
from outboxpg.cli.errors import EXIT_FAILED

Conn = psycopg.Connection[Any]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def apps(dsn: str) -> Iterator[dict[str, Login]]:
    with login_roles(dsn, app1="outbox_producer", app2="outbox_producer", worker="outbox_worker",
                     operator="outbox_operator") as made:
        yield made


def drain(conn: Conn) -> list[tuple[str, str]]:
    """Claim and complete until nothing is claimable; (aggregate_id, event_type) in delivery order."""
    out: list[tuple[str, str]] = []
    for _ in range(50):
        rows = claim(conn, 100)
        if not rows:
            return out
        out += [(r["aggregate_id"], r["event_type"]) for r in rows]
        for token in {r["lease_token"] for r in rows}:
            complete(conn, [r["id"] for r in rows if r["lease_token"] == token], token)
    raise AssertionError("still claiming after 50 rounds")


# -- 1. cancel --------------------------------------------------------------------------------------

def test_a_producer_cancels_only_its_own_events(apps: dict[str, Login], conn: Conn) -> None:
    later = "now() + interval '1 hour'"
    with apps["app1"].connect() as a1, apps["app2"].connect() as a2:
        mine = a1.execute(f"INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, deliver_at) "
                          f"VALUES ('order', 'a1', 'reminder', '{{}}', {later}) RETURNING id").fetchone()[0]  # type: ignore[index]
        theirs = a2.execute(f"INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, deliver_at) "
                            f"VALUES ('order', 'a2', 'reminder', '{{}}', {later}) RETURNING id").fetchone()[0]  # type: ignore[index]
        every = "SELECT outbox_cancel(ARRAY(SELECT generate_series(1, pg_sequence_last_value('outbox_id_seq'))))"
        assert a1.execute(every).fetchone() == (1,)
        assert a2.execute(every).fetchone() == (1,)
    states = dict(conn.execute("SELECT id, state::text FROM outbox").fetchall())
    assert states == {mine: "discarded", theirs: "discarded"}
    produced = dict(conn.execute("SELECT id, produced_by FROM outbox").fetchall())
    assert produced == {mine: apps["app1"].name, theirs: apps["app2"].name}


def test_a_producer_cannot_say_who_produced_an_event(apps: dict[str, Login]) -> None:
    with apps["app1"].connect() as a1:
        denied(a1, "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, produced_by) "
                   f"VALUES ('order', '1', 'created', '{{}}', '{apps['app2'].name}')")


# -- 2. idempotency keys --------------------------------------------------------------------------

def test_idempotency_keys_belong_to_the_producer_that_took_them(apps: dict[str, Login], conn: Conn) -> None:
    stmt = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, idempotency_key, deliver_at) "
            "VALUES ('order', %s, 'refund', '{}', 'refund-order-42', now() + interval '1 day') RETURNING id")
    with apps["app1"].connect() as a1, apps["app2"].connect() as a2:
        (pinned,) = a1.execute(stmt, ("42",)).fetchone()  # type: ignore[misc]
        (own,) = a2.execute(stmt, ("42",)).fetchone()     # type: ignore[misc]  # app1's key is app1's
        assert a2.execute(stmt, ("42",)).fetchall() == []  # app2's own duplicate writes nothing
        with a2.transaction():
            got = enqueue(a2, "order", "42", "refund", {}, idempotency_key="refund-order-42")
        assert (got, got.duplicate) == (own, True)
        assert own != pinned
        # Only the insert path takes a key: not callable by anyone.
        denied(a1, "SELECT outbox_take_idempotency_key()")
    assert conn.execute("SELECT count(*) FROM outbox_idempotency").fetchone() == (2,)


def test_keys_of_finished_events_are_forgotten(apps: dict[str, Login], conn: Conn) -> None:
    with apps["app1"].connect() as a1:
        for i in range(50):
            a1.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, idempotency_key) "
                       "VALUES ('order', %s, 'paid', '{}', %s)", (str(i), f"k{i}"))
    with apps["worker"].connect() as w:
        assert len(drain(w)) == 50
        assert w.execute("SELECT outbox_idempotency_forget()").fetchone() == (50,)
    assert conn.execute("SELECT count(*) FROM outbox_idempotency").fetchone() == (0,)


# -- 3. an install that cannot be taken over -------------------------------------------------------

def outboxpg(*args: str) -> subprocess.CompletedProcess[str]:
    console = Path(sys.executable).parent / "outboxpg"
    return subprocess.run([str(console), *args], capture_output=True, text=True, timeout=300)


def test_an_install_into_a_schema_others_may_create_in_is_refused(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as admin:
        admin.execute("CREATE SCHEMA shared")
        admin.execute("GRANT USAGE, CREATE ON SCHEMA shared TO PUBLIC")
    target = f"{empty_dsn} options='-c search_path=shared'"
    result = outboxpg("migrate", "--dsn", target)
    assert result.returncode == EXIT_FAILED, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("outboxpg: PUBLIC may CREATE in schema shared of database ") \
        and "REVOKE CREATE ON SCHEMA shared FROM PUBLIC" in lines[0], result.stderr
    # psql, with no outboxpg in front: the install itself refuses, naming the fix.
    psql = subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", empty_dsn, "-c", "SET search_path = shared",
                           "-f", "-"], input=sql_files.install_sql(), capture_output=True, text=True, timeout=120)
    assert psql.returncode != 0 and "PUBLIC may CREATE in schema shared" in psql.stderr \
        and "REVOKE CREATE ON SCHEMA shared FROM PUBLIC" in psql.stderr, psql.stderr
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("SELECT to_regclass('shared.outbox')").fetchone() == (None,)
    with psycopg.connect(empty_dsn, autocommit=True) as admin:
        admin.execute("REVOKE CREATE ON SCHEMA shared FROM PUBLIC")
    assert outboxpg("migrate", "--dsn", target).returncode == 0


def test_a_schema_opened_to_others_after_the_install_is_named(apps: dict[str, Login], dsn: str,
                                                              conn: Conn) -> None:
    """CREATE granted on the schema after the install: whoever has it could plant an exact
    format(text, timestamptz, text) that the owner's functions would prefer to the built-in.
    outbox_untrusted_creators() names them, for the worker's start-up check and the operator."""
    with apps["worker"].connect() as w:
        assert w.execute("SELECT outbox_untrusted_creators()").fetchone() == (None,)
    with login_roles(dsn, stranger=None) as who:
        conn.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(who["stranger"].name)))
        with apps["worker"].connect() as w, apps["operator"].connect() as o:
            assert w.execute("SELECT outbox_untrusted_creators()").fetchone() == (who["stranger"].name,)
            assert o.execute("SELECT outbox_untrusted_creators()").fetchone() == (who["stranger"].name,)
        conn.execute(sql.SQL("REVOKE CREATE ON SCHEMA public FROM {}").format(sql.Identifier(who["stranger"].name)))


# -- 4. the commit-order guard cannot be switched off or fooled -----------------------------------

HOSTILE_GUARD_VALUES = ["off", "all", ",1,", "0:all", "999999999999:,1,", "garbage", ",", "1:off", "-5:,7,"]


@pytest.mark.parametrize("value", HOSTILE_GUARD_VALUES)
@pytest.mark.parametrize("when", ["before the first insert", "after the first insert"])
def test_hostile_guard_settings_neither_strand_nor_reorder(apps: dict[str, Login], dsn: str, conn: Conn,
                                                           value: str, when: str) -> None:
    with psycopg.connect(apps["app1"].dsn) as a1, apps["app2"].connect() as a2, \
            apps["worker"].connect() as w:
        if when == "before the first insert":
            a1.execute("SELECT set_config('outboxpg.held_aggregates', %s, true)", (value,))
            insert(a1, "guard", "X", "first")
        else:
            insert(a1, "guard", "other", "warmup")
            a1.execute("SELECT set_config('outboxpg.held_aggregates', %s, true)", (value,))
            insert(a1, "guard", "X", "first")
        insert(a2, "guard", "X", "second")
        insert(a2, "guard", "X", "third")
        assert [e for e in drain(w) if e[0] == "X"] == [], "events of X went out while an earlier one was open"
        a1.commit()
        assert [e for e in drain(w) if e[0] == "X"] == [("X", "first"), ("X", "second"), ("X", "third")]
    assert conn.execute("SELECT count(*) FROM outbox WHERE state <> 'published'").fetchone() == (0,)


# -- 5, 6. subjects and sizes, refused at INSERT ---------------------------------------------------

def test_subjects_outside_the_allowed_prefixes_are_refused_at_insert(apps: dict[str, Login], conn: Conn) -> None:
    with apps["app1"].connect() as a1:
        with pytest.raises(psycopg.errors.CheckViolation, match="allowed_subject_prefixes"):
            insert(a1, "order", "1", subject="payments.capture")
        insert(a1, "order", "1", subject="outbox.order.shipped")          # under subject_prefix
        conn.execute("UPDATE outbox_settings SET allowed_subject_prefixes = '{payments}'")
        insert(a1, "order", "1", subject="payments.capture")
        with pytest.raises(psycopg.errors.CheckViolation, match="allowed_subject_prefixes"):
            insert(a1, "order", "1", subject="paymentsX.capture")


def test_events_over_the_size_limit_are_refused_at_insert(apps: dict[str, Login], conn: Conn) -> None:
    conn.execute("UPDATE outbox_settings SET max_event_bytes = 65536")
    with apps["app1"].connect() as a1:
        with pytest.raises(psycopg.errors.CheckViolation, match="max_event_bytes"):
            insert(a1, "order", "1", payload=f'{{"blob": "{"x" * 70000}"}}')
        insert(a1, "order", "1", payload=f'{{"blob": "{"x" * 60000}"}}')
    (size,) = conn.execute("SELECT size_bytes FROM outbox").fetchone()  # type: ignore[misc]
    assert 60000 < size <= 65536


def test_a_claim_stays_within_its_byte_budget(conn: Conn) -> None:
    """Ten events of 4 MB over five aggregates: a claim hands out what fits its budget, in claim
    order (a run is cut, never skipped), and one event however large."""
    conn.execute("UPDATE outbox_settings SET max_event_bytes = 64000000, max_claim_bytes = 10000000")
    big = '{"blob": "' + "x" * 4_000_000 + '"}'
    ids = {f"a{i}": [] for i in range(5)}
    for i in range(10):
        ids[f"a{i % 5}"].append(insert(conn, "order", f"a{i % 5}", payload=big))
    assert [r["id"] for r in claim(conn, 100)] == ids["a0"]                  # the setting: 2 x 4 MB fit
    got = [r[0] for r in conn.execute("SELECT id FROM outbox_claim(100, max_bytes => 9000000)").fetchall()]
    assert got == ids["a1"]
    got = [r[0] for r in conn.execute("SELECT id FROM outbox_claim(100, max_bytes => 1)").fetchall()]
    assert got == ids["a2"][:1]                                             # one, however large; a run cut
    conn.execute("UPDATE outbox_settings SET max_claim_bytes = 64000000")
    got = [r["id"] for r in claim(conn, 100)]
    assert sorted(got) == sorted(ids["a3"] + ids["a4"])                    # a2's second waits for its run
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="max_bytes"):
        conn.execute("SELECT * FROM outbox_claim(10, max_bytes => 0)")


# -- 7. no other session's query text ---------------------------------------------------------------

def test_xmin_holders_show_no_query_text(apps: dict[str, Login], dsn: str, conn: Conn) -> None:
    conn.execute("UPDATE outbox_settings SET xmin_warn_after = '1 millisecond'")
    with psycopg.connect(apps["app1"].dsn) as a1:
        a1.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        a1.execute("SELECT 'ssn=078-05-1120'").fetchone()
        conn.execute("SELECT pg_sleep(0.05)")
        with apps["operator"].connect() as o, apps["worker"].connect() as w:
            for c in (o, w):
                rows = c.execute("SELECT to_jsonb(x)::text FROM outbox_xmin_holders() x").fetchall()
                assert rows and not any("ssn" in r[0] for r in rows), rows
                (health,) = c.execute("SELECT to_jsonb(h)::text FROM outbox_health h").fetchone()  # type: ignore[misc]
                assert "ssn" not in health and apps["app1"].name in health
        a1.rollback()


# -- 8. scheduled and expiring events ----------------------------------------------------------------

@pytest.mark.parametrize("column, value", [("deliver_at", "infinity"), ("deliver_at", "-infinity"),
                                           ("deliver_at", "now() + interval '20 years'"),
                                           ("expires_at", "infinity"), ("expires_at", "-infinity")])
def test_infinite_and_absurd_times_are_refused(apps: dict[str, Login], column: str, value: str) -> None:
    with apps["app1"].connect() as a1:
        with pytest.raises(psycopg.errors.CheckViolation, match=column):
            a1.execute(f"INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, {column}) "
                       f"VALUES ('order', '1', 'created', '{{}}', {value if 'now' in value else repr(value)})")


# -- 12. smaller things -----------------------------------------------------------------------------

def test_operators_may_not_read_lease_tokens_and_nobody_calls_trigger_functions(apps: dict[str, Login],
                                                                                 conn: Conn) -> None:
    insert(conn, "order", "1")
    with apps["operator"].connect() as o:
        denied(o, "SELECT lease_token FROM outbox")
        assert o.execute("SELECT count(*) FROM outbox").fetchone() == (1,)
    assert conn.execute("SELECT has_function_privilege('public', 'outbox_forget_deleted()', 'EXECUTE')"
                        ).fetchone() == (False,)


def test_a_replay_copies_at_most_its_cap(conn: Conn) -> None:
    for i in range(30):
        insert(conn, "order", f"r{i}")
    drain(conn)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="max_events"):
        conn.execute("SELECT outbox_replay(since => '-infinity', max_events => 20)")
    assert conn.execute("SELECT outbox_replay(since => '-infinity', max_events => 30)").fetchone() == (30,)


# -- positive controls ------------------------------------------------------------------------------

def test_each_role_still_does_its_job(apps: dict[str, Login], conn: Conn) -> None:
    with apps["app1"].connect() as a1:
        e = insert(a1, "order", "1")
        later = a1.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, deliver_at) "
                           "VALUES ('order', '2', 'reminder', '{}', now() + interval '1 hour') RETURNING id").fetchone()[0]  # type: ignore[index]
        assert a1.execute("SELECT outbox_cancel(ARRAY[%s]::bigint[])", (later,)).fetchone() == (1,)
    with apps["worker"].connect() as w:
        (row,) = claim(w, 10)
        assert row["id"] == e
        assert w.execute("SELECT outbox_extend(ARRAY[%s]::bigint[], %s)", (e, row["lease_token"])).fetchone() == (1,)
        assert w.execute("SELECT outbox_fail(%s, %s, 'boom', true)", (e, row["lease_token"])).fetchone() == ("dead",)
    with apps["operator"].connect() as o:
        assert o.execute("SELECT count(*) FROM outbox_dead_letters").fetchone() == (1,)
        assert o.execute("SELECT outbox_requeue(ARRAY[%s]::bigint[])", (e,)).fetchone() == (1,)
        assert o.execute("SELECT outbox_discard(ARRAY[%s]::bigint[], 'not needed')", (e,)).fetchone() == (1,)
