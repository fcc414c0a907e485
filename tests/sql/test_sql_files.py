"""The psql files of sql/ and the outbox_health view, on a real PostgreSQL."""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any

import locks
import psycopg
import pytest
from dataset import build_dataset, last_claim_at, producing_transaction
from helpers import (
    SQL_DIR,
    claim,
    complete,
    fail,
    finish_psql,
    insert,
    run_files,
    start_psql,
)
from psycopg.rows import dict_row

FILES = ("health", "leases", "failures", "dead_letters", "partitions", "repair")


def snapshot(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT id, state::text, attempts, discard_reason FROM outbox ORDER BY id").fetchall()


# -- every file -------------------------------------------------------------------------------

def test_every_advisory_lock_key_of_the_sql_is_named_in_tests_locks() -> None:
    """The SQL spells the lock keys out; tests/locks.py names them for the tests."""
    named_pairs = {v for v in vars(locks).values() if isinstance(v, tuple)}
    classes = {locks.LOCK_CLASS, locks.AGGREGATE_LOCK_CLASS, locks.HEADS_WRITER_LOCK_CLASS}
    migrations = sorted((SQL_DIR.parent / "migrations").glob("*.sql")) + sorted((SQL_DIR.parent / "schema").glob("*.sql"))
    seen_pairs, seen_classes = set(), set()
    for path in [*migrations, *SQL_DIR.glob("*.sql")]:
        text = path.read_text()
        for first, second in re.findall(r"\(\s*(\d{6,})\s*,\s*(\d+)\s*\)", text):
            seen_pairs.add((int(first), int(second)))
        seen_classes.update(int(c) for c in re.findall(r"classid\s*=\s*(\d{6,})", text))
        seen_classes.update(int(c) for c in re.findall(r"\(\s*(\d{6,})\s*,", text))
    assert seen_pairs and seen_pairs <= named_pairs, seen_pairs - named_pairs
    assert seen_classes <= classes, seen_classes - classes
    # Each name is used: a lock the SQL no longer takes loses its name.
    assert named_pairs <= seen_pairs, named_pairs - seen_pairs
    assert classes <= seen_classes


def test_sql_dir_holds_the_documented_files() -> None:
    assert sorted(p.stem for p in SQL_DIR.glob("*.sql")) == sorted(FILES)
    for name in FILES:
        text = (SQL_DIR / f"{name}.sql").read_text()
        assert text.startswith("-- outboxpg: "), name  # each says what it shows or does first
        assert "-f sql/" in text.split("\n\n")[0], name  # and how to run it


def test_every_file_runs_on_a_database_with_events_in_every_state(dsn: str, conn: psycopg.Connection[Any]) -> None:
    data = build_dataset(conn)
    before = snapshot(conn)
    results = dict(zip(FILES, run_files(dsn, *((name,) for name in FILES))))
    for name, (code, out, err) in results.items():
        assert code == 0 and "ERROR" not in err, (name, err)
        assert out.strip(), name
    assert snapshot(conn) == before  # all of them read only (the maintenance one is a dry run)

    health = results["health"][1]
    assert re.search(r"^ backlog\s+\| 3$", health, re.M) and re.search(r"^ dead\s+\| 4$", health, re.M), health
    assert re.search(r"^ worker_claimed_last_minute\s+\| true$", health, re.M), health
    assert re.search(r"^\s*published\s+\|\s+2\s+\|", health, re.M), health
    assert f"held back behind event {data['dead_o1']} of its aggregate (dead)" in health
    assert "leased by w-test until" in health and "due: waiting for a worker to claim it" in health

    leases = results["leases"][1]
    assert re.search(r"^\s*w-test\s+\|\s+1\s+\|\s+1\s+\|\s+0\s+\|", leases, re.M), leases

    # attempted: 2 published + 4 dead + 1 leased; the last attempt of the 4 dead ones failed
    failures = results["failures"][1]
    assert re.search(r"\|\s+7\s+\|\s+2\s+\|\s+0\s+\|\s+0\s+\|\s+4\s+\|\s+57\.1$", failures, re.M), failures
    assert re.search(r"^ payload too large\s+\|\s+0\s+\|\s+1\s+\|", failures, re.M), failures

    dead = results["dead_letters"][1]
    assert re.search(r"^ created\s+\|\s+order\s+\|\s+1\s+\|\s+1\s+\|.*\| payload too large$", dead, re.M), dead
    assert re.search(r"^ order\s+\|\s+3\s+\|\s+1$", dead, re.M), dead  # 3 blocked aggregates, 1 held-back event

    partitions = results["partitions"][1]
    assert "outbox_default" in partitions and "what outbox_maintain() would do now (dry run)" in partitions

    repair = results["repair"][1]
    assert "== selection (empty: any) ids= event_type= aggregate_type= aggregate_id=" in repair
    assert len(re.findall(rf"^\s+({'|'.join(str(data[k]) for k in ('dead_o1', 'dead_o2', 'dead_c1', 'dead_inj'))}) \|",
                          repair, re.M)) == 4, repair


def test_every_file_runs_on_an_empty_outbox(dsn: str) -> None:
    for name, (code, _, err) in zip(FILES, run_files(dsn, *((name,) for name in FILES))):
        assert code == 0, (name, err)


def test_every_file_runs_as_an_outbox_operator_login(operator_dsn: str, conn: psycopg.Connection[Any]) -> None:
    """An operator may read the events' metadata but not their payloads: no file needs more."""
    build_dataset(conn)
    for name, (code, _out, err) in zip(FILES, run_files(operator_dsn, *((name,) for name in FILES))):
        assert code == 0 and "ERROR" not in err, (name, err)


def test_failures_window_variable(dsn: str, conn: psycopg.Connection[Any]) -> None:
    build_dataset(conn)
    conn.execute("UPDATE outbox SET dead_at = now() - interval '2 hours', claimed_at = now() - interval '2 hours' "
                 "WHERE state = 'dead'")
    (code, hour, err), (code2, day, err2) = run_files(dsn, ("failures",), ("failures", "-v", "window=1 day"))
    assert code == 0 and code2 == 0, (err, err2)
    assert re.search(r"\|\s+3\s+\|\s+2\s+\|\s+0\s+\|\s+0\s+\|\s+0\s+\|\s+0\.0$", hour, re.M), hour
    assert re.search(r"\|\s+7\s+\|\s+2\s+\|\s+0\s+\|\s+0\s+\|\s+4\s+\|\s+57\.1$", day, re.M), day


# -- repair.sql -----------------------------------------------------------------------------

def test_repair_preview_takes_variables_as_data(dsn: str, conn: psycopg.Connection[Any]) -> None:
    data = build_dataset(conn)
    before = snapshot(conn)
    by_type, by_ids, by_aggregate, injected, bad_ids = run_files(
        dsn,
        ("repair", "-v", "event_type=x'OR'1'='1"),
        ("repair", "-v", f"ids={data['dead_o1']}, {data['dead_c1']}"),
        ("repair", "-v", "aggregate_type=order", "-v", "aggregate_id=o-1"),
        ("repair", "-v", "event_type=created' OR '1'='1"),
        ("repair", "-v", "ids=1); DROP TABLE outbox; --"))

    def listed(result: tuple[int, str, str]) -> set[int]:
        code, out, err = result
        assert code == 0, err
        section = out.split("== the first 50 of them, oldest first", 1)[1]
        return {int(m) for m in re.findall(r"^\s+(\d+) \|", section, re.M)}

    assert listed(by_type) == {data["dead_inj"]}
    assert listed(by_ids) == {data["dead_o1"], data["dead_c1"]}
    assert listed(by_aggregate) == {data["dead_o1"]}
    assert listed(injected) == set()
    assert bad_ids[0] == 3 and 'invalid input syntax for type bigint: "1); DROP TABLE outbox; --"' in bad_ids[2]
    assert snapshot(conn) == before


def commented_statements(text: str) -> list[str]:
    """The copy-paste statements in the comments of repair.sql (those that change something)."""
    statements, current = [], ""
    for line in text.splitlines():
        if not line.startswith("--"):
            continue
        body = line[2:].strip()
        if body.startswith("SELECT outbox_") or current:
            current = f"{current} {body}".strip()
            if current.endswith(";"):
                statements.append(current)
                current = ""
    return statements


def test_repair_statements_in_the_comments_work(dsn: str, conn: psycopg.Connection[Any]) -> None:
    data = build_dataset(conn)
    statements = commented_statements((SQL_DIR / "repair.sql").read_text())
    assert len(statements) == 9 and all(":'" in s or "outbox_dead_letters))" in s for s in statements)
    before = snapshot(conn)
    variables = ["-v", f"ids={data['dead_o1']},{data['dead_o2']}", "-v", "event_type=created",
                 "-v", "aggregate_type=order", "-v", "aggregate_id=o-1", "-v", "reason=fixed by hand"]
    procs = [start_psql(dsn, "-At", *variables, input=f"BEGIN;\n{s}\nROLLBACK;\n") for s in statements]
    counts = []
    for p, s in zip(procs, statements):
        code, out, err = finish_psql(p, input=f"BEGIN;\n{s}\nROLLBACK;\n")
        assert code == 0, (s, err)
        counts.append(int(out.split()[1]))  # after psql's "BEGIN"
    # by ids: 2, 2; event type created: 2, 2; aggregate type order: 3, 3; aggregate o-1: 1, 1; all: 4
    assert counts == [2, 2, 2, 2, 3, 3, 1, 1, 4], list(zip(statements, counts))
    assert snapshot(conn) == before

    # and one for real: discard the aggregate's dead event, its held-back event is delivered next
    code, out, err = finish_psql(start_psql(dsn, "-At", *variables, input=statements[7]), input=statements[7])
    assert (code, out.strip()) == (0, "1"), err
    assert conn.execute("SELECT state::text, discard_reason FROM outbox WHERE id = %s",
                        (data["dead_o1"],)).fetchone() == ("discarded", "fixed by hand")
    assert data["held"] in [r["id"] for r in claim(conn, 10)]


# -- outbox_health --------------------------------------------------------------------------

def health(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute("SELECT * FROM outbox_health").fetchall()
    assert len(rows) == 1
    return rows[0]


NO_PRODUCERS = {"open_producers": 0, "oldest_producer_pid": None, "oldest_producer_age": None,
                "held_by_open_transactions": 0,
                # and nothing holds back the xmin horizon past xmin_warn_after
                "xmin_holders": 0, "xmin_holder_kind": None, "xmin_holder_pid": None, "xmin_holder_name": None,
                "xmin_holder_age": None, "xmin_holder_state": None, "xmin_holder_role": None,
                "xmin_holder_application": None}


def test_health_of_an_empty_outbox(conn: psycopg.Connection[Any]) -> None:
    assert health(conn) == {"backlog": 0, "pending": 0, "processing": 0, "scheduled": 0, "waiting_retry": 0, "dead": 0,
                            "expired_leases": 0, "oldest_pending_age": None, "last_claim_at": None,
                            "worker_claimed_last_minute": False, **NO_PRODUCERS}


def test_health_of_known_data(conn: psycopg.Connection[Any]) -> None:
    data = build_dataset(conn)
    with conn.transaction():  # one now() for both queries
        h = health(conn)
        oldest = conn.execute("SELECT now() - min(created_at) FROM outbox WHERE state IN ('pending', 'processing')"
                              ).fetchone()
    assert h == {"backlog": 3, "pending": 2, "processing": 1, "scheduled": 0, "waiting_retry": 0, "dead": 4,
                 "expired_leases": 0,
                 "oldest_pending_age": oldest[0] if oldest else None, "last_claim_at": last_claim_at(conn),
                 "worker_claimed_last_minute": True, **NO_PRODUCERS}
    # kept to the second by the claims: at most a second before the last one
    assert 0 <= (data["leased_claimed_at"] - h["last_claim_at"]).total_seconds() < 1
    # the same figures as the full-scan view
    stats = conn.execute("SELECT pending, processing, dead FROM outbox_stats").fetchone()
    assert stats == (h["pending"], h["processing"], h["dead"])


def test_health_last_claim_whatever_the_backlog(conn: psycopg.Connection[Any]) -> None:
    """A worker draining a backlog of one aggregate: the events it claimed are published, and
    more than 1,000 newer ones wait, never claimed yet. The last claim is the one just made."""
    conn.execute("""INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                    SELECT 'order', 'hot', 'created', '{}' FROM generate_series(1, 1300) g""")
    before = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    rows = claim(conn, 100)
    assert len(rows) == 100
    assert complete(conn, [r["id"] for r in rows], rows[0]["lease_token"]) == 100
    h = health(conn)
    assert h["backlog"] == 1200 and h["last_claim_at"] is not None
    assert h["last_claim_at"] >= before - timedelta(seconds=1) and h["worker_claimed_last_minute"] is True

    # An empty claim is a claim too: a worker is running, whatever it found.
    assert len(claim(conn, 100)) == 100           # the aggregate's next run, in flight
    conn.execute("UPDATE outbox_intake SET last_claim_at = now() - interval '61 seconds'")
    assert health(conn)["worker_claimed_last_minute"] is False
    assert claim(conn, 100) == []                 # one run per aggregate in flight: nothing to hand out
    h = health(conn)
    assert h["worker_claimed_last_minute"] is True and h["last_claim_at"] >= before


def test_health_counts_waiting_retries_and_expired_leases(conn: psycopg.Connection[Any]) -> None:
    a, b = insert(conn, "order", "a"), insert(conn, "order", "b")
    rows = claim(conn, 2, lease="200 milliseconds")
    assert [r["id"] for r in rows] == [a, b]
    assert fail(conn, a, rows[0]["lease_token"], "broker down") == "pending"   # retry after a backoff (1 s)
    time.sleep(0.3)                                                             # b's lease runs out
    h = health(conn)
    assert (h["backlog"], h["pending"], h["waiting_retry"], h["processing"], h["expired_leases"]) == (2, 1, 1, 1, 1)
    assert h["worker_claimed_last_minute"] is True


def _partition_reads(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    row = conn.execute("""SELECT coalesce(sum(seq_scan), 0), coalesce(sum(idx_tup_fetch), 0)
                            FROM pg_stat_xact_user_tables
                           WHERE relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'outbox'::regclass)
                       """).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.mark.parametrize("stale_statistics", [False, True], ids=["fresh-statistics", "stale-statistics"])
def test_health_does_not_read_published_events(conn: psycopg.Connection[Any], stale_statistics: bool) -> None:
    # 5000 events; statistics taken while they are all pending (the burst case) or once published
    conn.execute("""INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, state)
                    SELECT 'order', g::text, 'created', '{}', 'pending' FROM generate_series(1, 5000) g""")
    partition = conn.execute("SELECT tableoid::regclass::text FROM outbox LIMIT 1").fetchone()[0]  # type: ignore[index]
    conn.execute(f"ALTER TABLE {partition} SET (autovacuum_enabled = off)")
    if stale_statistics:
        conn.execute("ANALYZE outbox")
    conn.execute("UPDATE outbox SET state = 'published', claimed_at = now() - interval '1 hour', "
                 "published_at = now() WHERE id % 1000 <> 0")   # 5 stay pending
    if not stale_statistics:
        conn.execute("ANALYZE outbox")
    conn.execute("VACUUM outbox")
    # pg_stat_xact_* also holds counts of earlier transactions not yet flushed: compare before/after.
    with conn.transaction():
        seq_before, fetched_before = _partition_reads(conn)
        h = health(conn)
        seq_after, fetched_after = _partition_reads(conn)
    assert h["backlog"] == 5
    assert seq_after - seq_before == 0
    assert fetched_after - fetched_before <= 5  # the unfinished events, not the 5000 published ones
    with conn.transaction():
        seq_before, _ = _partition_reads(conn)
        conn.execute("SELECT * FROM outbox_stats").fetchone()
        assert _partition_reads(conn)[0] > seq_before  # (the full-scan view, for contrast)


def test_health_reports_what_open_transactions_hold_back(dsn: str, conn: psycopg.Connection[Any]) -> None:
    with producing_transaction(dsn, "o-held") as producer:
        held = [insert(conn, "order", "o-held", "shipped") for _ in range(3)]
        free = [insert(conn, "order", f"o-free-{i}") for i in range(2)]
        assert sorted(r["id"] for r in claim(conn, 10)) == free
        time.sleep(0.2)
        h = health(conn)
        assert (h["backlog"], h["pending"], h["processing"]) == (5, 3, 2)
        assert (h["open_producers"], h["oldest_producer_pid"], h["held_by_open_transactions"]) == (
            1, producer.info.backend_pid, 3)
        assert timedelta(seconds=0.2) <= h["oldest_producer_age"] < timedelta(seconds=60)
        assert h["worker_claimed_last_minute"] is True

        # A second, younger producing transaction of another aggregate: the oldest is still named.
        with producing_transaction(dsn, "o-other"):
            other = insert(conn, "order", "o-other", "shipped")
            h = health(conn)
            assert (h["open_producers"], h["oldest_producer_pid"], h["held_by_open_transactions"]) == (
                2, producer.info.backend_pid, 4)
        assert [r["id"] for r in claim(conn, 10)] == [other]

        # With the guard switched off nothing is held back (the transaction is still open).
        conn.execute("UPDATE outbox_settings SET commit_order_guard = false")
        h = health(conn)
        assert (h["open_producers"], h["held_by_open_transactions"]) == (1, 0)
        conn.execute("UPDATE outbox_settings SET commit_order_guard = true")
    h = health(conn)
    assert {k: h[k] for k in NO_PRODUCERS} == NO_PRODUCERS
    assert [r["id"] for r in claim(conn, 10)] == held


def test_health_when_an_open_transaction_holds_back_every_newer_event(dsn: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("UPDATE outbox_settings SET commit_order_max_aggregates = 1")
    old = insert(conn, "order", "a")
    with producing_transaction(dsn, "o-1", "o-2"):       # two aggregates: more than it names
        newer = [insert(conn, "order", name) for name in ("a", "b", "c")]
        assert claim(conn, 10)[0]["id"] == old and len(newer) == 3
        assert claim(conn, 10) == []
        h = health(conn)
        assert (h["open_producers"], h["held_by_open_transactions"], h["backlog"]) == (1, 3, 4)
        assert h["worker_claimed_last_minute"] is True


def test_health_sql_names_the_open_transaction_that_holds_events_back(dsn: str, conn: psycopg.Connection[Any],
                                                                      operator_dsn: str) -> None:
    dead = insert(conn, "order", "o-dead")
    (row,) = claim(conn, 10)
    assert fail(conn, dead, row["lease_token"], "broken", True) == "dead"
    behind_dead = insert(conn, "order", "o-dead", "shipped")
    with producing_transaction(dsn, "o-held") as producer:
        pid = producer.info.backend_pid
        (horizon,) = producer.execute("SELECT held_above FROM outbox_open_producers() WHERE pid = pg_backend_pid()"
                                      ).fetchone()
        held = [insert(conn, "order", "o-held", "shipped") for _ in range(2)]
        leased = insert(conn, "order", "o-free")
        assert [r["id"] for r in claim(conn, 10, worker="w-test")] == [leased]
        due = insert(conn, "order", "o-due")           # committed after the last claim
        results = run_files(dsn, ("health",)) + run_files(operator_dsn, ("health",))
    for code, out, err in results:
        assert code == 0 and "ERROR" not in err, err
        assert re.search(r"^ open_producers\s+\| 1$", out, re.M), out
        assert re.search(rf"^ oldest_producer_pid\s+\| {pid}$", out, re.M), out
        assert re.search(r"^ held_by_open_transactions\s+\| 2$", out, re.M), out
        assert re.search(r"^ worker_claimed_last_minute\s+\| true$", out, re.M), out
        # the open producing transactions
        assert re.search(rf"^\s*{pid} \|.*\| 00:00:0\d\s+\| idle in transaction \| the 1 aggregate\(s\) it wrote, "
                         rf"events newer than id {horizon}$", out, re.M), out

        def why(i: int) -> str:
            m = re.search(rf"^\s*{i} \| order .*$", out, re.M)  # noqa: B023 - called in this iteration only
            assert m, (i, out)  # noqa: B023
            return m.group(0)

        assert re.search(rf"\| held back by open transaction pid {pid} \(open 00:00:0\d, idle in transaction\): "
                         r"it may still commit an earlier event of this aggregate", why(held[0])), out
        assert f"| held back behind event {held[0]} of its aggregate (pending)" in why(held[1])
        assert f"| held back behind event {dead} of its aggregate (dead): requeue or discard it" in why(behind_dead)
        assert "| leased by w-test until " in why(leased)
        assert re.search(r"\| due: waiting for a worker to claim it \(last claim 00:00:0\d ago\)", why(due)), out
        assert out.count("due: waiting for a worker") == 1, out


def test_health_sql_says_when_a_due_events_head_is_not_ready(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The queue's own state: a due event whose aggregate's head (outbox_heads) waits is not
    'waiting for a worker'."""
    first = insert(conn, "order", "o-1")
    assert [r["id"] for r in claim(conn, 10)] == [first]   # taken in and claimed; put back by hand below
    conn.execute("UPDATE outbox SET state = 'pending', lease_token = NULL, locked_until = NULL, attempts = 0 "
                 "WHERE id = %s", (first,))
    conn.execute("UPDATE outbox_heads SET ready_at = now() + interval '1 hour'")
    ((code, out, err),) = run_files(dsn, ("health",))
    assert code == 0, err
    assert re.search(rf"^\s*{first} \| order .*\| due, but its aggregate's head in outbox_heads is not ready before ",
                     out, re.M), out
    assert "due: waiting for a worker" not in out


def test_health_sql_says_when_a_due_events_head_is_leased(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A run in flight holds its head through leased_until, not ready_at."""
    first = insert(conn, "order", "o-1")
    assert [r["id"] for r in claim(conn, 10)] == [first]   # its head leased; the event put back by hand
    conn.execute("UPDATE outbox SET state = 'pending', lease_token = NULL, locked_until = NULL, attempts = 0 "
                 "WHERE id = %s", (first,))
    ((code, out, err),) = run_files(dsn, ("health",))
    assert code == 0, err
    assert re.search(rf"^\s*{first} \| order .*\| due, but its aggregate's head in outbox_heads is leased to a run until ",
                     out, re.M), out


def test_health_sql_says_when_a_due_events_head_is_parked(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A busy aggregate between two events keeps its head, parked; a new event waits
    for the next claim's intake to bring it back, not for a run to end."""
    for _ in range(4):
        insert(conn, "order", "o-1")
    for _ in range(4):                                      # its head moved on 3 times, then its line empty
        (row,) = claim(conn, 1)
        assert complete(conn, [row["id"]], row["lease_token"]) == 1
    waiting = insert(conn, "order", "o-1")
    ((code, out, err),) = run_files(dsn, ("health",))
    assert code == 0, err
    assert re.search(rf"^\s*{waiting} \| order .*\| due: its aggregate's head in outbox_heads is parked; "
                     r"the next claim takes the event in and brings the head back", out, re.M), out
