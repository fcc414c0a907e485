"""The claim's statements are planned once per session (generic plans) with the table as it is
then. A session that claimed while the outbox held a few events must keep plans that suit a
backlog: the plans are read back with auto_explain (nested statements), not timed."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import claim, complete, insert_series

Conn = psycopg.Connection[Any]


def plans_of_next_claim(session: Conn, n: int) -> list[str]:
    """The plans of every statement the next claim of ``n`` runs, as auto_explain logs them."""
    notes: list[str] = []
    session.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
    session.execute("LOAD 'auto_explain'")
    session.execute("SET auto_explain.log_min_duration = 0")
    session.execute("SET auto_explain.log_nested_statements = on")
    session.execute("SET auto_explain.log_analyze = on")
    session.execute("SET client_min_messages = log")
    rows = claim(session, n)
    session.execute("SET client_min_messages = notice")
    assert len(rows) == n
    return [note for note in notes if "plan:" in note]


@pytest.mark.parametrize("before", ["a few events claimed", "outbox_warm_up()"])
def test_the_claims_update_keeps_finding_its_rows_by_ctid_after_a_burst(dsn: str, conn: Conn, before: str) -> None:
    """A session claims on a small outbox (or warms up on an empty one), then 20,000 events
    land. Its claim's update of the rows it hands out finds them by ctid; planned on the small
    table it had chosen an index scan of the primary key over the created_at range, which reads
    every row of the partition on each claim (440 ms instead of 17 for a claim of 500 after
    200,000, until an ANALYZE)."""
    with psycopg.connect(dsn, autocommit=True) as session:
        if before == "outbox_warm_up()":
            session.execute("SELECT outbox_warm_up()")
        else:
            for i in range(3):
                insert_series(conn, [f"small-{i}"])
                rows = claim(session, 10)
                complete(session, [r["id"] for r in rows], rows[0]["lease_token"])
        conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                     "SELECT 'acct', 'a' || (g % 2000), 'e', '{}' FROM generate_series(1, 20000) g")
        plans = plans_of_next_claim(session, 100)
    update = [p for p in plans if "WITH claimed AS" in p]
    assert len(update) == 1, [p.split("\n", 2)[1][:80] for p in plans]
    assert "Tid Scan" in update[0] and "Index Scan" not in update[0], update[0]
