"""The intake locks the heads that exist among the aggregates it takes in against reports (a
report about to drop or park one waits, and then sees the new events), not against claims: the
other claims go on taking those heads while the claim that takes in is still running. Behind a
backlog of a few aggregates, every chunk the intake reads holds all of them; a lock that kept
claims out (an ON CONFLICT update's) left every other claim empty-handed until the one taking in
committed."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from helpers import claim, claim_ids, complete, connect, insert

Conn = psycopg.Connection[Any]


def backlog(conn: Conn, n: int, aggregates: int, start: int = 1) -> None:
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', 'agg-' || (g %% %s), 'updated', '{}' FROM generate_series(%s::integer, %s::integer) g",
                 (aggregates, start, start + n - 1))


def cursor(conn: Conn) -> int:
    (value,) = conn.execute("SELECT intake_id FROM outbox_intake").fetchone()  # type: ignore[misc]
    return int(value)


def test_a_claim_beside_an_intake_takes_the_heads_the_intake_did_not_lease(dsn: str, conn: Conn) -> None:
    """Two claims at once behind a backlog of 40 aggregates: the first takes in a chunk holding
    all 40 (their heads exist) and leases 16 of them; the second, while the first is still
    open, leases others."""
    backlog(conn, 1_500, aggregates=40)                 # claim(100) reads chunks of 500
    first = claim(conn, 100)                             # the heads are made, the cursor moves
    for token in {r["lease_token"] for r in first}:
        complete(conn, [r["id"] for r in first if r["lease_token"] == token], token)
    taken_in = cursor(conn)
    assert taken_in == 500
    with connect(dsn, autocommit=False) as a, connect(dsn, lock_timeout="2s") as b:
        got_a = claim(a, 100)                            # takes in ids 501-1000: every aggregate
        got_b = claim(b, 100)                            # the intake row is a's: b takes in nothing
        assert cursor(b) == taken_in                     # a's intake is not committed yet
        a.commit()
    assert cursor(conn) > taken_in                       # a did take the chunk in
    assert len(got_a) == 100
    assert len(got_b) > 0, "every head was locked by the other claim's intake"
    assert not {r["aggregate_id"] for r in got_a} & {r["aggregate_id"] for r in got_b}


def test_a_claim_beside_an_intake_in_a_flow_takes_the_heads_of_the_aggregates_it_takes_in(dsn: str, conn: Conn) -> None:
    """In a flow (the intake reads fewer events than its chunk), the aggregates of the new events
    that also had events just below the cursor are busy, and their heads exist: the intake locks
    them against reports, not against claims. A second claim while the first is open takes the
    heads the first did not lease, where a lock that kept claims out sent it back empty (after
    waiting for the intake, a second in all), and a worker of a shard went to sleep with its
    shard's heads due."""
    conn.execute("UPDATE outbox_settings SET max_run = 1")
    backlog(conn, 80, aggregates=40)                     # two events of each of 40 aggregates
    first = claim(conn, 100)                             # takes all 80 in, leases the first of each
    assert len(first) == 40
    assert complete(conn, [r["id"] for r in first], first[0]["lease_token"]) == 40
    backlog(conn, 40, aggregates=40, start=81)           # one new event each: a flow, below a chunk
    with connect(dsn, autocommit=False) as a, connect(dsn, lock_timeout="2s") as b:
        got_a = claim(a, 1)                              # takes the 40 new events in, leases one head
        started = time.monotonic()
        got_b = claim(b, 100)
        took = time.monotonic() - started
        a.commit()
    assert len(got_a) == 1
    assert len(got_b) == 39, "the other claim's intake kept the heads it took in from this claim"
    assert took < 0.9, f"the claim waited {took:.1f}s for the intake"
    assert not {r["aggregate_id"] for r in got_a} & {r["aggregate_id"] for r in got_b}


def test_the_intake_still_holds_back_a_report_on_a_head_it_took_in(dsn: str, conn: Conn) -> None:
    """What a report does first (outbox_refresh_heads: its heads FOR UPDATE) waits for the claim
    that took in new events of the aggregate, so that it sees them before it drops the head."""
    backlog(conn, 1_500, aggregates=40)
    claim_ids(conn, 100)
    with connect(dsn, autocommit=False) as a, connect(dsn, autocommit=False, lock_timeout="200ms") as report:
        leased = {r["aggregate_id"] for r in claim(a, 100)}
        other = next(f"agg-{i}" for i in range(40) if f"agg-{i}" not in leased)
        with pytest.raises(psycopg.errors.LockNotAvailable):
            report.execute("SELECT 1 FROM outbox_heads WHERE aggregate_type = 'order' AND aggregate_id = %s "
                           "FOR UPDATE", (other,))
        report.rollback()
        a.commit()


def test_a_head_to_bring_back_that_another_holds_is_not_waited_for(dsn: str, conn: Conn) -> None:
    """A parked head among a full chunk's aggregates, locked by another transaction: the intake
    does not wait for it, and the cursor stays below its aggregate's event, for the next intake,
    which brings the head back."""
    for _ in range(4):
        insert(conn, "order", "busy")
    for _ in range(4):                                   # moved on 3 times, then its line runs empty
        (row,) = claim(conn, 1)
        assert complete(conn, [row["id"]], row["lease_token"]) == 1
    assert conn.execute("SELECT parked FROM outbox_heads WHERE aggregate_id = 'busy'").fetchone() == (True,)
    event = insert(conn, "order", "busy")
    backlog(conn, 600, aggregates=600)                   # a full chunk (500) from the busy event on
    with connect(dsn, autocommit=False) as holder, connect(dsn, lock_timeout="1s") as worker:
        holder.execute("SELECT 1 FROM outbox_heads WHERE aggregate_id = 'busy' FOR NO KEY UPDATE")
        ids = claim_ids(worker, 100)                     # no wait: no lock_timeout error
        assert event not in ids
        assert cursor(conn) < event
        holder.rollback()
    got: list[int] = []
    for _ in range(20):                                  # claims of 100 over 601 aggregates
        got += claim_ids(conn, 100)
        if event in got:
            break
    assert event in got


def waiting_for_a_lock(conn: Conn, pid: int) -> bool:
    row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == "Lock"


def claim_beside_an_intake(dsn: str, conn: Conn) -> list[dict[str, Any]]:
    """A claim of 1 that takes the new events in, left open; a claim of 100 beside it, until it
    returns or waits for a lock; then the first commits. The second claim's rows."""
    with connect(dsn, autocommit=False) as a, connect(dsn) as b, ThreadPoolExecutor(1) as pool:
        assert len(claim(a, 1)) == 1                     # the intake row is a's until it commits
        later = pool.submit(claim, b, 100)
        deadline = time.monotonic() + 10
        while not later.done() and not waiting_for_a_lock(conn, b.info.backend_pid):
            assert time.monotonic() < deadline, "the second claim neither returned nor waited"
            time.sleep(0.01)
        a.commit()
        return later.result(10)


def test_a_claim_that_finds_nothing_due_waits_for_the_intake_in_progress(dsn: str, conn: Conn) -> None:
    """A burst of 40 new aggregates, no head yet. The first claim takes all of them in and leases
    one; a second claim at the same time finds no head (the first one's are not committed). It
    waits for the first to end and takes the other 39, where coming back empty would send its
    worker to sleep until a notification that the burst has already spent (a caller of another
    language, until its next poll) while the heads it could take came due a moment later."""
    backlog(conn, 40, aggregates=40)
    got = claim_beside_an_intake(dsn, conn)
    assert len(got) == 39, "the second claim came back without waiting for the heads being made"


def test_the_wait_for_an_intake_held_open_is_bounded(dsn: str, conn: Conn) -> None:
    """A claim left open in a session (a user trying outbox_claim in psql) holds the intake row:
    a claim that finds nothing due waits for it one second, then comes back empty as before."""
    backlog(conn, 40, aggregates=40)
    with connect(dsn, autocommit=False) as a, connect(dsn) as b:
        claim(a, 1)
        started = time.monotonic()
        assert claim(b, 100) == []
        waited = time.monotonic() - started
        a.rollback()
    assert 0.9 <= waited < 10


def test_a_claim_left_idle_in_its_transaction_is_ended_after_its_lease(dsn: str, conn: Conn) -> None:
    """A claim in a transaction left idle (psql after BEGIN, a driver that does not autocommit, a
    worker hung between its claim and its commit) holds the intake row, and the heads it made
    are invisible to every other claim: every event, of every aggregate, waited for that
    session, however long. The server ends such a transaction once it has been idle for its
    lease; the claim is undone, and the other claims take everything."""
    backlog(conn, 5, aggregates=5)
    with connect(dsn, autocommit=False) as a:
        assert len(claim(a, 1, lease="2 seconds")) == 1
        backlog(conn, 5, aggregates=5, start=100)
        assert claim(conn, 100) == []                    # held back: waits a second, takes nothing
        time.sleep(2.5)
        with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):
            a.execute("SELECT 1")
    assert len(claim(conn, 100)) == 10


def test_a_claim_keeps_a_shorter_idle_timeout_of_its_session(dsn: str, conn: Conn) -> None:
    """A session's own idle_in_transaction_session_timeout, when shorter than the lease, stays;
    a claim in autocommit changes nothing of the session."""
    backlog(conn, 5, aggregates=5)
    with connect(dsn, autocommit=False) as a:
        a.execute("SET idle_in_transaction_session_timeout = '1500ms'")
        a.commit()
        claim(a, 1, lease="1 hour")
        assert a.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("1500ms",)
        a.rollback()
    conn.execute("SET idle_in_transaction_session_timeout = 0")
    claim(conn, 1, lease="1 second")
    assert conn.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("0",)


def test_a_claim_under_repeatable_read_does_not_wait_for_the_intake(dsn: str, conn: Conn) -> None:
    """Under REPEATABLE READ a look after the wait would see the snapshot it had (and a lock on
    the intake row that changed since it began would fail): such a claim comes back empty at
    once, without an error."""
    backlog(conn, 40, aggregates=40)
    with connect(dsn, autocommit=False) as a, connect(dsn, autocommit=False) as b:
        claim(a, 1)
        b.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        started = time.monotonic()
        assert claim(b, 100) == []
        assert time.monotonic() - started < 0.9
        a.commit()
        b.commit()


def test_a_claim_waits_for_the_intake_behind_parked_heads(dsn: str, conn: Conn) -> None:
    """After a drain of busy aggregates their heads are parked at the front of the queue for a
    second. A burst of the same aggregates: the first claim brings their heads back and leases
    one; a second claim at the same time reads 16 parked heads in front and nothing else due. It
    waits for the first as well, and takes the other 19."""
    conn.execute("UPDATE outbox_settings SET max_run = 1")
    backlog(conn, 80, aggregates=20)
    for _ in range(4):                                   # moved on 3 times, then their lines run empty
        rows = claim(conn, 100)
        assert len(rows) == 20
        complete(conn, [r["id"] for r in rows], rows[0]["lease_token"])
    conn.execute("UPDATE outbox_settings SET max_run = DEFAULT")
    (parked,) = conn.execute("SELECT count(*) FILTER (WHERE parked) FROM outbox_heads").fetchone()  # type: ignore[misc]
    assert parked == 20
    backlog(conn, 20, aggregates=20)
    got = claim_beside_an_intake(dsn, conn)
    assert len(got) == 19, "the second claim came back without waiting for the heads being brought back"


def test_the_wait_stays_within_a_short_statement_timeout(dsn: str, conn: Conn) -> None:
    """A role or session with statement_timeout below the wait's second: the claim waits at most
    half of it, and comes back empty rather than cancelled."""
    backlog(conn, 40, aggregates=40)
    with connect(dsn, autocommit=False) as a, connect(dsn) as b:
        claim(a, 1)
        b.execute("SET statement_timeout = '600ms'")
        started = time.monotonic()
        assert claim(b, 100) == []
        waited = time.monotonic() - started
        assert b.execute("SHOW lock_timeout").fetchone() == ("10s",)     # the session's own again
        a.rollback()
    assert 0.25 <= waited < 10
