"""Concurrent sessions against the SQL core: exclusive claims, fencing of expired leases,
per-aggregate order under concurrent claimers, and the NOTIFY wakeup protocol.

Every claimer is a thread with its own autocommit psycopg connection, as separate worker
processes would be. Randomness is seeded; every wait is bounded.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from helpers import (
    WAKEUP_LOCK,
    Background,
    Listener,
    claim,
    complete,
    connect,
    event,
    fail,
    insert,
    insert_series,
    release,
    set_settings,
    states,
    wait_until,
    waiting_for_advisory_lock,
)

Conn = psycopg.Connection[Any]


# --------------------------------------------------------------------------------------------
# fencing: expired leases
# --------------------------------------------------------------------------------------------

def _claim_until(conn: Conn, event_id: int, timeout: float = 10.0, **kw: Any) -> dict[str, Any]:
    """Claim repeatedly until ``event_id`` is handed out (its retry becomes due within ms)."""
    found: list[dict[str, Any]] = []

    def got_it() -> bool:
        found.extend(r for r in claim(conn, 10, **kw) if r["id"] == event_id)
        return bool(found)

    wait_until(got_it, timeout=timeout, interval=0.002, message=f"event {event_id} to be claimed")
    assert len(found) == 1
    return found[0]


def _wait_lease_expired(conn: Conn, event_id: int) -> None:
    wait_until(lambda: conn.execute("SELECT locked_until < clock_timestamp() FROM outbox WHERE id = %s",
                                    (event_id,)).fetchone() == (True,),
               timeout=5, interval=0.005, message="the lease to expire")


def test_expired_lease_is_reclaimed_and_the_late_worker_is_fenced(dsn: str, conn: Conn) -> None:
    set_settings(conn, backoff_base="1 millisecond", backoff_cap="1 millisecond", max_attempts=10)
    i = insert(conn)
    with psycopg.connect(dsn, autocommit=True) as w1, psycopg.connect(dsn, autocommit=True) as w2:
        (first,) = claim(w1, 10, lease="50 milliseconds", worker="w1")
        assert first["id"] == i and first["attempts"] == 1
        _wait_lease_expired(conn, i)

        second = _claim_until(w2, i, lease="1 minute", worker="w2")
        assert second["attempts"] == 2  # the expired lease counted as an attempt
        assert second["lease_token"] != first["lease_token"]
        assert second["msg_id"] == first["msg_id"]
        held = event(conn, i)
        assert held["state"] == "processing" and held["locked_by"] == "w2"
        assert held["lease_token"] == second["lease_token"]
        assert "lease expired" in held["last_error"] and "w1" in held["last_error"]

        # the first worker reports late: nothing changes, and it is told so
        assert complete(w1, [i], first["lease_token"]) == 0
        assert event(conn, i) == held
        assert fail(w1, i, first["lease_token"], "late failure") is None
        assert event(conn, i) == held

        # the current holder still can
        assert complete(w2, [i], second["lease_token"]) == 1
        assert event(conn, i)["state"] == "published"


def test_expired_lease_makes_event_dead_at_max_attempts(conn: Conn) -> None:
    set_settings(conn, backoff_base="1 millisecond", backoff_cap="1 millisecond", max_attempts=2)
    i = insert(conn)
    (first,) = claim(conn, 10, lease="50 milliseconds", worker="w1")
    _wait_lease_expired(conn, i)
    second = _claim_until(conn, i, lease="50 milliseconds", worker="w2")
    assert second["attempts"] == 2
    _wait_lease_expired(conn, i)

    assert [r["id"] for r in claim(conn, 10)] == []  # reclaims: out of attempts, dead
    e = event(conn, i)
    assert e["state"] == "dead" and e["attempts"] == 2 and e["dead_at"] is not None
    assert e["lease_token"] is None and "lease expired" in e["last_error"] and "w2" in e["last_error"]
    assert conn.execute("SELECT id FROM outbox_dead_letters").fetchall() == [(i,)]
    # the fenced workers cannot resurrect it
    assert complete(conn, [i], second["lease_token"]) == 0
    assert fail(conn, i, second["lease_token"], "x") is None
    assert event(conn, i)["state"] == "dead"


def test_expired_lease_with_max_attempts_one_dies_on_first_expiry(conn: Conn) -> None:
    set_settings(conn, max_attempts=1)
    i = insert(conn)
    (first,) = claim(conn, 1, lease="50 milliseconds")
    _wait_lease_expired(conn, i)
    assert claim(conn, 1) == []
    assert event(conn, i)["state"] == "dead"


def test_late_report_on_expired_but_unreclaimed_lease_still_counts(conn: Conn) -> None:
    a, b = insert_series(conn, ["a", "b"])
    ra, rb = claim(conn, 2, lease="50 milliseconds")
    _wait_lease_expired(conn, a)
    _wait_lease_expired(conn, b)
    # nobody called outbox_claim since: the work was done, the report is taken
    assert complete(conn, [a], ra["lease_token"]) == 1
    assert fail(conn, b, rb["lease_token"], "late") == "pending"
    assert event(conn, a)["state"] == "published"
    assert event(conn, b)["attempts"] == 1


def test_unexpired_lease_is_not_reclaimed(conn: Conn) -> None:
    i = insert(conn)
    (r,) = claim(conn, 1, lease="10 minutes")
    for _ in range(3):
        assert claim(conn, 10) == []
    e = event(conn, i)
    assert e["state"] == "processing" and e["lease_token"] == r["lease_token"] and e["attempts"] == 1


def test_expired_leases_do_not_cost_the_claim_its_batch(conn: Conn) -> None:
    """Expired leases come first in id order; a claim that finds only those among its first
    candidates reclaims them and still hands out the due events behind them."""
    old = [insert(conn, aggregate_id=f"old{n}") for n in range(3)]
    claimed = claim(conn, 3, lease="20 milliseconds", worker="crashed")
    assert [r["id"] for r in claimed] == old
    for i in old:
        _wait_lease_expired(conn, i)
    new = [insert(conn, aggregate_id=f"new{n}") for n in range(2)]

    assert [r["id"] for r in claim(conn, 2)] == new
    for i in old:   # reclaimed by that claim: a failed attempt, waiting for its retry
        e = event(conn, i)
        assert e["state"] == "pending" and e["lease_token"] is None and e["attempts"] == 1
        assert "lease expired" in e["last_error"] and "crashed" in e["last_error"]


def test_claim_and_retry_are_hot_updates(conn: Conn) -> None:
    """Leasing and retrying touch no index (state and lease columns are in none): PostgreSQL
    updates the row in place (HOT). Counted within one transaction, where the statistics are exact."""
    ids = insert_series(conn, [f"a{n}" for n in range(20)])
    with conn.transaction():
        rows = claim(conn, 20)
        assert len(rows) == 20
        assert fail(conn, ids[0], rows[0]["lease_token"], "retry me") == "pending"
        (updated, hot), = conn.execute(
            "SELECT sum(pg_stat_get_xact_tuples_updated(i.inhrelid)), sum(pg_stat_get_xact_tuples_hot_updated(i.inhrelid)) "
            "FROM pg_inherits i WHERE i.inhparent = 'outbox'::regclass").fetchall()
    assert updated == 21
    assert hot == 21


# --------------------------------------------------------------------------------------------
# exclusive claims: 8 concurrent claimers, 10,000 events
# --------------------------------------------------------------------------------------------

def test_concurrent_claimers_never_share_an_event(dsn: str, conn: Conn) -> None:
    total, workers, batch = 10_000, 8, 50
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', g::text, 'created', jsonb_build_object('n', g) FROM generate_series(1, %s) g",
                 (total,))
    start = threading.Barrier(workers)
    deadline = time.monotonic() + 60

    def worker(n: int) -> list[int]:
        received: list[int] = []
        with psycopg.connect(dsn, autocommit=True) as c:
            start.wait(timeout=30)
            while time.monotonic() < deadline:
                rows = claim(c, batch, lease="5 minutes", worker=f"w{n}")
                if not rows:
                    # empty: done, unless a concurrent claim held candidates locked (SKIP LOCKED)
                    if c.execute("SELECT count(*) FROM outbox WHERE state = 'pending'").fetchone() == (0,):
                        return received
                    continue
                ids = [r["id"] for r in rows]
                assert len({r["lease_token"] for r in rows}) == 1
                received.extend(ids)
                assert complete(c, ids, rows[0]["lease_token"]) == len(ids)
        raise AssertionError(f"worker {n} did not finish in time")

    with ThreadPoolExecutor(workers) as pool:
        per_worker = [f.result(timeout=90) for f in [pool.submit(worker, n) for n in range(workers)]]

    everything = [i for ids in per_worker for i in ids]
    assert len(everything) == total
    assert len(set(everything)) == total, "an event was handed out twice"
    all_ids = {r[0] for r in conn.execute("SELECT id FROM outbox").fetchall()}
    assert set(everything) == all_ids
    assert states(conn) == {"published": total}
    assert conn.execute("SELECT min(attempts), max(attempts) FROM outbox").fetchone() == (1, 1)
    assert sum(1 for ids in per_worker if ids) >= 2, "the claims were not concurrent at all"


# --------------------------------------------------------------------------------------------
# per-aggregate order under concurrent claimers with failures
# --------------------------------------------------------------------------------------------

def test_concurrent_claimers_keep_per_aggregate_order(dsn: str, conn: Conn) -> None:
    aggregates, per_aggregate, workers, batch = 100, 30, 4, 20
    set_settings(conn, backoff_base="1 millisecond", backoff_cap="4 milliseconds", max_attempts=1000)
    rng = random.Random(20240601)
    sequence = [f"agg-{a}" for a in range(aggregates) for _ in range(per_aggregate)]
    rng.shuffle(sequence)
    insert_series(conn, sequence)
    rows = conn.execute("SELECT id, aggregate_id FROM outbox ORDER BY id").fetchall()
    assert [a for _, a in rows] == sequence
    by_aggregate: dict[str, list[int]] = defaultdict(list)
    for i, a in rows:
        by_aggregate[a].append(i)
    earlier = {i: ids[:k] for ids in by_aggregate.values() for k, i in enumerate(ids)}
    total = len(rows)

    lock = threading.Lock()
    completing: set[int] = set()   # events whose outbox_complete was called (recorded before the call)
    held: set[int] = set()         # events handed out and not yet reported
    violations: list[str] = []
    counters = {"claims": 0, "fails": 0, "completes": 0}
    deadline = time.monotonic() + 60

    def worker(n: int) -> None:
        wrng = random.Random(1000 + n)
        with psycopg.connect(dsn, autocommit=True) as c:
            while time.monotonic() < deadline:
                rows = claim(c, batch, lease="5 minutes", worker=f"w{n}")
                with lock:
                    counters["claims"] += 1
                    in_batch = {r["id"] for r in rows}   # a run: its earlier events come in the same batch
                    for r in rows:
                        i = r["id"]
                        missing = [e for e in earlier[i] if e not in completing and e not in in_batch]
                        if missing:
                            violations.append(f"{i} handed out before earlier {missing} of {r['aggregate_id']}")
                        if i in completing or i in held:
                            violations.append(f"{i} handed out again (completing={i in completing})")
                        held.add(i)
                    if not rows and len(completing) == total:
                        return
                if not rows:
                    time.sleep(0.001)
                    continue
                token = rows[0]["lease_token"]
                done: list[int] = []
                # A run (events of one aggregate, id order) as a worker reports it: the
                # published prefix completed, the first failure failed, the rest released.
                runs: dict[str, list[int]] = defaultdict(list)
                for r in rows:
                    runs[r["aggregate_id"]].append(r["id"])
                for run in runs.values():
                    assert run == sorted(run)
                    for k, i in enumerate(run):
                        if wrng.random() < 0.25:
                            with lock:
                                held.difference_update(run[k:])
                                counters["fails"] += 1
                            assert fail(c, i, token, "random failure") == "pending"
                            if run[k + 1:]:
                                assert release(c, run[k + 1:], token) == len(run[k + 1:])
                            break
                        done.append(i)
                with lock:
                    completing.update(done)
                    held.difference_update(done)
                    counters["completes"] += len(done)
                if done:
                    assert complete(c, done, token) == len(done)
        raise AssertionError(f"worker {n} did not finish in time")

    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(worker, n) for n in range(workers)]:
            f.result(timeout=90)

    assert violations == []
    assert counters["completes"] == total
    assert counters["fails"] > 100, counters  # the retries were exercised
    assert states(conn) == {"published": total}
    # in the table too: per aggregate, events were published in id order
    unordered = conn.execute(
        "SELECT count(*) FROM (SELECT published_at < lag(published_at) OVER (PARTITION BY aggregate_id ORDER BY id) "
        "AS backwards FROM outbox) s WHERE backwards").fetchone()
    assert unordered == (0,)
    assert conn.execute("SELECT max(attempts) > 1 FROM outbox").fetchone() == (True,)


# --------------------------------------------------------------------------------------------
# wakeup protocol: NOTIFY only while a worker is idle
# --------------------------------------------------------------------------------------------

@pytest.fixture
def listener(dsn: str) -> Any:
    with Listener(dsn) as lst:
        yield lst


def _trigger_calls_in_transaction(conn: Conn) -> int:
    row = conn.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions "
                       "WHERE funcname = 'outbox_wake_workers'").fetchone()
    assert row is not None
    return int(row[0])


def test_no_notify_without_an_idle_worker(conn: Conn, listener: Listener) -> None:
    insert(conn)
    insert_series(conn, ["a", "b", "c"])
    assert listener.collect() == []


def test_notify_once_per_statement_while_a_worker_is_idle(dsn: str, conn: Conn, listener: Listener) -> None:
    with connect(dsn) as idle:
        idle.execute("SELECT outbox_worker_idle()")

        insert(conn)
        assert listener.collect() == [""]
        insert_series(conn, [str(i) for i in range(500)])  # one 500-row statement
        assert listener.collect() == [""]
        for k in range(3):                                 # three transactions
            insert(conn, aggregate_id=f"t{k}")
        assert listener.collect() == ["", "", ""]

        # the trigger runs once per statement, not per row (identical notifications of one
        # transaction are folded into one by PostgreSQL, so count the trigger calls)
        with connect(dsn, autocommit=False) as producer:
            producer.execute("SET LOCAL track_functions = 'pl'")
            insert_series(producer, [str(i) for i in range(300)])
            assert _trigger_calls_in_transaction(producer) == 1
            insert(producer, aggregate_id="x")
            insert_series(producer, ["y", "z"])
            assert _trigger_calls_in_transaction(producer) == 3
            producer.commit()
        assert listener.collect() == [""]

        # a rolled-back insert notifies nobody
        with connect(dsn, autocommit=False) as producer:
            insert(producer, aggregate_id="gone")
            producer.rollback()
        assert listener.collect() == []

        assert idle.execute("SELECT outbox_worker_busy()").fetchone() == (True,)
        insert(conn, aggregate_id="after-busy")
        insert_series(conn, ["p", "q"])
        assert listener.collect() == []

        # idle again: notified again
        idle.execute("SELECT outbox_worker_idle()")
        insert(conn, aggregate_id="again")
        assert listener.collect() == [""]
    # the idle session ended: its session lock is gone (once its backend has exited, which
    # closing the connection does not wait for), nobody is notified
    deadline = time.monotonic() + 10
    while conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
                       "AND objid = %s", WAKEUP_LOCK).fetchone()[0]:
        assert time.monotonic() < deadline, "the closed session's lock was never released"
        time.sleep(0.01)
    insert(conn, aggregate_id="closed")
    assert listener.collect() == []


def test_two_idle_workers_one_notification_per_insert(dsn: str, conn: Conn, listener: Listener) -> None:
    with connect(dsn) as idle1, connect(dsn) as idle2:
        idle1.execute("SELECT outbox_worker_idle()")
        pid2 = idle2.info.backend_pid
        # a second worker wanting to sleep waits for the first to wake (exclusive lock)
        waiter = Background(lambda: idle2.execute("SELECT outbox_worker_idle()"))
        waiter.start()
        wait_until(lambda: waiting_for_advisory_lock(conn, pid2), timeout=10,
                   message="the second worker to queue for the wakeup lock")
        insert(conn)
        assert listener.collect() == [""]
        idle1.execute("SELECT outbox_worker_busy()")
        waiter.result(timeout=15)
        insert(conn, aggregate_id="2")
        assert listener.collect() == [""]
        idle2.execute("SELECT outbox_worker_busy()")
        insert(conn, aggregate_id="3")
        assert listener.collect() == []


def test_worker_idle_waits_for_producers_that_skipped_the_notify(dsn: str, conn: Conn, listener: Listener) -> None:
    with connect(dsn, autocommit=False) as producer, connect(dsn) as worker:
        # no worker idle: the producer's insert does not NOTIFY, and holds the lock shared
        i = insert(producer, aggregate_id="late")
        pid = worker.info.backend_pid
        going_idle = Background(lambda: worker.execute("SELECT outbox_worker_idle()"))
        going_idle.start()
        wait_until(lambda: waiting_for_advisory_lock(conn, pid), timeout=10,
                   message="outbox_worker_idle() to wait for the producer")
        time.sleep(0.05)
        assert going_idle.is_alive(), "outbox_worker_idle() returned while the producer was still open"

        producer.commit()
        going_idle.result(timeout=15)
        # once idle() returned, the producer's event is visible to the worker's claim
        assert [r["id"] for r in claim(worker, 10)] == [i]
        # the producer committed without a NOTIFY: the worker learnt of it through the wait
        assert listener.collect() == []

        # from now on the worker is idle: a new producer notifies
        insert(conn, aggregate_id="next")
        assert listener.collect() == [""]
        worker.execute("SELECT outbox_worker_busy()")


def test_worker_idle_also_returns_when_the_producer_rolls_back(dsn: str, conn: Conn) -> None:
    with connect(dsn, autocommit=False) as producer, connect(dsn) as worker:
        insert(producer)
        pid = worker.info.backend_pid
        going_idle = Background(lambda: worker.execute("SELECT outbox_worker_idle()"))
        going_idle.start()
        wait_until(lambda: waiting_for_advisory_lock(conn, pid), timeout=10,
                   message="outbox_worker_idle() to wait for the producer")
        producer.rollback()
        going_idle.result(timeout=15)
        assert claim(worker, 10) == []
