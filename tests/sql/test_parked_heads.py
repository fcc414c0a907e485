"""A busy aggregate's head is parked, not dropped, when its line runs empty, and the intake brings
it back. Dropped and made again between two events, under a held snapshot each new head would add
an entry of its key to outbox_heads_pkey, and the intake's INSERT ... ON CONFLICT would read them
all, from the oldest, on every event of the aggregate. The intake takes its locks in an order that
cannot deadlock with a report's."""

from __future__ import annotations

from typing import Any

import psycopg
from helpers import Background, claim, claim_ids, complete, connect, entries_read, heads_updates, insert, wait_until

Conn = psycopg.Connection[Any]


def head(conn: Conn, aggregate_id: str) -> dict[str, Any] | None:
    row = conn.execute(
        "SELECT head_id, opened_id, parked, ready_at, leased_until - clock_timestamp() AS left_ FROM outbox_heads "
        "WHERE aggregate_type = 'order' AND aggregate_id = %s", (aggregate_id,)).fetchone()
    if row is None:
        return None
    return dict(zip(("head_id", "opened_id", "parked", "ready_at", "left"), row, strict=True))


def one_run(conn: Conn) -> int:
    """Claims one event and completes it; returns its id."""
    (row,) = claim(conn, 1)
    assert complete(conn, [row["id"]], row["lease_token"]) == 1
    return int(row["id"])


def park_busy(conn: Conn, aggregate_id: str = "busy") -> None:
    """Four runs of one aggregate, its head moved on three times, its line empty after the
    fourth: its head is parked."""
    for _ in range(4):
        insert(conn, "order", aggregate_id)
    for _ in range(4):
        one_run(conn)


def test_a_busy_head_whose_line_runs_empty_is_parked_and_comes_back_with_hot_updates(conn: Conn) -> None:
    for _ in range(4):
        insert(conn, "order", "busy")
    for _ in range(3):
        one_run(conn)                                                # the head moved on 3 times
    (row,) = claim(conn, 1)
    ready = head(conn, "busy")
    assert ready is not None and not ready["parked"]
    conn.execute("BEGIN")
    before = heads_updates(conn)
    assert complete(conn, [row["id"]], row["lease_token"]) == 1      # its line is empty now
    after = heads_updates(conn)
    conn.execute("COMMIT")
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)    # parked: one HOT update
    parked = head(conn, "busy")
    assert parked is not None and parked["parked"]
    assert parked["ready_at"] == ready["ready_at"]                   # kept: no move in the index
    assert 0 < parked["left"].total_seconds() <= 1.0
    assert parked["head_id"] > row["id"]                             # above every finished event
    assert claim_ids(conn) == []                                     # no candidate

    third = insert(conn, "order", "busy")
    conn.execute("BEGIN")
    before = heads_updates(conn)
    (row,) = claim(conn, 10)
    after = heads_updates(conn)
    conn.execute("COMMIT")
    assert row["id"] == third
    # The intake brings it back and the claim leases it: two updates, both HOT (not a new head,
    # an insert, then the lease).
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)
    back = head(conn, "busy")
    assert back is not None and not back["parked"] and back["ready_at"] == ready["ready_at"]


def test_a_parked_head_whose_aggregate_paused_is_brought_back_by_the_insert(conn: Conn) -> None:
    """The intake looks up from the newest entry only the aggregates with an event just below its
    cursor; the others go to its insert, whose conflict update brings a parked head back too."""
    park_busy(conn)
    others = [insert(conn, "order", f"other-{i}") for i in range(120)]
    assert sorted(claim_ids(conn, 200)) == others                  # taken in: the cursor moves past them
    later = insert(conn, "order", "busy")
    conn.execute("BEGIN")
    before = heads_updates(conn)
    assert claim_ids(conn, 10) == [later]
    after = heads_updates(conn)
    conn.execute("COMMIT")
    back = head(conn, "busy")
    assert back is not None and not back["parked"]
    assert conn.execute("SELECT count(*) FROM outbox_heads WHERE aggregate_id = 'busy'").fetchone() == (1,)
    # Brought back and leased: HOT both.
    assert after[0] - before[0] == after[1] - before[1] >= 2


def test_a_head_moved_on_fewer_than_3_times_is_dropped(conn: Conn) -> None:
    """An aggregate with an event now and then, or a short burst, leaves no parked head."""
    insert(conn, "order", "once")
    one_run(conn)
    assert head(conn, "once") is None
    for _ in range(3):
        insert(conn, "order", "burst")
    for _ in range(3):
        one_run(conn)                                                # moved on twice
    assert head(conn, "burst") is None


def test_under_a_held_snapshot_a_busy_key_stops_gaining_entries(
        dsn: str, conn: Conn) -> None:
    with connect(dsn, autocommit=False) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox").fetchone()     # the snapshot is taken
        insert(conn, "order", "busy")
        for _ in range(200):
            insert(conn, "order", "busy")                             # its line never empty here
            one_run(conn)
        # 200 times: the line runs empty, the next event comes.
        one_run(conn)
        for _ in range(200):
            insert(conn, "order", "busy")
            one_run(conn)
        insert(conn, "order", "busy")
        reads, ids = entries_read(conn, "outbox_heads_pkey", lambda: claim_ids(conn, 10))
        holder.rollback()
    assert len(ids) == 1
    # Seen: 15 (an entry each time the head's page was full and its next version went to another
    # page). A head dropped and made again 200 times read 208: each new head an entry of its key,
    # all of which the intake's insert reads.
    assert reads <= 40, reads


def test_a_parked_head_whose_second_is_up_is_dropped_and_hides_no_due_event(conn: Conn) -> None:
    park_busy(conn, "a")
    park_busy(conn, "b")
    conn.execute("UPDATE outbox_heads SET leased_until = clock_timestamp() - interval '1 millisecond' WHERE parked")
    other = insert(conn, "order", "other")
    # A claim of one: the expired parked heads come first among the due heads (the oldest
    # ready_at) but are no candidates; both are dropped.
    assert claim_ids(conn, 1) == [other]
    assert head(conn, "a") is None and head(conn, "b") is None


def test_a_parked_head_wakes_no_worker(conn: Conn) -> None:
    park_busy(conn)
    assert conn.execute("SELECT outbox_next_wakeup()").fetchone() == (None,)
    insert(conn, "order", "busy")
    # A new event is due now (the worker is woken by NOTIFY; its claim's intake brings the head back).
    assert claim_ids(conn) != []


def lock_head(conn: Conn, aggregate_id: str) -> None:
    """What a report does to its heads first (outbox_refresh_heads): lock them, in key order."""
    assert conn.execute("SELECT 1 FROM outbox_heads WHERE aggregate_type = 'order' AND aggregate_id = %s "
                        "FOR UPDATE", (aggregate_id,)).fetchone() == (1,)


def waits_for_a_lock(conn: Conn, pid: int) -> bool:
    row = conn.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return row is not None and row[0] == "Lock"


def calm_and_busy(conn: Conn) -> tuple[int, int]:
    """Two heads in key order: "a-calm" leased to a run, with an event long before the cursor
    (not busy), and "b-busy" parked, with events just below it. Then one new event each;
    returns their ids (calm, busy)."""
    insert(conn, "order", "a-calm")
    assert len(claim(conn, 1)) == 1                                  # its head stays, leased
    others = [insert(conn, "order", f"other-{i}") for i in range(60)]
    assert sorted(claim_ids(conn, 100)) == others                    # the cursor is 60 ids on
    park_busy(conn, "b-busy")
    assert (head(conn, "b-busy") or {}).get("parked")
    return insert(conn, "order", "a-calm"), insert(conn, "order", "b-busy")


def test_the_intake_holds_no_busy_head_while_it_waits(dsn: str, conn: Conn) -> None:
    """A report locks its heads in one pass in key order and waits. The intake waits only in its
    insert, which comes first: while it waits there for "a-calm", which a report holds, it holds
    no busy head, so the report gets "b-busy" too. An intake that took the busy heads first
    would hold one while it waited: the report would then wait for the intake and the intake for
    the report, a deadlock that PostgreSQL breaks by aborting one of them."""
    _, busy_event = calm_and_busy(conn)
    with connect(dsn, autocommit=False, lock_timeout="5s") as report, connect(dsn, lock_timeout="20s") as worker:
        lock_head(report, "a-calm")
        pid = worker.info.backend_pid
        claiming = Background(lambda: claim_ids(worker, 10))
        claiming.start()
        wait_until(lambda: waits_for_a_lock(conn, pid), message="the intake to wait for a-calm's head")
        lock_head(report, "b-busy")                                  # not held by the intake
        report.commit()
        assert claiming.result(20) == [busy_event]                   # a-calm's head is leased
    assert conn.execute("SELECT count(*) FROM outbox_heads WHERE aggregate_id = 'b-busy'").fetchone() == (1,)


def test_a_busy_head_held_by_another_keeps_the_cursor_below_its_event(dsn: str, conn: Conn) -> None:
    """The busy heads are never waited for: one that another transaction holds is passed, and
    the cursor stays below its aggregate's event for the next intake, which takes it in."""
    calm_event, busy_event = calm_and_busy(conn)
    with connect(dsn, autocommit=False, lock_timeout="5s") as report, connect(dsn, lock_timeout="1s") as worker:
        lock_head(report, "b-busy")
        assert claim_ids(worker, 10) == []                           # no wait: no lock_timeout error
        (cursor,) = conn.execute("SELECT intake_id FROM outbox_intake").fetchone()
        assert calm_event <= cursor < busy_event
        report.commit()
        assert claim_ids(worker, 10) == [busy_event]
    (cursor,) = conn.execute("SELECT intake_id FROM outbox_intake").fetchone()
    assert cursor >= busy_event


# A head's versions, oldest first, read off the heap pages with pageinspect (a held snapshot
# keeps them all): each one's update to the next, HOT or not, and whether ready_at changed.
PAGE_MOVES = """
WITH v AS (
  SELECT p::integer AS page, i.lp, i.t_ctid, i.t_infomask2, a[5] AS ready
    FROM generate_series(0, pg_relation_size('outbox_heads') / 8192 - 1) p,
         LATERAL heap_page_items(get_raw_page('outbox_heads', p::integer)) i,
         LATERAL tuple_data_split('outbox_heads'::regclass, i.t_data, i.t_infomask, i.t_infomask2, i.t_bits) a
   WHERE i.t_data IS NOT NULL AND substring(a[2] FROM 2) = convert_to(%s, 'UTF8'))
SELECT count(*) FILTER (WHERE v.t_infomask2 & 16384 = 0 AND v.ready IS NOT DISTINCT FROM n.ready)
  FROM v JOIN v n ON (n.page, n.lp) = ((v.t_ctid::text::point)[0]::integer, (v.t_ctid::text::point)[1]::integer)
                 AND (n.page, n.lp) <> (v.page, v.lp)
"""


def test_under_a_held_snapshot_busy_heads_move_pages_seldom(dsn: str, conn: Conn) -> None:
    """outbox_heads keeps three quarters of a page free (fillfactor 25): the versions of
    busy heads, which no held snapshot lets anyone prune, stay on their page (HOT) for many runs
    before one has to move, and each move adds an entry of its key to outbox_heads_pkey that every
    later move's uniqueness check reads. Counted: the updates of a head that were not HOT
    although its ready_at stayed (the page was full), from the heap pages themselves. The
    entries of the key also count the updates that moved ready_at (a turn that ended), which
    depend on how fast the runs go, not on the page."""
    conn.execute("CREATE EXTENSION IF NOT EXISTS pageinspect")
    busy = [f"busy-{i}" for i in range(10)]
    with connect(dsn, autocommit=False) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox").fetchone()     # the snapshot is taken
        for b in busy:
            park_busy(conn, b)                         # 4 runs each: parked from now on
        for _ in range(30):                            # 30 rounds of 2 runs of each, interleaved
            for b in busy:
                insert(conn, "order", b)
                insert(conn, "order", b)
            for _ in range(2 * len(busy)):
                one_run(conn)
        (moves,) = conn.execute(PAGE_MOVES, ("busy-0",)).fetchone()  # type: ignore[misc]
        holder.rollback()
    # Seen (about 160 versions of the head): 9 with fillfactor 25 (14 with every run 20 ms
    # slower), 16 with fillfactor 50, fast or slow.
    assert moves <= 12, moves


def test_a_claim_does_not_wait_for_a_parked_head_it_would_drop(dsn: str, conn: Conn) -> None:
    """A claim drops the parked heads whose second is up that it reads at the front, after its
    passes, when it holds its runs' heads. A report may hold such a head (it moved it) and wait
    for a head the claim holds: a wait there closed a circle, which PostgreSQL broke by aborting
    the report (seen once in bench/shards.py's workers part: "deadlock detected" in a report,
    delivery held up for a second). The claim leaves a parked head that another holds to a
    later claim, and returns its runs without waiting."""
    park_busy(conn, "a")
    conn.execute("UPDATE outbox_heads SET leased_until = clock_timestamp() - interval '1 millisecond' WHERE parked")
    other = insert(conn, "order", "other")
    with connect(dsn, autocommit=False) as report, connect(dsn, lock_timeout="1s") as worker:
        lock_head(report, "a")
        assert claim_ids(worker, 10) == [other]            # LockNotAvailable after 1 s before
        report.rollback()
    assert head(conn, "a") is not None and head(conn, "a")["parked"]   # for a later claim
    assert claim_ids(conn, 10) == []
    assert head(conn, "a") is None
