"""Partitions and outbox_maintain(): created ahead, rows rescued from outbox_default, old
partitions dropped whole only when every event in them is finished."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from helpers import (
    Background,
    claim,
    complete,
    discard,
    event,
    events,
    fail,
    insert,
    insert_series,
    release,
    set_settings,
    states,
)
from locks import MAINTENANCE_LOCK
from psycopg.rows import dict_row

Conn = psycopg.Connection[Any]


def maintain(conn: Conn, dry_run: bool = False) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM outbox_maintain(%s)", (dry_run,)).fetchall()


def partitions(conn: Conn) -> list[tuple[str, datetime, datetime]]:
    """Non-default partitions, ordered by range."""
    return [tuple(r) for r in conn.execute(  # type: ignore[misc]
        "SELECT partition, range_start, range_end FROM outbox_partitions WHERE NOT is_default "
        "ORDER BY range_start").fetchall()]


def day_start(conn: Conn, days_from_now: int) -> datetime:
    row = conn.execute("SELECT date_bin('1 day', clock_timestamp() + make_interval(days => %s), "
                       "'2000-01-01 00:00:00+00')", (days_from_now,)).fetchone()
    assert row is not None
    return row[0]


def name_for(start: datetime) -> str:
    return "outbox_p" + start.astimezone(UTC).strftime("%Y%m%dT%H%M%S")


def at_day(days: int, hour: int = 12) -> str:
    """An SQL expression for a created_at ``days`` from today (UTC), at ``hour``."""
    return (f"date_bin('1 day', now(), '2000-01-01 00:00:00+00') + make_interval(days => {days}, hours => {hour})")


def assert_contiguous(parts: list[tuple[str, datetime, datetime]], start: datetime, end: datetime) -> None:
    covered = [(s, e) for _, s, e in parts if e > start and s < end]
    assert covered, f"nothing covers {start}..{end}: {parts}"
    assert covered[0][0] <= start, f"gap at the start: {covered}"
    assert covered[-1][1] >= end, f"gap at the end: {covered}"
    for (s1, e1), (s2, e2) in zip(covered, covered[1:]):
        assert e1 == s2, f"gap or overlap between {s1}..{e1} and {s2}..{e2}"


def actions(rows: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {r["partition"]: r for r in rows if r["action"] == kind}


# --------------------------------------------------------------------------------------------
# creating partitions
# --------------------------------------------------------------------------------------------

def test_maintain_creates_partitions_ahead(conn: Conn) -> None:
    maintain(conn)
    today = day_start(conn, 0)
    assert_contiguous(partitions(conn), today, today + timedelta(days=4))  # current + partitions_ahead=3

    set_settings(conn, partitions_ahead=5)
    rows = maintain(conn)
    created = actions(rows, "create")
    expected = [today + timedelta(days=4), today + timedelta(days=5)]
    assert sorted(created) == [name_for(d) for d in expected]
    for d in expected:
        r = created[name_for(d)]
        assert (r["range_start"], r["range_end"], r["detail"]) == (d, d + timedelta(days=1), None)
    assert_contiguous(partitions(conn), today, today + timedelta(days=6))
    assert [p for p, _, _ in partitions(conn)][-2:] == [name_for(d) for d in expected]

    # nothing left to do: a second run creates nothing
    assert [r for r in maintain(conn) if r["action"] != "keep"] == []

    # an event of any of those days lands in its own partition, not in outbox_default
    for days in range(0, 6):
        i = insert(conn, aggregate_id=f"d{days}", created_at=_server_expr(conn, at_day(days)))
        assert event(conn, i)["partition"] == name_for(today + timedelta(days=days))


def _server_expr(conn: Conn, expr: str) -> datetime:
    row = conn.execute(f"SELECT {expr}").fetchone()
    assert row is not None
    return row[0]


def test_rows_in_default_partition_move_into_a_new_partition(conn: Conn) -> None:
    past = _server_expr(conn, at_day(-30))
    future = _server_expr(conn, at_day(40))
    ids = [insert(conn, aggregate_id=f"p{k}", created_at=past + timedelta(minutes=k)) for k in range(5)]
    ids += [insert(conn, aggregate_id=f"f{k}", created_at=future) for k in range(2)]
    assert {event(conn, i)["partition"] for i in ids} == {"outbox_default"}

    # give them every state while they sit in outbox_default
    rows = {r["id"]: r for r in claim(conn, 10, lease="10 minutes")}
    token = rows[ids[0]]["lease_token"]
    assert complete(conn, [ids[0]], token) == 1
    assert fail(conn, ids[1], token, "poison", permanent=True) == "dead"
    assert fail(conn, ids[2], token, "retry") == "pending"
    assert release(conn, [ids[3]], token) == 1
    assert discard(conn, [ids[3]], "no longer needed") == 1
    # ids[4] and the future ones stay processing
    before = {e["id"]: {k: v for k, v in e.items() if k != "partition"} for e in events(conn)}

    result = maintain(conn)
    created = actions(result, "create")
    past_day, future_day = day_start(conn, -30), day_start(conn, 40)
    assert created[name_for(past_day)]["detail"] == "moved 5 rows from outbox_default"
    assert created[name_for(future_day)]["detail"] == "moved 2 rows from outbox_default"
    assert (created[name_for(past_day)]["range_start"], created[name_for(past_day)]["range_end"]) == \
        (past_day, past_day + timedelta(days=1))

    assert conn.execute("SELECT count(*) FROM outbox_default").fetchone() == (0,)
    after = {e["id"]: e for e in events(conn)}
    assert set(after) == set(before)
    for i in ids[:5]:
        assert after[i]["partition"] == name_for(past_day)
    for i in ids[5:]:
        assert after[i]["partition"] == name_for(future_day)
    assert {i: {k: v for k, v in e.items() if k != "partition"} for i, e in after.items()} == before

    # the moved rows keep working: the lease still holds, new rows of that day go to the partition
    assert complete(conn, [ids[4]], token) == 1
    j = insert(conn, aggregate_id="late", created_at=past + timedelta(hours=1))
    assert event(conn, j)["partition"] == name_for(past_day)
    # and the indexes came along (the partition is attached, not just a lookalike table)
    parent_indexes = conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = 'outbox'").fetchone()[0]  # type: ignore[index]
    assert parent_indexes >= 3
    assert conn.execute("SELECT count(*) FROM pg_indexes WHERE tablename = %s",
                        (name_for(past_day),)).fetchone()[0] == parent_indexes  # type: ignore[index]
    assert [r for r in maintain(conn) if r["action"] == "create"] == []


# --------------------------------------------------------------------------------------------
# dropping old partitions
# --------------------------------------------------------------------------------------------

def _old_events(conn: Conn, days: int, n: int, prefix: str) -> list[int]:
    return insert_series(conn, [f"{prefix}{k}" for k in range(n)], created_at=at_day(days))


def _publish_all(conn: Conn, ids: list[int]) -> None:
    rows = [r for r in claim(conn, 1000) if r["id"] in ids]
    assert sorted(r["id"] for r in rows) == sorted(ids)
    assert complete(conn, ids, rows[0]["lease_token"]) == len(ids)


def test_old_partition_with_only_finished_events_is_dropped(conn: Conn) -> None:
    old = _old_events(conn, -30, 3, "a")
    other = _old_events(conn, -25, 2, "b")
    recent = _old_events(conn, -3, 2, "c")   # within retention (7 days)
    maintain(conn)
    day30, day25, day3 = day_start(conn, -30), day_start(conn, -25), day_start(conn, -3)
    assert {event(conn, i)["partition"] for i in old} == {name_for(day30)}
    assert discard(conn, [other[1]], "obsolete") == 1     # discarded counts as finished
    _publish_all(conn, old + recent + other[:1])
    current = partitions(conn)

    result = maintain(conn)
    dropped = actions(result, "drop")
    assert sorted(dropped) == sorted([name_for(day30), name_for(day25)])
    for day in (day30, day25):
        r = dropped[name_for(day)]
        assert (r["range_start"], r["range_end"]) == (day, day + timedelta(days=1))
        assert "freed" in r["detail"]
    assert actions(result, "keep") == {}
    names = [p for p, _, _ in partitions(conn)]
    assert name_for(day30) not in names and name_for(day25) not in names
    assert name_for(day3) in names                         # younger than retention: kept, silently
    assert [p for p in current if p[0] not in dropped] == partitions(conn)
    assert conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s)", (old + other,)).fetchone() == (0,)
    assert states(conn) == {"published": 2}

    # a shorter retention lets the recent one go too
    set_settings(conn, retention="1 day")
    assert sorted(actions(maintain(conn), "drop")) == [name_for(day3)]
    assert states(conn) == {}


def test_old_partition_with_unfinished_events_is_kept(conn: Conn) -> None:
    set_settings(conn, max_attempts=5)
    p30 = _old_events(conn, -30, 2, "a")      # one published, one pending (waiting for a retry)
    p28 = _old_events(conn, -28, 2, "b")      # one published, one dead
    p26 = _old_events(conn, -26, 1, "c")      # leased
    p24 = _old_events(conn, -24, 2, "d")      # published and discarded: dropped
    maintain(conn)
    rows = {r["id"]: r for r in claim(conn, 100, lease="10 minutes")}
    token = rows[p30[0]]["lease_token"]
    assert complete(conn, [p30[0], p28[0], p24[0]], token) == 3
    assert fail(conn, p30[1], token, "retry later") == "pending"
    assert fail(conn, p28[1], token, "poison", permanent=True) == "dead"
    assert release(conn, [p24[1]], token) == 1
    assert discard(conn, [p24[1]], "obsolete") == 1
    snapshot = {e["id"]: e for e in events(conn)}

    result = maintain(conn)
    kept = actions(result, "keep")
    assert sorted(kept) == sorted(name_for(day_start(conn, d)) for d in (-30, -28, -26))
    for r in kept.values():
        assert r["detail"] == "1 unfinished events (pending, leased or dead)"
    assert sorted(actions(result, "drop")) == [name_for(day_start(conn, -24))]
    survivors = {e["id"]: e for e in events(conn)}
    assert survivors == {i: e for i, e in snapshot.items() if i not in p24}

    # a dry run reports the same and changes nothing
    parts = partitions(conn)
    dry = maintain(conn, dry_run=True)
    assert sorted(actions(dry, "keep")) == sorted(kept)
    assert partitions(conn) == parts

    # finish them: the next run drops all three
    assert complete(conn, p26, token) == 1
    assert discard(conn, [p30[1], p28[1]], "operator") == 2
    assert sorted(actions(maintain(conn), "drop")) == sorted(kept)
    assert states(conn) == {}


def test_dry_run_changes_nothing(conn: Conn) -> None:
    stray = insert(conn, aggregate_id="stray", created_at=_server_expr(conn, at_day(-40)))
    old = _old_events(conn, -30, 2, "a")
    maintain(conn)
    _publish_all(conn, old)
    stray2 = insert(conn, aggregate_id="stray2", created_at=_server_expr(conn, at_day(-50)))
    set_settings(conn, partitions_ahead=4)
    parts_before = conn.execute("SELECT partition, range_start, range_end FROM outbox_partitions "
                                "ORDER BY partition").fetchall()
    rows_before = events(conn)

    dry = maintain(conn, dry_run=True)
    day50, day30, ahead = day_start(conn, -50), day_start(conn, -30), day_start(conn, 4)
    assert actions(dry, "create") == {
        name_for(day50): {"action": "create", "partition": name_for(day50), "range_start": day50,
                          "range_end": day50 + timedelta(days=1), "detail": "would move 1 rows from outbox_default"},
        name_for(ahead): {"action": "create", "partition": name_for(ahead), "range_start": ahead,
                          "range_end": ahead + timedelta(days=1), "detail": None},
    }
    assert sorted(actions(dry, "drop")) == [name_for(day30)]

    assert conn.execute("SELECT partition, range_start, range_end FROM outbox_partitions "
                        "ORDER BY partition").fetchall() == parts_before
    assert events(conn) == rows_before
    assert event(conn, stray2)["partition"] == "outbox_default"

    # the real run does what the dry run announced (a dry run cannot look into a partition it
    # has not created: the real run's 'keep' for the new -50 day partition is extra)
    real = maintain(conn)
    assert actions(real, "create").keys() == actions(dry, "create").keys()
    assert actions(real, "create")[name_for(day50)]["detail"] == "moved 1 rows from outbox_default"
    assert actions(real, "drop").keys() == actions(dry, "drop").keys()
    assert sorted(actions(real, "keep")) == sorted([name_for(day50), name_for(day_start(conn, -40))])
    assert sorted(actions(dry, "keep")) == [name_for(day_start(conn, -40))]
    assert event(conn, stray2)["partition"] == name_for(day50)
    assert event(conn, stray)["partition"] == name_for(day_start(conn, -40))


def test_maintain_skips_when_another_maintainer_runs(dsn: str, conn: Conn) -> None:
    _old_events(conn, -30, 1, "a")
    with psycopg.connect(dsn) as other:
        other.execute("SELECT pg_advisory_xact_lock(%s, %s)", MAINTENANCE_LOCK)
        rows = maintain(conn)
        assert [(r["action"], r["detail"]) for r in rows] == [("skip", "another outbox_maintain() is running")]
        assert conn.execute("SELECT count(*) FROM outbox_default").fetchone() == (1,)
    assert actions(maintain(conn), "create") != {}


def test_maintain_skips_a_partition_it_cannot_lock_in_time(dsn: str, conn: Conn) -> None:
    old = _old_events(conn, -30, 1, "a")
    maintain(conn)
    _publish_all(conn, old)
    set_settings(conn, maintenance_lock_timeout="100 milliseconds")
    name = name_for(day_start(conn, -30))
    with psycopg.connect(dsn) as reader:
        reader.execute(f'SELECT count(*) FROM "{name}"')  # holds ACCESS SHARE until the transaction ends
        run = Background(lambda: maintain(conn))
        run.start()
        rows = run.result(timeout=10)
        skipped = actions(rows, "skip")
        assert list(skipped) == [name]
        assert "lock not granted" in skipped[name]["detail"]
        assert name in [p for p, _, _ in partitions(conn)]
    # the lock_timeout was the function's own: the caller's session is unchanged
    assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
    assert sorted(actions(maintain(conn), "drop")) == [name]


# --------------------------------------------------------------------------------------------
# changing partition_width
# --------------------------------------------------------------------------------------------

def test_changing_partition_width_keeps_ranges_contiguous(conn: Conn, subtests: Any) -> None:
    maintain(conn)
    for width, ahead in [("36 hours", 4), ("6 hours", 30), ("2 days", 4), ("1 day", 10)]:
        with subtests.test(width=width):
            set_settings(conn, partition_width=width, partitions_ahead=ahead)
            maintain(conn)
            row = conn.execute("SELECT date_bin(%s::interval, clock_timestamp(), '2000-01-01 00:00:00+00'), "
                               "%s::interval", (width, width)).fetchone()
            assert row is not None
            start, step = row
            assert_contiguous(partitions(conn), start, start + step * (ahead + 1))
            # and a second run has nothing to create
            assert actions(maintain(conn), "create") == {}


def test_dry_run_does_not_take_the_maintainers_lock(dsn: str) -> None:
    """An operator's dry run while a maintainer holds the lock still reports; and a dry run
    never makes a real run skip."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as holder, psycopg.connect(dsn, autocommit=True) as other:
        holder.execute("SELECT pg_advisory_lock(%s, %s)", MAINTENANCE_LOCK)
        rows = other.execute("SELECT action FROM outbox_maintain(true)").fetchall()
        assert ("skip",) not in rows
        assert other.execute("SELECT action FROM outbox_maintain()").fetchall() == [("skip",)]
        holder.execute("SELECT pg_advisory_unlock(%s, %s)", MAINTENANCE_LOCK)
        with other.transaction():
            other.execute("SELECT * FROM outbox_maintain(true)")
            # Still inside the dry run's transaction: a real run elsewhere is not blocked.
            assert ("skip",) not in holder.execute("SELECT action FROM outbox_maintain()").fetchall()
