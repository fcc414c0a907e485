"""The intake cursor's row is looked up once per claim and never by a report. Each claim moves the
intake cursor, a new version of the one-row outbox_intake; under a held snapshot every lookup by
key walks all of them. Reports read the cursor's mark (a sequence holding a committed value of the
cursor, never above it) instead, and the claim writes the row back by the ctid it locked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from helpers import claim, claim_ids, complete, connect, fail, insert, release

Conn = psycopg.Connection[Any]
T = TypeVar("T")


def intake_lookups(conn: Conn, action: Callable[[], T]) -> tuple[int, T]:
    """Scans of outbox_intake (sequential, or of its primary key) that ``action`` makes on this
    connection, and what it returns: each one reads every version of the row that a held
    snapshot keeps. (A TID scan, which reads one version, counts in neither.)"""
    count = ("SELECT pg_stat_get_xact_numscans('outbox_intake'::regclass)"
             " + pg_stat_get_xact_numscans('outbox_intake_pkey'::regclass)")
    (before,) = conn.execute(count).fetchone()  # type: ignore[misc]
    result = action()
    (after,) = conn.execute(count).fetchone()  # type: ignore[misc]
    return int(after) - int(before), result


def cursor_and_mark(conn: Conn) -> tuple[int, int]:
    row = conn.execute("SELECT (SELECT intake_id FROM outbox_intake), "
                       "coalesce(pg_sequence_last_value('outbox_intake_mark'), 0)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_a_claim_looks_the_intake_row_up_once_and_a_report_never(conn: Conn) -> None:
    """Not three per claim that takes events in (its lock, the cursor's move, last_claim_at)
    and one per report, as a claim that looks the row up by key for each would make."""
    ids = [insert(conn, "order", f"a{i}") for i in range(3)]
    conn.execute("BEGIN")
    lookups, rows = intake_lookups(conn, lambda: claim(conn, 10))
    conn.execute("COMMIT")
    assert sorted(r["id"] for r in rows) == ids
    assert lookups == 1
    token = rows[0]["lease_token"]
    for report in (lambda: complete(conn, ids[:1], token), lambda: release(conn, ids[1:2], token),
                   lambda: fail(conn, ids[2], token, "boom")):
        conn.execute("BEGIN")
        lookups, done = intake_lookups(conn, report)
        conn.execute("COMMIT")
        assert done and lookups == 0


def test_the_mark_is_never_above_the_cursor(dsn: str, conn: Conn) -> None:
    """The claim sets the mark to the cursor it locked (committed) before moving the cursor; a
    claim that rolls back leaves the mark at or below the cursor, and what it took in is taken in
    again by the next claim."""
    first = insert(conn, "order", "x")
    assert claim_ids(conn) == [first]
    cursor, mark = cursor_and_mark(conn)
    assert mark <= cursor == first
    second = insert(conn, "order", "y")
    with connect(dsn, autocommit=False) as other:
        assert [r[0] for r in other.execute("SELECT id FROM outbox_claim(10)")] == [second]
        other.rollback()
    cursor, mark = cursor_and_mark(conn)
    assert mark <= cursor == first
    assert claim_ids(conn) == [second]
    cursor, mark = cursor_and_mark(conn)
    assert mark <= cursor == second


def test_a_report_with_the_mark_behind_finds_the_next_event(conn: Conn) -> None:
    """A report reads its aggregate's line from least(head_id, mark + 1): with the mark behind the
    cursor it reads from further back and finds the same next event."""
    a = insert(conn, "order", "m")
    (row,) = claim(conn, 1)
    b = insert(conn, "order", "m")
    c = insert(conn, "other", "n")
    assert claim_ids(conn) == [c]                     # takes b in too: its head is a's, leased
    conn.execute("SELECT setval('outbox_intake_mark', 0, false)")   # as far behind as it can be
    assert complete(conn, [a], row["lease_token"]) == 1
    assert claim_ids(conn) == [b]


def test_last_claim_at_is_kept_by_the_claims(conn: Conn) -> None:
    assert conn.execute("SELECT last_claim_at FROM outbox_intake").fetchone() == (None,)
    assert claim_ids(conn) == []
    (noted,) = conn.execute("SELECT last_claim_at FROM outbox_intake").fetchone()  # type: ignore[misc]
    assert noted is not None
    assert claim_ids(conn) == []                      # within the second: not written again
    assert conn.execute("SELECT last_claim_at FROM outbox_intake").fetchone() == (noted,)
    conn.execute("UPDATE outbox_intake SET last_claim_at = last_claim_at - interval '2 seconds'")
    assert claim_ids(conn) == []
    (later,) = conn.execute("SELECT last_claim_at FROM outbox_intake").fetchone()  # type: ignore[misc]
    assert later > noted
