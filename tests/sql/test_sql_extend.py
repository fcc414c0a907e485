"""outbox_extend (migrations/0014_outbox_extend.sql): a worker keeps the leases of a batch it is
still publishing. Fenced like outbox_complete: only events still leased under the token are
extended; the heads follow, so no claim takes the run back before the new end."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from helpers import claim, complete, insert_series, set_settings, states

Conn = psycopg.Connection[Any]


def extend(conn: Conn, ids: list[int] | None, token: Any, lease: str | None = "1 minute") -> int:
    row = conn.execute("SELECT outbox_extend(%s::bigint[], %s::uuid, %s::interval)", (ids, token, lease)).fetchone()
    assert row is not None
    return row[0]


def locked_until(conn: Conn, ids: list[int]) -> list[Any]:
    return [r[0] for r in conn.execute("SELECT locked_until FROM outbox WHERE id = ANY(%s) ORDER BY id", (ids,))]


def test_an_extended_run_is_not_taken_back_when_its_first_lease_ends(conn: Conn) -> None:
    set_settings(conn, max_run=10)
    ids = insert_series(conn, ["a", "a", "a", "b"])
    rows = claim(conn, 10, lease="300 milliseconds")
    token = rows[0]["lease_token"]
    assert extend(conn, ids, token) == 4
    ready = conn.execute("SELECT min(ready_at) - clock_timestamp() FROM outbox_heads").fetchone()[0]
    assert ready.total_seconds() > 50, "the heads follow the new end of the lease"
    time.sleep(0.4)                                   # past the lease the claim gave
    assert claim(conn, 10) == []                      # nothing reclaimed: not a lost lease
    assert complete(conn, ids, token) == 4
    assert set(states(conn)) == {"published"}


def test_without_extend_the_same_run_is_taken_back(conn: Conn) -> None:
    """The contrast to the test above: what the worker's extension prevents."""
    ids = insert_series(conn, ["a", "a", "b"])
    rows = claim(conn, 10, lease="300 milliseconds")
    time.sleep(0.4)
    claim(conn, 10)                                   # takes the expired runs back
    assert complete(conn, ids, rows[0]["lease_token"]) == 0


def test_a_stale_token_extends_nothing(conn: Conn) -> None:
    set_settings(conn, backoff_base="1 millisecond", backoff_cap="1 millisecond")
    a1, a2 = insert_series(conn, ["a", "a"])
    old = claim(conn, 10, lease="100 milliseconds")[0]["lease_token"]
    time.sleep(0.2)
    claim(conn, 10)                                   # reclaims the expired run: a1 failed an attempt
    time.sleep(0.01)
    new_rows = claim(conn, 10, lease="1 minute")
    assert [r["id"] for r in new_rows] == [a1, a2]
    before = locked_until(conn, [a1, a2])
    assert extend(conn, [a1, a2], old, "1 hour") == 0
    assert locked_until(conn, [a1, a2]) == before
    assert extend(conn, [a1, a2], new_rows[0]["lease_token"], "1 hour") == 2


def test_only_the_events_still_held_count(conn: Conn) -> None:
    a1, b1, c1 = insert_series(conn, ["a", "b", "c"])
    token = claim(conn, 10)[0]["lease_token"]
    assert complete(conn, [a1], token) == 1
    assert extend(conn, [a1, b1, c1, 999_999], token) == 2    # published and unknown ids: not held
    assert extend(conn, [b1], uuid.uuid4()) == 0


def test_an_expired_lease_nobody_took_back_is_extended(conn: Conn) -> None:
    """The worker is still at it; a late outbox_complete would count too."""
    (a1,) = insert_series(conn, ["a"])
    token = claim(conn, 10, lease="100 milliseconds")[0]["lease_token"]
    time.sleep(0.2)
    assert extend(conn, [a1], token) == 1
    assert claim(conn, 10) == []
    assert complete(conn, [a1], token) == 1


def test_a_lease_is_never_shortened(conn: Conn) -> None:
    (a1,) = insert_series(conn, ["a"])
    token = claim(conn, 10, lease="1 hour")[0]["lease_token"]
    before = locked_until(conn, [a1])
    assert extend(conn, [a1], token, "1 second") == 1
    assert locked_until(conn, [a1]) == before


def test_null_lease_is_the_default_lease(conn: Conn) -> None:
    set_settings(conn, default_lease="10 minutes")
    (a1,) = insert_series(conn, ["a"])
    token = claim(conn, 10, lease="1 second")[0]["lease_token"]
    assert extend(conn, [a1], token, None) == 1
    left = conn.execute("SELECT locked_until - clock_timestamp() FROM outbox WHERE id = %s", (a1,)).fetchone()[0]
    assert 590 < left.total_seconds() <= 600


@pytest.mark.parametrize("ids, token, lease, error", [
    (None, uuid.uuid4(), "1 minute", psycopg.errors.NullValueNotAllowed),
    ([1], None, "1 minute", psycopg.errors.NullValueNotAllowed),
    ([1], uuid.uuid4(), "0 seconds", psycopg.errors.InvalidParameterValue),
    ([1], uuid.uuid4(), "-1 second", psycopg.errors.InvalidParameterValue),
])
def test_bad_arguments_are_errors(conn: Conn, ids: Any, token: Any, lease: str, error: type[Exception]) -> None:
    with pytest.raises(error, match="outbox_extend"):
        extend(conn, ids, token, lease)
