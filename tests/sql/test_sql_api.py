"""The one list of the SQL API's functions (outboxpg/sql_api.py) against a fresh install: every
outbox_* function of the schema is listed with its exact argument types, and every listed one
exists. A step that adds a function, drops one or changes its arguments fails here until the
list says so; the worker's start-up check, the command line's schema check and the privilege
and released-schema tests all take their signatures from that list."""

from __future__ import annotations

from typing import Any

import psycopg

from outboxpg import sql_api, statements
from outboxpg.sql_api import OPERATOR, WORKER, SqlFunction

# pg_proc of the install schema: name, argument types as regprocedure prints them, trigger or not.
_PG_PROC = r"""
SELECT p.proname::text, p.oid::regprocedure::text, p.prorettype = 'trigger'::regtype
  FROM pg_proc p
 WHERE p.pronamespace = current_schema()::regnamespace AND p.proname LIKE 'outbox\_%'
 ORDER BY 1, 2
"""


def test_the_list_is_every_function_of_a_fresh_install(conn: psycopg.Connection[Any]) -> None:
    have = {sig: trigger for _, sig, trigger in conn.execute(_PG_PROC).fetchall()}
    listed = {f.signature: f.trigger for f in sql_api.FUNCTIONS}
    unlisted = sorted(have.keys() - listed.keys())
    assert not unlisted, f"functions of the schema that outboxpg/sql_api.py does not list: {unlisted}"
    gone = sorted(listed.keys() - have.keys())
    assert not gone, f"functions outboxpg/sql_api.py lists that a fresh install does not have: {gone}"
    assert have == listed, "trigger functions listed as callable, or the other way round"
    # Each signature is what to_regprocedure() finds (the worker's start-up check looks them up so).
    found = conn.execute("SELECT f, to_regprocedure(f)::text FROM unnest(%s::text[]) AS f",
                         ([f.signature for f in sql_api.FUNCTIONS],)).fetchall()
    assert [f for f, proc in found if proc != f] == []


def test_each_function_is_listed_once_and_named() -> None:
    signatures = [f.signature for f in sql_api.FUNCTIONS]
    assert len(signatures) == len(set(signatures))
    # The module's named functions (CLAIM, COMPLETE, ...) are exactly the list.
    named = {v.signature for v in vars(sql_api).values() if isinstance(v, SqlFunction)}
    assert named == set(signatures)


def test_the_lists_that_use_it_hold_callable_functions() -> None:
    for f in (*sql_api.WORKER_CALLS, *sql_api.IDLE_CALLS):
        assert WORKER in f.callers and not f.trigger, f
    for f in sql_api.OPERATOR_CALLS:
        assert OPERATOR in f.callers and not f.trigger, f
    # The command line's schema check on a database installed by hand looks these up.
    assert {what for what, _ in statements.REQUIRED_OBJECTS} >= {f"function {f}" for f in sql_api.OPERATOR_CALLS}


def test_a_changed_signature_is_noticed(conn: psycopg.Connection[Any]) -> None:
    """What the list is for: a function whose arguments change (here by hand) no longer matches."""
    conn.execute("ALTER FUNCTION outbox_requeue(bigint[]) RENAME TO outbox_requeue_old")
    conn.execute("CREATE FUNCTION outbox_requeue(ids integer[]) RETURNS integer LANGUAGE sql AS 'SELECT 0'")
    have = {sig for _, sig, _ in conn.execute(_PG_PROC).fetchall()}
    listed = {f.signature for f in sql_api.FUNCTIONS}
    assert have - listed == {"outbox_requeue(integer[])", "outbox_requeue_old(bigint[])"}
    assert listed - have == {"outbox_requeue(bigint[])"}
