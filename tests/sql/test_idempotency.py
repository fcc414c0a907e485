"""Idempotent enqueue (migrations/0022_outbox_idempotency.sql): plain SQL and the Python helpers,
concurrent producers, partitions, against a real PostgreSQL."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from outboxpg import Enqueued, Event, enqueue, enqueue_many

INSERT = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, idempotency_key) "
          "VALUES ('order', %s, 'paid', '{}', %s) RETURNING id")


def insert(conn: psycopg.Connection[Any], key: str | None, agg: str = "1") -> int | None:
    row = conn.execute(INSERT, (agg, key)).fetchone()
    return None if row is None else int(row[0])


def states(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    return conn.execute("SELECT idempotency_key, state::text FROM outbox ORDER BY id").fetchall()


def test_a_second_insert_with_the_key_writes_nothing_until_the_first_is_finished(conn):
    first = insert(conn, "pay-1")
    assert first is not None
    assert insert(conn, "pay-1") is None                 # no error, no row
    assert insert(conn, "pay-2") is not None             # another key
    assert insert(conn, None) is not None and insert(conn, None) is not None   # no key: as before
    assert conn.execute("SELECT outbox_idempotency_event('pay-1')").fetchone() == (first,)
    # still unfinished while leased, and while dead
    token = conn.execute("SELECT lease_token FROM outbox_claim(1)").fetchone()[0]
    assert insert(conn, "pay-1") is None
    conn.execute("SELECT outbox_fail(%s, %s, 'broken', true)", (first, token))
    assert conn.execute("SELECT state::text FROM outbox WHERE id = %s", (first,)).fetchone() == ("dead",)
    assert insert(conn, "pay-1") is None
    # finished (discarded here; published alike): the key is free again
    conn.execute("SELECT outbox_discard(ARRAY[%s]::bigint[], 'test')", (first,))
    again = insert(conn, "pay-1")
    assert again is not None and again != first
    assert conn.execute("SELECT outbox_idempotency_event('pay-1')").fetchone() == (again,)


def test_a_published_event_frees_its_key(conn):
    first = insert(conn, "k")
    (token,) = conn.execute("SELECT lease_token FROM outbox_claim(10)").fetchone()
    assert conn.execute("SELECT outbox_complete(ARRAY[%s]::bigint[], %s)", (first, token)).fetchone() == (1,)
    assert insert(conn, "k") is not None


def test_one_transaction_inserting_a_key_twice_writes_one_event(conn):
    with conn.transaction():
        assert insert(conn, "twice") is not None
        assert insert(conn, "twice") is None
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (1,)


def test_a_rolled_back_insert_leaves_the_key_free(dsn, conn):
    with psycopg.connect(dsn) as other:
        assert insert(other, "rb") is not None
        other.rollback()
    assert insert(conn, "rb") is not None


def test_eight_concurrent_producers_write_exactly_one_event_per_key(dsn, conn):
    """Eight producers write the same 60 keys at once, each key in a transaction of its own (in
    orders that differ), then 30 more keys in transactions of three (in one order: transactions
    that take several keys in different orders can deadlock, as on any unique index)."""
    keys = [f"key-{i}" for i in range(60)]
    grouped = [f"group-{i}" for i in range(30)]
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def producer(n: int) -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                barrier.wait()
                for i, key in enumerate(keys[n * 7 % 60:] + keys[:n * 7 % 60]):
                    insert(c, key, agg=str(i % 7))
            with psycopg.connect(dsn) as c:
                for i, key in enumerate(grouped):
                    insert(c, key, agg=str(i % 5))
                    if i % 3 == 2:
                        c.commit()
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert conn.execute("SELECT idempotency_key, count(*) FROM outbox GROUP BY 1 HAVING count(*) <> 1").fetchall() == []
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (len(keys) + len(grouped),)


def test_keys_hold_across_partitions(conn):
    """The earlier event sits in another partition: the key still holds (keys are not per
    partition)."""
    old = conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, idempotency_key, "
                       "created_at) VALUES ('order', '1', 'paid', '{}', 'p', now() - interval '40 days') "
                       "RETURNING id, tableoid::regclass::text").fetchone()
    new_partition = conn.execute("SELECT tableoid::regclass::text FROM outbox WHERE id = %s",
                                 (insert(conn, "q"),)).fetchone()[0]
    assert old[1] != new_partition
    assert insert(conn, "p") is None


def test_keys_of_finished_events_are_forgotten_in_batches_that_make_progress(conn):
    done = [insert(conn, f"done-{i}", agg=str(i)) for i in range(6)]
    conn.execute("SELECT outbox_discard(%s::bigint[], 'test')", (done,))
    held = [insert(conn, f"held-{i}", agg=str(i)) for i in range(3)]                            # unfinished
    conn.execute("UPDATE outbox_idempotency SET looked_at = looked_at - interval '1 hour' "
                 "WHERE idempotency_key LIKE 'held-%'")                                         # looked at first
    assert conn.execute("SELECT outbox_idempotency_forget(3)").fetchone() == (0,)   # the held ones, moved back
    assert conn.execute("SELECT outbox_idempotency_forget(4)").fetchone() == (4,)
    assert conn.execute("SELECT outbox_idempotency_forget()").fetchone() == (2,)
    left = {r[0] for r in conn.execute("SELECT idempotency_key FROM outbox_idempotency").fetchall()}
    assert left == {f"held-{i}" for i in range(3)}
    assert all(insert(conn, f"held-{i}") is None for i in range(3))            # still held
    assert insert(conn, "done-0") is not None                                  # free again
    assert len(held) == 3


async def test_the_worker_forgets_keys_of_finished_events(dsn, conn):
    from workers import start, wait_until

    from outboxpg.relay.publishers import FunctionPublisher

    ids = [insert(conn, f"w-{i}", agg=str(i)) for i in range(5)]

    async def publish(event: object) -> None:
        return None

    running = start(dsn, FunctionPublisher(publish), maintenance_interval=0.2)

    async def forgotten() -> bool:
        return conn.execute("SELECT count(*) FROM outbox_idempotency").fetchone() == (0,)

    await wait_until(forgotten, 15, "the keys forgotten after their events were published")
    await running.stop()
    assert conn.execute("SELECT count(*) FROM outbox WHERE state = 'published' AND id = ANY(%s)",
                        (ids,)).fetchone() == (5,)


def test_bad_keys_are_refused_with_a_clear_error(conn):
    for bad in ("", "   ", "x" * 256):
        with pytest.raises(psycopg.errors.CheckViolation, match="idempotency_key must be 1 to 255 bytes"):
            with conn.transaction():
                insert(conn, bad)


def test_python_helpers_return_the_holder_and_say_it_was_a_duplicate(conn):
    first = enqueue(conn, "order", "1", "paid", {}, idempotency_key="py-1")
    assert isinstance(first, Enqueued) and not first.duplicate
    second = enqueue(conn, "order", "1", "paid", {"again": True}, idempotency_key="py-1")
    assert second == first and second.duplicate
    assert (str(second), f"{second}", repr(second)) == (str(int(first)), str(int(first)),
                                                        f"Enqueued({int(first)}, duplicate=True)")
    plain = enqueue(conn, "order", "1", "paid", {})
    assert isinstance(plain, int) and not plain.duplicate
    assert enqueue_many(conn, [Event("order", "2", "x", {}, idempotency_key="py-1"),
                               Event("order", "2", "x", {}, idempotency_key="py-2"),
                               Event("order", "2", "x", {})]) == 2
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (4,)


async def test_async_helper_says_duplicate_too(dsn):
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as c:
        a = await enqueue(c, "order", "1", "paid", {}, idempotency_key="async-1")
        b = await enqueue(c, "order", "1", "paid", {}, idempotency_key="async-1")
    assert (b, b.duplicate, a.duplicate) == (a, True, False)


def test_a_producer_login_gets_the_same_answers(logins):
    with logins["producer"].connect() as p:
        first = enqueue(p, "order", "1", "paid", {}, idempotency_key="prod-1")
        assert enqueue(p, "order", "1", "paid", {}, idempotency_key="prod-1").duplicate
        assert insert(p, "prod-1") is None
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            p.execute("SELECT * FROM outbox_idempotency")
    with logins["operator"].connect() as o:
        assert o.execute("SELECT event_id FROM outbox_idempotency WHERE idempotency_key = 'prod-1'").fetchone() == (first,)
