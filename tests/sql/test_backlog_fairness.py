"""A backlog never holds back other aggregates: an event of an aggregate with nothing before it is
handed out within a claim or two of its commit, whatever the depth of the backlog of others and
however far behind the intake cursor is; a claim shares its batch among the heads at the front of
the queue; and a claim's cost stays bounded by what it hands out."""

from __future__ import annotations

from typing import Any

import psycopg
from helpers import claim, complete, entries_read, insert
from psycopg.rows import dict_row

Conn = psycopg.Connection[Any]


def backlog(conn: Conn, n: int, aggregates: int = 10) -> None:
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', 'busy-' || (g %% %s), 'updated', jsonb_build_object('n', g) "
                 "FROM generate_series(1, %s) g", (aggregates, n))


def claim_and_complete(conn: Conn, n: int) -> list[dict[str, Any]]:
    rows = claim(conn, n)
    for token in {r["lease_token"] for r in rows}:
        complete(conn, [r["id"] for r in rows if r["lease_token"] == token], token)
    return rows


def test_an_event_behind_a_deep_backlog_goes_within_two_claims(conn: Conn) -> None:
    backlog(conn, 30_000)                      # 60 intake chunks of 500 for claim(100)
    assert len(claim_and_complete(conn, 100)) == 100
    fresh = insert(conn, "order", "fresh-1", "created")
    got = [r["id"] for r in claim_and_complete(conn, 100)] + [r["id"] for r in claim_and_complete(conn, 100)]
    assert fresh in got
    (cursor,) = conn.execute("SELECT intake_id FROM outbox_intake").fetchone()  # type: ignore[misc]
    assert cursor < 5_000, "the intake cursor is still deep in the backlog (this is the case the test is about)"


def test_order_holds_for_an_aggregate_found_among_the_newest_events(conn: Conn) -> None:
    """An aggregate with events both in the backlog and among the newest ones: its head, made
    from the newest, still hands them out from its first, in id order."""
    backlog(conn, 20_000)
    first = insert(conn, "order", "mixed", "one")
    backlog(conn, 20_000)
    second = insert(conn, "order", "mixed", "two")
    third = insert(conn, "order", "mixed", "three")
    seen: list[int] = []
    for _ in range(100):
        rows = claim_and_complete(conn, 500)
        seen += [r["id"] for r in rows if r["aggregate_id"] == "mixed"]
        if len(seen) == 3 or not rows:
            break
    assert seen == [first, second, third]


def test_a_claim_takes_one_busy_run_and_every_quiet_head_in_front(conn: Conn) -> None:
    """Ten busy aggregates with hundreds of events each and one quiet one: a claim of 100 takes
    one long run of a busy aggregate and the quiet event, and shares the rest among the other
    busy heads. With no busy head, the batch is shared among the quiet ones; one head alone
    takes the whole batch."""
    backlog(conn, 2_000)
    for _ in range(4):                        # each busy head moved on 3 times: busy from now on
        claim_and_complete(conn, 10)
    quiet = insert(conn, "order", "quiet", "created")
    rows = claim(conn, 100)
    by_aggregate: dict[str, int] = {}
    for r in rows:
        by_aggregate[r["aggregate_id"]] = by_aggregate.get(r["aggregate_id"], 0) + 1
    assert quiet in [r["id"] for r in rows]
    assert len(rows) == 100
    assert sorted(by_aggregate.values(), reverse=True)[:2] == [90, 1] and len(by_aggregate) == 11, by_aggregate
    # No busy head: shared.
    conn.execute("TRUNCATE outbox, outbox_heads")
    backlog(conn, 40, aggregates=4)
    assert len({r["aggregate_id"] for r in claim(conn, 20)}) == 4
    # One head alone takes the whole batch.
    conn.execute("TRUNCATE outbox, outbox_heads")
    backlog(conn, 500, aggregates=1)
    assert len(claim(conn, 100)) == 100


def test_a_claim_behind_a_deep_backlog_reads_a_bounded_number_of_ids(conn: Conn) -> None:
    backlog(conn, 100_000)
    claim_and_complete(conn, 100)
    insert(conn, "order", "fresh-2", "created")
    conn.execute("BEGIN")
    reads, rows = entries_read(conn, "outbox_in_flow_idx", lambda: claim(conn, 100))
    conn.execute("COMMIT")
    assert rows
    # The intake's chunk (500 for a claim of 100) and the newest ids (at most 500), not the
    # 100,000 between them.
    assert reads <= 1_500, reads


def test_claims_stay_full_while_a_backlog_of_many_aggregates_drains(conn: Conn) -> None:
    """A backlog of a few events each over many aggregates: the heads made from the newest events
    (ahead of the cursor) are runs of their own like any other, so every claim but the last is
    full and each aggregate's events come in id order."""
    backlog(conn, 6_000, aggregates=1_500)
    sizes: list[int] = []
    last: dict[str, int] = {}
    while rows := claim_and_complete(conn, 50):
        sizes.append(len(rows))
        for r in rows:
            assert r["id"] > last.get(r["aggregate_id"], 0), r
            last[r["aggregate_id"]] = r["id"]
    assert sum(sizes) == 6_000
    assert sizes[:-1] == [50] * (len(sizes) - 1), sizes


def test_parked_heads_brought_back_ahead_of_the_cursor_are_runs_of_their_own(conn: Conn) -> None:
    """Two busy aggregates parked at one cursor position (their heads at the same id above it,
    which is also the first event of the backlog's first aggregate), then a backlog, then an
    event of each: the intake brings both heads back from the newest events, and one claim hands
    out both events, each head leased for its own run."""
    for aggregate in ("p1", "p2"):
        for _ in range(4):
            insert(conn, "order", aggregate)
    for _ in range(8):                          # one event a claim: each head moved on 3 times
        (row,) = claim(conn, 1)
        complete(conn, [row["id"]], row["lease_token"])
    parked = conn.execute("SELECT count(*) FROM outbox_heads WHERE parked").fetchone()
    assert parked == (2,)
    backlog(conn, 2_000)
    fresh = [insert(conn, "order", "p1"), insert(conn, "order", "p2")]
    rows = claim(conn, 100)
    assert set(fresh) <= {r["id"] for r in rows}, [(r["aggregate_id"], r["id"]) for r in rows]
    # Each head was leased for its run: no second claim can start a run of p1 or p2 meanwhile.
    leased = conn.execute("SELECT aggregate_id FROM outbox_heads WHERE aggregate_id IN ('p1', 'p2') "
                          "AND leased_until > clock_timestamp() ORDER BY 1").fetchall()
    assert leased == [("p1",), ("p2",)]


def quiet_claim(conn: Conn, n: int) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM outbox_claim(%s, quiet_only => true)", (n,)).fetchall()


def test_a_quiet_only_claim_takes_the_quiet_heads_in_front_and_no_busy_run(conn: Conn) -> None:
    """The worker's lane: outbox_claim(..., quiet_only => true) beside batches of busy runs hands
    out the quiet aggregates' events at the front of the queue and nothing of a busy aggregate
    (its head moved on 3 times or more), however many of those are due."""
    backlog(conn, 2_000)
    for _ in range(4):                        # each busy head moved on 3 times: busy from now on
        claim_and_complete(conn, 10)
    assert quiet_claim(conn, 100) == []       # ten busy heads due, no quiet one
    quiet = [insert(conn, "order", "quiet-1", "created"), insert(conn, "order", "quiet-2", "created"),
             insert(conn, "order", "quiet-2", "updated")]
    rows = quiet_claim(conn, 100)
    assert [r["id"] for r in rows] == quiet
    # NULL is the default (false), as for the claim's other arguments: a full claim.
    with conn.cursor(row_factory=dict_row) as cur:
        assert len(cur.execute("SELECT * FROM outbox_claim(10, quiet_only => NULL)").fetchall()) == 10
    # The busy heads are still due for the next full claim, which also takes one long run.
    rows = claim(conn, 100)
    assert len(rows) == 100 and all(r["aggregate_id"].startswith("busy-") for r in rows)


def test_a_quiet_only_claim_reads_only_the_front_of_the_queue(conn: Conn) -> None:
    """With many busy heads due before a quiet one, a quiet_only claim reads the first 16 due
    heads and stops: it does not walk every busy head to find a quiet one further back (full
    claims take that one in its turn)."""
    backlog(conn, 10_000, aggregates=200)
    claim_and_complete(conn, 1_000)           # every event taken in: 200 heads
    # As if each had been moved on 3 times by its reports (what makes a head busy).
    busy = conn.execute("UPDATE outbox_heads SET moves = 3 WHERE ready_at IS NOT NULL").rowcount
    assert busy >= 150
    quiet = insert(conn, "order", "quiet-behind", "created")
    conn.execute("BEGIN")
    reads, rows = entries_read(conn, "outbox_heads_ready_idx", lambda: quiet_claim(conn, 100))
    conn.execute("ROLLBACK")
    assert rows == []
    assert reads <= 64, reads
    # Full claims take it in its turn, behind the busy heads due before it.
    handed_out: list[int] = []
    for _ in range(40):
        handed_out += [r["id"] for r in claim_and_complete(conn, 500)]
        if quiet in handed_out:
            break
    assert quiet in handed_out


def test_an_aggregate_that_was_busy_and_caught_up_goes_in_the_next_claim(conn: Conn) -> None:
    """Busy is what waits now, not what an aggregate did before: one whose head was moved on many
    times (its events once came one after another) but has one event waiting is served beside the
    backlog's run in the next claim, not left for its turn among the busy heads."""
    backlog(conn, 2_000)
    for _ in range(4):                        # each busy head moved on 3 times: busy from now on
        claim_and_complete(conn, 10)
    event = insert(conn, "order", "was-busy", "created")
    claim_and_complete(conn, 1)               # the intake makes its head (behind the busy ones)
    conn.execute("UPDATE outbox_heads SET moves = 7 WHERE aggregate_id = 'was-busy'")
    rows = claim(conn, 100)
    assert event in [r["id"] for r in rows], sorted({r["aggregate_id"] for r in rows})


def test_an_event_that_commits_late_behind_a_backlog_is_not_left_to_the_cursor(dsn: str, conn: Conn) -> None:
    """A producer's transaction is still open while a claim reads the newest events behind a
    backlog: its event, committed after that, is handed out within the next two claims, not when
    the intake cursor reaches it (a whole backlog later) or the next event of its aggregate comes."""
    backlog(conn, 30_000)
    claim_and_complete(conn, 100)
    with psycopg.connect(dsn) as late:
        late_id = insert(late, "order", "fresh-late", "created")        # open: not committed yet
        insert(conn, "order", "fresh-early", "created")
        claim_and_complete(conn, 100)          # reads the newest events: fresh-late is not visible
        late.commit()
    got = [r["id"] for r in claim_and_complete(conn, 100)] + [r["id"] for r in claim_and_complete(conn, 100)]
    assert late_id in got
