"""A database with events in every state, and a producer's open transaction, for the tests of the
operator's commands and of the psql files of sql/."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from helpers import claim, complete, fail, insert


def build_dataset(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """2 published, 4 dead (one with an event_type that looks like SQL injection (a subject token: no spaces)), one event held
    back behind a dead one, one due pending event, one leased by worker 'w-test'."""
    ids: dict[str, Any] = {}
    ids["published"] = []
    for agg in ("p-1", "p-2"):
        i = insert(conn, "order", agg, "created")
        (row,) = claim(conn, 1)
        assert row["id"] == i and complete(conn, [i], row["lease_token"]) == 1
        ids["published"].append(i)

    def dead(name: str, aggregate_type: str, aggregate_id: str, event_type: str, error: str, **cols: Any) -> None:
        i = insert(conn, aggregate_type, aggregate_id, event_type, **cols)
        (row,) = claim(conn, 1)
        assert row["id"] == i and fail(conn, i, row["lease_token"], error, True) == "dead"
        ids[name] = i

    dead("dead_o1", "order", "o-1", "created", "payload too large\n(limit 1048576 bytes)",
         payload='{"order": "o-1", "items": [1, 2]}', headers='{"Trace-Id": "abc"}')
    dead("dead_o2", "order", "o-2", "paid", "boom paid")
    dead("dead_c1", "customer", "c-1", "created", "boom customer")
    dead("dead_inj", "order", "o-3", "x'OR'1'='1", "boom inj", subject="outbox.inj")
    ids["held"] = insert(conn, "order", "o-1", "shipped")          # held back behind dead_o1
    ids["leased"] = insert(conn, "order", "o-7", "created")
    (row,) = claim(conn, 5, worker="w-test")                        # the held one is skipped
    assert row["id"] == ids["leased"]
    ids["leased_claimed_at"] = conn.execute("SELECT claimed_at FROM outbox WHERE id = %s",
                                            (ids["leased"],)).fetchone()[0]  # type: ignore[index]
    ids["pending"] = insert(conn, "customer", "c-9", "created")
    return ids


@contextlib.contextmanager
def producing_transaction(dsn: str, *aggregate_ids: str) -> Iterator[psycopg.Connection[Any]]:
    """A session of its own with an open transaction that has inserted one event of each
    aggregate (order/<id>): the commit-order guard holds those aggregates back until it ends. It
    rolls back when the block ends."""
    with psycopg.connect(dsn) as producer:
        for aggregate_id in aggregate_ids:
            insert(producer, "order", aggregate_id, "paid")
        yield producer
        producer.rollback()


def last_claim_at(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT last_claim_at FROM outbox_intake").fetchone()
    assert row is not None
    return row[0]
