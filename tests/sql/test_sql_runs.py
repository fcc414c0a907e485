"""Ordered runs (migrations/0005_outbox_claim.sql): a claim hands out up to max_run
consecutive events of one aggregate under one lease, at most one run per aggregate in flight,
and its cost follows what it hands out, not the backlog."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from typing import Any

import psycopg
import pytest
from helpers import claim, complete, event, fail, insert_series, make_due, release, requeue, set_settings, states
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

Conn = psycopg.Connection[Any]


def ids_of(rows: list[dict[str, Any]]) -> list[int]:
    return [r["id"] for r in rows]


def test_a_claim_hands_out_runs_in_id_order_up_to_max_run(conn: Conn) -> None:
    set_settings(conn, max_run=3)
    a1, b1, a2, a3, b2, a4 = insert_series(conn, ["a", "b", "a", "a", "b", "a"])
    rows = claim(conn, 10)
    assert ids_of(rows) == [a1, b1, a2, a3, b2]           # rows in id order; a4 is past max_run
    assert len({r["lease_token"] for r in rows}) == 1
    assert claim(conn, 10) == []                          # one run per aggregate in flight
    assert complete(conn, [a1, a2, a3], rows[0]["lease_token"]) == 3
    assert ids_of(claim(conn, 10)) == [a4]


def test_the_batch_size_cuts_the_runs_to_prefixes(conn: Conn) -> None:
    """The batch is shared among the heads in front (fair shares, the first ones taking the
    remainder); each run is the prefix of its aggregate's line. One head alone is cut once."""
    set_settings(conn, max_run=3)
    ids = insert_series(conn, ["a"] * 3 + ["b"] * 3 + ["c"] * 3)
    rows = claim(conn, 5)
    by: dict[str, list[int]] = defaultdict(list)
    for r in rows:
        by[r["aggregate_id"]].append(r["id"])
    assert {a: len(v) for a, v in by.items()} == {"a": 2, "b": 2, "c": 1}
    for run in by.values():
        start = ids.index(run[0])
        assert run == ids[start:start + len(run)]
    conn.execute("TRUNCATE outbox, outbox_heads")
    ids = insert_series(conn, ["d"] * 3)
    assert [r["id"] for r in claim(conn, 2)] == ids[:2]


def test_a_partly_published_run_is_reported_prefix_failure_rest(conn: Conn) -> None:
    """The documented way for a worker in any language: complete the published prefix, fail the
    first failure, release the rest. The next claim starts at the failed event."""
    e1, e2, e3, e4, e5 = insert_series(conn, ["a"] * 5)
    rows = claim(conn, 10)
    token = rows[0]["lease_token"]
    assert ids_of(rows) == [e1, e2, e3, e4, e5]
    assert complete(conn, [e1, e2], token) == 2
    assert fail(conn, e3, token, "no ack within 5 s") == "pending"
    assert release(conn, [e4, e5], token) == 2
    assert claim(conn, 10) == []                          # e3 waits for its backoff, e4 and e5 behind it
    assert [event(conn, i)["attempts"] for i in (e3, e4, e5)] == [1, 0, 0]
    make_due(conn, [e3])
    rows = claim(conn, 10)
    assert ids_of(rows) == [e3, e4, e5]
    assert [r["attempts"] for r in rows] == [2, 1, 1]


def test_a_dead_event_in_the_middle_of_a_run_holds_back_only_its_aggregate(conn: Conn) -> None:
    a1, a2, b1, a3, b2 = insert_series(conn, ["a", "a", "b", "a", "b"])
    rows = claim(conn, 10)
    token = rows[0]["lease_token"]
    assert complete(conn, [a1, b1, b2], token) == 3
    assert fail(conn, a2, token, "payload over max_payload", permanent=True) == "dead"
    assert release(conn, [a3], token) == 1
    (b3,) = insert_series(conn, ["b"])
    assert ids_of(claim(conn, 10)) == [b3]                # b flows, a waits behind its dead letter
    assert event(conn, a3)["state"] == "pending"
    assert requeue(conn, [a2]) == 1
    assert ids_of(claim(conn, 10)) == [a2, a3]            # in order again


def test_an_expired_run_costs_its_first_event_one_attempt_and_fences_every_event(conn: Conn) -> None:
    e1, e2, e3 = insert_series(conn, ["a"] * 3)
    old = claim(conn, 10, lease="50 milliseconds", worker="hung")
    assert ids_of(old) == [e1, e2, e3]
    time.sleep(0.1)
    assert claim(conn, 10) == []                          # reclaimed: e1 waits for its retry
    got = {i: event(conn, i) for i in (e1, e2, e3)}
    assert [got[i]["attempts"] for i in (e1, e2, e3)] == [1, 0, 0]
    assert all(g["state"] == "pending" and g["lease_token"] is None for g in got.values())
    assert "lease expired" in got[e1]["last_error"] and got[e2]["last_error"] is None
    token = old[0]["lease_token"]                          # the hung worker reports late
    assert complete(conn, [e1, e2, e3], token) == 0
    assert fail(conn, e2, token, "late") is None
    assert release(conn, [e3], token) == 0
    make_due(conn, [e1])
    rows = claim(conn, 10)
    assert ids_of(rows) == [e1, e2, e3] and [r["attempts"] for r in rows] == [2, 1, 1]


def test_a_run_reported_failure_first_leaves_nothing_stranded(conn: Conn) -> None:
    """A worker may report a run's failure before its published prefix: the failed and released
    events must still come back once the prefix is complete."""
    a1, a2, a3 = insert_series(conn, ["a", "a", "a"])
    rows = claim(conn, 10)
    token = rows[0]["lease_token"]
    assert ids_of(rows) == [a1, a2, a3]
    assert fail(conn, a2, token, "no ack") == "pending"
    assert release(conn, [a3], token) == 1
    assert claim(conn, 10) == []                          # a1 still out
    assert complete(conn, [a1], token) == 1
    skip_backoff(conn, [a2])                              # (make_due would repair a missing head)
    rows = claim(conn, 10)
    assert ids_of(rows) == [a2, a3] and [r["attempts"] for r in rows] == [2, 1]


def outbox_rows_read(conn: Conn) -> int:
    """Rows of the outbox partitions this transaction fetched so far (index and sequential)."""
    row = conn.execute(
        "SELECT coalesce(sum(coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0)), 0) "
        "FROM pg_stat_xact_user_tables WHERE relid IN (SELECT inhrelid FROM pg_inherits "
        "WHERE inhparent = 'outbox'::regclass)").fetchone()
    assert row is not None
    return int(row[0])


def test_claim_cost_follows_what_it_hands_out_not_the_backlog(dsn: str, conn: Conn) -> None:
    """20,000 pending events of 10 aggregates: a claim reads its runs (and the intake of new
    events, once); an empty claim reads no event at all, however deep the backlog."""
    set_settings(conn, max_run=10)
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', 'o' || (i % 10), 'e', '{}' FROM generate_series(1, 20000) i")
    for _ in range(45):                                   # the intake catches up (500 events per claim)
        rows = claim(conn, 1)
        release(conn, ids_of(rows), rows[0]["lease_token"])
    assert conn.execute("SELECT intake_id FROM outbox_intake").fetchone()[0] == 20000
    # Fresh sessions: a backend's statistics not yet flushed would count earlier transactions too.
    with psycopg.connect(dsn) as c:
        rows = claim(c, 100)
        read = outbox_rows_read(c)
    assert len(rows) == 100
    # Each head's line is read twice (as is, locked), and the first 11 events of each busy head
    # at the front once (whether more than a quiet head's share wait).
    assert read <= 2 * 100 + 10 * 11, read
    with psycopg.connect(dsn) as c:
        assert claim(c, 100) == []                        # all ten aggregates are in flight
        assert outbox_rows_read(c) == 0


def test_concurrent_claimers_over_mixed_key_distributions(dsn: str, conn: Conn) -> None:
    """8 claimers, a uniform, a hot and a Zipf-like aggregate mix, random failures reported by
    the run contract: every event published exactly once, in id order per aggregate."""
    set_settings(conn, backoff_base="1 millisecond", backoff_cap="2 milliseconds", max_attempts=1000, max_run=20)
    rnd = random.Random(7)
    keys = ([f"u{i}" for i in range(300)] + ["hot"] * 300
            + [f"z{min(int(rnd.paretovariate(1.1)), 50)}" for _ in range(300)])
    rnd.shuffle(keys)
    insert_series(conn, keys)
    order = {r[0]: r[1] for r in conn.execute("SELECT id, aggregate_id FROM outbox").fetchall()}
    published: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    deadline = time.monotonic() + 60

    def work(n: int) -> None:
        wr = random.Random(n)
        try:
            with psycopg.connect(dsn, autocommit=True) as c:
                while time.monotonic() < deadline:
                    rows = claim(c, 50)
                    if not rows:
                        with lock:
                            if len(published) == len(order):
                                return
                        time.sleep(0.002)
                        continue
                    token = rows[0]["lease_token"]
                    runs: dict[str, list[int]] = defaultdict(list)
                    for r in rows:
                        runs[r["aggregate_id"]].append(r["id"])
                    done: list[int] = []
                    for run in runs.values():
                        for k, i in enumerate(run):
                            if wr.random() < 0.1:
                                assert fail(c, i, token, "flaky") == "pending"
                                if run[k + 1:]:
                                    assert release(c, run[k + 1:], token) == len(run) - k - 1
                                break
                            done.append(i)
                    with lock:                              # "published" before the report, as a worker does
                        published.extend(done)
                    if done:
                        assert complete(c, done, token) == len(done)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert sorted(published) == sorted(order), "an event was lost or published twice"
    per: dict[str, list[int]] = defaultdict(list)
    for i in published:
        per[order[i]].append(i)
    assert all(v == sorted(v) for v in per.values())
    assert states(conn) == {"published": len(order)}
    # Every line is empty: no head is left but those parked, for a second, by busy aggregates.
    assert conn.execute("SELECT count(*) FROM outbox_heads WHERE NOT parked").fetchone()[0] == 0


# -- a model of runs (hypothesis, stateful) ---------------------------------------------------

def skip_backoff(conn: Conn, ids: list[int]) -> None:
    """make_due without outbox_refresh_heads (which would also repair a missing head): the events
    and the heads that exist become due, nothing else changes."""
    conn.execute("WITH due AS (UPDATE outbox SET next_attempt_at = clock_timestamp() WHERE id = ANY(%s) "
                 "AND state = 'pending' RETURNING aggregate_type, aggregate_id) "
                 "UPDATE outbox_heads h SET ready_at = clock_timestamp() FROM due "
                 "WHERE h.aggregate_type = due.aggregate_type AND h.aggregate_id = due.aggregate_id "
                 "AND h.ready_at > clock_timestamp()", (ids,))


class RunModel(RuleBasedStateMachine):
    """Random inserts, claims, reports by the run contract (complete a prefix, fail one, release
    the rest), permanent failures, requeues and lease losses, checked against a model: what a
    claim hands out of an aggregate is always the next events after what was published, in id
    order, and never while another run of it is out."""

    conn: Conn

    def __init__(self) -> None:
        super().__init__()
        self.conn.execute("TRUNCATE outbox")                   # and with it outbox_heads
        set_settings(self.conn, max_run=3, max_attempts=100)
        self.unfinished: dict[str, list[int]] = defaultdict(list)   # model: per aggregate, in id order
        self.out: dict[int, Any] = {}                              # leased id -> token
        self.dead: set[int] = set()

    @rule(agg=st.sampled_from("abc"), n=st.integers(1, 3))
    def insert(self, agg: str, n: int) -> None:
        self.unfinished[agg].extend(insert_series(self.conn, [agg] * n))

    @rule(n=st.integers(1, 6))
    def claim_some(self, n: int) -> None:
        rows = claim(self.conn, n)
        heads = dict(self.conn.execute("SELECT aggregate_id, parked FROM outbox_heads").fetchall())
        # After the intake every aggregate with events has a head in the running (a parked one is
        # brought back); a parked head is one whose aggregate has none.
        assert {a for a, parked in heads.items() if not parked} == {a for a, line in self.unfinished.items() if line}
        runs: dict[str, list[int]] = defaultdict(list)
        for r in rows:
            runs[r["aggregate_id"]].append(r["id"])
        for agg, run in runs.items():
            line = self.unfinished[agg]
            assert not any(i in self.out for i in line), f"a second run of {agg} while one is out"
            assert not any(i in self.dead for i in line[:len(run)])
            assert run == line[:len(run)], (agg, run, line)
            assert len(run) <= 3
            for i in run:
                self.out[i] = rows[0]["lease_token"]

    @precondition(lambda self: bool(self.out))
    @rule(data=st.data(), permanent=st.booleans())
    def report(self, data: st.DataObject, permanent: bool) -> None:
        # Leases in the order of their first event (tokens are random: never draw from them).
        firsts = sorted({min(i for i, t in self.out.items() if t == tok) for tok in self.out.values()})
        held_first = data.draw(st.sampled_from(firsts))
        token = self.out[held_first]
        held = sorted(i for i, t in self.out.items() if t == token)
        runs: dict[str, list[int]] = defaultdict(list)
        for agg, line in self.unfinished.items():
            runs[agg] = [i for i in line if i in held]
        tok = self.out[held[0]]
        for agg, run in runs.items():
            if not run:
                continue
            k = data.draw(st.integers(0, len(run)))       # how many were published
            # A worker may report the failure before the published prefix (any order is allowed).
            failure_first = data.draw(st.booleans())
            if run[:k] and not failure_first:
                assert complete(self.conn, run[:k], tok) == k
                del self.unfinished[agg][:k]
            if k < len(run):
                state = fail(self.conn, run[k], tok, "x", permanent=permanent)
                assert state == ("dead" if permanent else "pending")
                if permanent:
                    self.dead.add(run[k])
                else:
                    skip_backoff(self.conn, [run[k]])
                if run[k + 1:]:
                    assert release(self.conn, run[k + 1:], tok) == len(run) - k - 1
            if run[:k] and failure_first:
                assert complete(self.conn, run[:k], tok) == k
                del self.unfinished[agg][:k]
            for i in run:
                del self.out[i]

    @precondition(lambda self: bool(self.dead))
    @rule()
    def requeue_dead(self) -> None:
        assert requeue(self.conn, sorted(self.dead)) == len(self.dead)
        self.dead.clear()

    def teardown(self) -> None:
        # Nothing is stranded: with what is out handed back, the dead requeued and every retry
        # due, claims hand out every unfinished event again, as the next of its line.
        for tok in set(self.out.values()):
            held = [i for i, t in self.out.items() if t == tok]
            assert release(self.conn, held, tok) == len(held)
        self.out.clear()
        if self.dead:
            assert requeue(self.conn, sorted(self.dead)) == len(self.dead)
            self.dead.clear()
        waiting = [i for line in self.unfinished.values() for i in line]
        if waiting:
            skip_backoff(self.conn, waiting)
        for _ in range(100):
            rows = claim(self.conn, 5)
            if not rows:
                break
            for r in rows:
                line = self.unfinished[r["aggregate_id"]]
                assert line and line[0] == r["id"], (r["aggregate_id"], r["id"], line)
                del line[0]
            assert complete(self.conn, ids_of(rows), rows[0]["lease_token"]) == len(rows)
        assert not any(self.unfinished.values()), dict(self.unfinished)

    @invariant()
    def heads_match_the_model(self) -> None:
        # New events get their heads at the next claim's intake: a head never outlives its line,
        # but parked, no claim's candidate.
        heads = {r[0] for r in self.conn.execute("SELECT aggregate_id FROM outbox_heads WHERE NOT parked").fetchall()}
        assert heads <= {a for a, line in self.unfinished.items() if line}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_run_model(conn: Conn) -> None:
    from hypothesis import settings

    RunModel.conn = conn
    RunModel.TestCase.settings = settings(max_examples=150, stateful_step_count=25, deadline=None)
    RunModel.TestCase().runTest()


def test_next_wakeup_says_now_for_a_head_that_just_came_due(dsn: str, conn: Conn) -> None:
    """A retry that comes due between a worker's last claim and its outbox_next_wakeup() call
    must not let the worker sleep until the fallback poll; a head held back by an open producer
    must not wake it at once."""
    (a,) = insert_series(conn, ["a"])
    (row,) = claim(conn, 10)
    assert fail(conn, a, row["lease_token"], "x") == "pending"
    retry = conn.execute("SELECT ready_at FROM outbox_heads").fetchone()[0]
    assert conn.execute("SELECT outbox_next_wakeup()").fetchone()[0] == retry    # in the future
    make_due(conn, [a])
    due = conn.execute("SELECT outbox_next_wakeup() <= clock_timestamp()").fetchone()[0]
    assert due is True                                                       # came due: claim now
    with psycopg.connect(dsn) as producer:                                   # holds aggregate b
        producer.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                         "VALUES ('order', 'b', 'e', '{}')")
        insert_series(conn, ["b"])
        assert ids_of(claim(conn, 10)) == [a]                                # b's head is held
        assert conn.execute("SELECT outbox_next_wakeup()").fetchone()[0] > conn.execute(
            "SELECT clock_timestamp()").fetchone()[0]                        # a's lease, not b
        producer.rollback()
