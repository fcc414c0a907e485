"""The views the command line reads: outbox_dead_letters.held_back and outbox_failing."""

from __future__ import annotations

from typing import Any

import psycopg
from helpers import claim, fail, insert
from psycopg.rows import dict_row

from outboxpg import statements


def _dead(conn: psycopg.Connection[Any], aggregate_id: str) -> int:
    i = insert(conn, aggregate_id=aggregate_id)
    rows = claim(conn, 10)
    assert [r["id"] for r in rows] == [i]
    assert fail(conn, i, rows[0]["lease_token"], "broken", permanent=True) == "dead"
    return i


def test_held_back_counts_the_events_waiting_behind_a_dead_letter(conn: psycopg.Connection[Any]) -> None:
    dead = _dead(conn, "a")
    lonely = _dead(conn, "c")                             # a dead letter with nothing behind it
    behind = [insert(conn, aggregate_id="a", event_type=f"step{n}") for n in range(3)]
    other = insert(conn, aggregate_id="b")                # another aggregate: not held back
    rows = conn.execute("SELECT id, aggregate_id, held_back FROM outbox_dead_letters ORDER BY id").fetchall()
    assert rows == [(dead, "a", 3), (lonely, "c", 0)]
    # what outboxpg dead show reads
    assert conn.execute(statements.HELD_BACK, (dead,)).fetchone() == (3,)
    # b's event is claimable, a's three are not (and still counted while b's is leased)
    assert [r["id"] for r in claim(conn, 10)] == [other]
    assert conn.execute(statements.HELD_BACK, (dead,)).fetchone() == (3,)
    # requeued, it holds back nothing any more: it is no dead letter
    conn.execute("SELECT outbox_requeue(%s::bigint[])", ([dead],))
    assert conn.execute(statements.HELD_BACK, (dead,)).fetchone() is None
    assert [r["id"] for r in claim(conn, 10)] == [dead, *behind]


def test_held_back_counts_only_later_unfinished_events(conn: psycopg.Connection[Any]) -> None:
    first = insert(conn, aggregate_id="a")
    rows = claim(conn, 10)
    conn.execute("SELECT outbox_complete(%s::bigint[], %s)", ([first], rows[0]["lease_token"]))
    dead = _dead(conn, "a")
    later = insert(conn, aggregate_id="a")
    conn.execute("SELECT outbox_discard(%s::bigint[], 'not needed')", ([later],))
    insert(conn, aggregate_id="a")
    # the published one before it and the discarded one after it do not count
    assert conn.execute("SELECT held_back FROM outbox_dead_letters WHERE id = %s", (dead,)).fetchone() == (1,)


def test_outbox_failing_groups_failures_by_reason(conn: psycopg.Connection[Any]) -> None:
    ids = [insert(conn, aggregate_id=str(n)) for n in range(3)]
    rows = claim(conn, 10)
    token = rows[0]["lease_token"]
    assert fail(conn, ids[0], token, "no ack for event 17") == "pending"
    assert fail(conn, ids[1], token, "no ack for event 18\nsecond line") == "pending"
    assert fail(conn, ids[2], token, "(no responders)") == "pending"
    with conn.cursor(row_factory=dict_row) as cur:
        failing = cur.execute(statements.FAILING).fetchall()
    assert [(f["reason"], f["events"], f["ids"], f["min_attempts"], f["retrying_now"]) for f in failing] == [
        ("no ack for event 17", 2, ids[:2], 1, 0), ("(no responders)", 1, ids[2:], 1, 0)]
    assert failing[0]["subjects"] == ["outbox.order.created"]
    assert failing[0]["event_types"] == ["created"]


def test_dead_letters_and_held_back_never_read_the_published_bulk(conn: psycopg.Connection[Any]) -> None:
    """Dead letters and held_back are looked up in the partial index of unfinished events
    (outbox_unfinished_by_aggregate_idx, on each partition), whatever the published bulk."""
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, state, published_at) "
                 "SELECT 'order', 'a', 'created', '{}', 'published', now() FROM generate_series(1, 20000)")
    dead = _dead(conn, "a")
    insert(conn, aggregate_id="a")
    (part,) = conn.execute("SELECT tableoid::regclass::text FROM outbox WHERE id = %s", (dead,)).fetchone()
    conn.execute("ANALYZE outbox")
    plan = "\n".join(r[0] for r in conn.execute("EXPLAIN SELECT id, held_back FROM outbox_dead_letters"))
    assert f"Seq Scan on {part} " not in plan, plan
    assert plan.count(f" on {part} ") == 2 and "aggregate_type_aggregate_id_id_idx" in plan, plan
    assert conn.execute("SELECT id, held_back FROM outbox_dead_letters").fetchall() == [(dead, 1)]
