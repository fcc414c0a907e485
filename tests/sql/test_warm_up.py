"""outbox_warm_up(): a new session plans the claim and the report before its first claim, and
nothing it did stays. Planning is measured by what the session caches (its CachedPlanSource
memory contexts, one per statement planned), not by time."""

from __future__ import annotations

from typing import Any

import psycopg
from helpers import PLANS_KEPT, claim, complete, insert_series
from roles import Login

Conn = psycopg.Connection[Any]

def state(conn: Conn) -> dict[str, Any]:
    """Everything a claim or a report can change, and the id sequence."""
    return {
        "events": conn.execute("SELECT id, state, attempts, lease_token, locked_until, locked_by, published_at "
                               "FROM outbox ORDER BY id").fetchall(),
        "heads": conn.execute("SELECT aggregate_type, aggregate_id, head_id, ready_at, leased_until, parked, moves "
                              "FROM outbox_heads ORDER BY aggregate_type, aggregate_id").fetchall(),
        "intake": conn.execute("SELECT intake_id, newest_id FROM outbox_intake").fetchall(),
    }


def plans(conn: Conn) -> int:
    (n,) = conn.execute(PLANS_KEPT).fetchone()  # type: ignore[misc]
    return int(n)


def test_nothing_the_warm_up_did_stays(dsn: str, conn: Conn, logins: dict[str, Login]) -> None:
    """Events waiting, a run in flight, heads made: after a worker login's warm-up every event,
    head and the intake are as they were, two ids a call were used up, and the next claim hands
    out what it would have. (The intake's mark may rise to the cursor that was committed, as
    for any claim rolled back: still true.)"""
    insert_series(conn, [f"a{i % 7}" for i in range(40)])
    in_flight = claim(conn, 5)                      # heads made, a run leased
    insert_series(conn, [f"b{i % 3}" for i in range(9)])   # above the intake cursor
    with psycopg.connect(dsn) as probe:             # what the next claim hands out, rolled back
        would = [r[0] for r in probe.execute("SELECT id FROM outbox_claim(100)").fetchall()]
        probe.rollback()
    before = state(conn)
    (last_id,) = conn.execute("SELECT last_value FROM outbox_id_seq").fetchone()  # type: ignore[misc]
    with logins["worker"].connect() as worker:
        worker.execute("SELECT outbox_warm_up()")
        worker.execute("SELECT outbox_warm_up('0/1')")
    assert state(conn) == before
    assert conn.execute("SELECT last_value FROM outbox_id_seq").fetchone()[0] == last_id + 4  # type: ignore[index]
    (mark, cursor), = conn.execute("SELECT pg_sequence_last_value('outbox_intake_mark'), intake_id "
                                   "FROM outbox_intake").fetchall()
    assert mark <= cursor
    assert [r["id"] for r in claim(conn, 100)] == would != []
    complete(conn, [r["id"] for r in in_flight], in_flight[0]["lease_token"])


def test_a_warmed_session_plans_nothing_more_for_its_first_claim_and_report(dsn: str, conn: Conn) -> None:
    """A new session's first claim with events waiting, and its first report, plan a hundred and
    more statements; after the warm-up they plan none, whether the claim passes a text argument
    (as outboxpg-worker does) or none."""
    insert_series(conn, [f"a{i % 100}" for i in range(1_000)])
    for call in ("SELECT id, lease_token FROM outbox_claim(50)",
                 "SELECT id, lease_token FROM outbox_claim(50, NULL, 'w1', NULL, NULL)"):
        with psycopg.connect(dsn) as cold, psycopg.connect(dsn) as warm:
            warm.execute("SELECT outbox_warm_up()")
            warm.commit()
            counts = []
            for session in (cold, warm):
                before = plans(session)
                rows = session.execute(call).fetchall()
                session.execute("SELECT outbox_complete(%s, %s)", ([r[0] for r in rows], rows[0][1]))
                counts.append(plans(session) - before)
                session.rollback()
            assert counts[0] > 100 and counts[1] == 0, (call, counts)
