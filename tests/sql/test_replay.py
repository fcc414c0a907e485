"""outbox_replay and outbox_replay_candidates (migrations/0018_outbox_replay.sql): published events
re-sent as new events, in their original order, through the insert path of every event; against
a real PostgreSQL, and end to end through a worker and a real nats-server (JetStream's duplicate
window drops a copy with the original msg_id; a new msg_id is stored again)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from helpers import allow_subjects, claim, complete, discard, fail, insert, insert_series
from jetstream import make_stream
from psycopg.rows import dict_row
from roles import Denied, login_roles
from workers import count_in, start, wait_until

import outboxpg
from outboxpg.relay.nats.publisher import NatsPublisher

Conn = psycopg.Connection[Any]
BadFilter = psycopg.errors.InvalidParameterValue


def publish_all(conn: Conn) -> None:
    """Claim and complete until nothing is due (what a worker with a publisher that never fails does)."""
    while rows := claim(conn, 100):
        assert complete(conn, [r["id"] for r in rows], rows[0]["lease_token"]) == len(rows)


TYPES = {"ids": "bigint[]", "since": "timestamptz", "until": "timestamptz", "new_msg_id": "boolean",
         "include_replays": "boolean"}


def named(filters: dict[str, Any]) -> str:
    return ", ".join(f"{k} => %({k})s::{TYPES.get(k, 'text')}" for k in filters)


def replay(conn: Conn, **filters: Any) -> int:
    row = conn.execute(f"SELECT outbox_replay({named(filters)})", filters).fetchone()
    assert row is not None
    return int(row[0])


def candidates(conn: Conn, **filters: Any) -> list[int]:
    names = named(filters)
    return [r[0] for r in conn.execute(f"SELECT id FROM outbox_replay_candidates({names})", filters).fetchall()]


def rows_after(conn: Conn, last_id: int) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM outbox WHERE id > %s ORDER BY id", (last_id,)).fetchall()


def max_id(conn: Conn) -> int:
    return int(conn.execute("SELECT coalesce(max(id), 0) FROM outbox").fetchone()[0])  # type: ignore[index]


# -- what a copy is, and its order ---------------------------------------------------------------

def test_copies_are_new_events_in_original_order_behind_what_waits(conn: Conn) -> None:
    # Three aggregates, interleaved; some events with headers and a subject of their own.
    allow_subjects(conn, "shop")
    originals = []
    for n in range(9):
        agg = f"o-{n % 3}"
        cols: dict[str, Any] = {"headers": f'{{"Trace-Id": "t{n}"}}'} if n % 2 else {"subject": f"shop.order.{n}"}
        originals.append(insert(conn, "order", agg, f"step{n}", f'{{"n": {n}}}', **cols))
    publish_all(conn)
    waiting = insert(conn, "order", "o-1", "later")          # pending, written before the replay
    before = {r["id"]: r for r in rows_after(conn, 0)}
    last = max_id(conn)

    assert replay(conn, aggregate_type="order") == 9

    copies = rows_after(conn, last)
    assert len(copies) == 9
    # One statement, ids assigned in the originals' order: every aggregate's copies in its order.
    assert [int(c["headers"]["Outbox-Replay-Of"]) for c in copies] == originals
    for c in copies:
        o = before[int(c["headers"]["Outbox-Replay-Of"])]
        assert (c["aggregate_type"], c["aggregate_id"], c["event_type"], c["payload"], c["subject"], c["msg_id"]) == \
            (o["aggregate_type"], o["aggregate_id"], o["event_type"], o["payload"], o["subject"], o["msg_id"])
        assert c["headers"] == {**o["headers"], "Outbox-Replay-Of": str(o["id"])}
        assert (c["state"], c["attempts"], c["published_at"]) == ("pending", 0, None)
    # The originals are untouched.
    assert {r["id"]: r for r in rows_after(conn, 0) if r["id"] <= last} == before

    # Claimed per aggregate in id order: o-1's waiting event first, then its copies.
    handed_out: dict[str, list[int]] = defaultdict(list)
    while rows := claim(conn, 2):
        for r in rows:
            handed_out[r["aggregate_id"]].append(r["id"])
        complete(conn, [r["id"] for r in rows], rows[0]["lease_token"])
    by_aggregate: dict[str, list[int]] = defaultdict(list)
    for c in copies:
        by_aggregate[c["aggregate_id"]].append(c["id"])
    assert handed_out == {"o-0": by_aggregate["o-0"], "o-1": [waiting, *by_aggregate["o-1"]],
                          "o-2": by_aggregate["o-2"]}


def test_new_msg_id_gives_every_copy_a_fresh_one(conn: Conn) -> None:
    ids = insert_series(conn, ["a", "b", "a"])
    publish_all(conn)
    last = max_id(conn)
    assert replay(conn, ids=ids, new_msg_id=True) == 3
    original = dict(conn.execute("SELECT id, msg_id FROM outbox WHERE id <= %s", (last,)).fetchall())
    copies = rows_after(conn, last)
    assert len({c["msg_id"] for c in copies} | set(original.values())) == 6
    # And by default the same one.
    last = max_id(conn)
    assert replay(conn, ids=ids) == 3
    assert [c["msg_id"] for c in rows_after(conn, last)] == [original[i] for i in ids]


def test_a_dead_head_holds_the_copies_back(conn: Conn) -> None:
    published = insert(conn, "order", "o-1", "created")
    publish_all(conn)
    dead = insert(conn, "order", "o-1", "paid")
    (row,) = claim(conn, 1)
    assert fail(conn, dead, row["lease_token"], "boom", True) == "dead"
    assert replay(conn, ids=[published]) == 1
    assert claim(conn, 10) == []        # order beats liveness for the aggregate: behind its dead letter


def test_replay_is_held_back_by_the_commit_order_guard_like_any_insert(dsn: str, conn: Conn) -> None:
    insert(conn, "order", "o-1", "created")
    publish_all(conn)
    with psycopg.connect(dsn) as replaying:           # a transaction left open after the replay
        assert replay(replaying, aggregate_id="o-1") == 1
        later = insert(conn, "order", "o-1", "paid")   # committed, a higher id than the open copy
        other = insert(conn, "order", "o-2", "created")
        assert [r["id"] for r in claim(conn, 10)] == [other]   # o-1 waits for the replay's commit
        replaying.commit()
    rows = claim(conn, 10)
    assert [r["event_type"] for r in rows] == ["created", "paid"] and rows[1]["id"] == later


def test_python_helper_sync_and_async(dsn: str, conn: Conn) -> None:
    ids = insert_series(conn, ["a", "b", "a"])
    publish_all(conn)
    last = max_id(conn)
    with conn.transaction():           # it never commits: the caller's transaction does
        assert outboxpg.replay(conn, aggregate_id="a", since=datetime.now(UTC) - timedelta(hours=1)) == 2
    assert [int(c["headers"]["Outbox-Replay-Of"]) for c in rows_after(conn, last)] == [ids[0], ids[2]]
    with pytest.raises(BadFilter, match="no filter given"):
        outboxpg.replay(conn, new_msg_id=True)

    async def from_asyncio() -> int:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            return await outboxpg.replay(aconn, ids=ids[1:2], new_msg_id=True)
    assert asyncio.run(from_asyncio()) == 1
    (copy,) = rows_after(conn, last + 2)
    assert copy["aggregate_id"] == "b" and copy["headers"]["Outbox-Replay-Of"] == str(ids[1])


def test_python_helper_takes_max_events_all_or_nothing(dsn: str, conn: Conn) -> None:
    """Issue 25 (12): outboxpg.replay() passes max_events (default 10,000, outbox_replay's); more
    matches than that copy nothing and raise InvalidParameterValue naming max_events."""
    insert_series(conn, [f"a{n}" for n in range(6)])
    publish_all(conn)
    last = max_id(conn)
    since = datetime.now(UTC) - timedelta(hours=1)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"more than max_events \(5\)"):
        outboxpg.replay(conn, since=since, max_events=5)
    assert rows_after(conn, last) == []
    assert outboxpg.replay(conn, since=since, max_events=6) == 6

    async def from_asyncio() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="max_events"):
                await outboxpg.replay(aconn, since=since, max_events=5)
    asyncio.run(from_asyncio())
    assert len(rows_after(conn, last)) == 6


def test_python_helper_default_cap_is_ten_thousand(conn: Conn) -> None:
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', 'o-' || n, 'created', '{}' FROM generate_series(1, 10001) n")
    conn.execute("UPDATE outbox SET state = 'published', published_at = now()")
    last = max_id(conn)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=r"more than max_events \(10000\)"):
        outboxpg.replay(conn, since=datetime(1970, 1, 1, tzinfo=UTC))
    assert rows_after(conn, last) == []


# -- filters -----------------------------------------------------------------------------------

def test_filters_select_published_events_only(conn: Conn) -> None:
    old = insert_series(conn, ["o-1", "o-2"], created_at="now() - interval '3 hours'")
    recent_created = insert_series(conn, ["o-1", "o-3"])
    recent_paid = insert_series(conn, ["o-1"], event_type="paid")
    customer = insert_series(conn, ["o-1"], aggregate_type="customer")
    publish_all(conn)
    pending = insert(conn, "order", "o-1", "created")
    dead = insert(conn, "order", "o-9", "created")
    discarded = insert(conn, "order", "o-8", "created")
    for row in claim(conn, 10):
        if row["id"] != pending:
            fail(conn, row["id"], row["lease_token"], "boom", True)
    discard(conn, [discarded], "not needed")
    everything = [*old, *recent_created, *recent_paid, *customer]
    now = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]

    assert candidates(conn, ids=[*everything, pending, dead, discarded, 424242]) == everything
    assert candidates(conn, aggregate_type="order") == [*old, *recent_created, *recent_paid]
    assert candidates(conn, aggregate_id="o-1") == [old[0], recent_created[0], *recent_paid, *customer]
    assert candidates(conn, aggregate_type="order", aggregate_id="o-1") == [old[0], recent_created[0], *recent_paid]
    assert candidates(conn, event_type="paid") == recent_paid
    hour = timedelta(hours=1)
    assert candidates(conn, until=now - hour) == old
    assert candidates(conn, since=now - hour) == [*recent_created, *recent_paid, *customer]
    assert candidates(conn, since=now - 4 * hour, until=now - 2 * hour) == old
    assert candidates(conn, since=now - hour, until=now + hour, event_type="created", aggregate_id="o-3") == \
        [recent_created[1]]
    # No match: 0, nothing inserted, no error.
    last = max_id(conn)
    assert replay(conn, aggregate_id="nobody") == 0
    assert replay(conn, ids=[]) == 0
    assert replay(conn, ids=[pending, dead, discarded]) == 0
    assert max_id(conn) == last
    # The filters of the function are the filters of its dry run.
    assert replay(conn, aggregate_id="o-1", since=now - hour) == 3
    assert [int(c["headers"]["Outbox-Replay-Of"]) for c in rows_after(conn, last)] == \
        [recent_created[0], *recent_paid, *customer]


@pytest.mark.parametrize("call", [
    "outbox_replay()", "outbox_replay(new_msg_id => true)", "outbox_replay_candidates()",
    "outbox_replay(NULL, NULL, NULL, NULL, NULL, NULL, false)"])
def test_no_filter_is_refused(conn: Conn, call: str) -> None:
    last = insert(conn)
    publish_all(conn)
    with pytest.raises(BadFilter, match="outbox_replay: no filter given: refusing to replay every published event"):
        conn.execute(f"SELECT * FROM {call}")
    assert max_id(conn) == last


def test_bad_arguments_are_refused(conn: Conn) -> None:
    with pytest.raises(BadFilter, match=r"outbox_replay: since \(.*\) is not before until"):
        conn.execute("SELECT outbox_replay(since => now(), until => now() - interval '1 hour')")
    with pytest.raises(BadFilter, match="is not before until"):
        conn.execute("SELECT outbox_replay(since => now(), until => now())")
    with pytest.raises(psycopg.errors.NullValueNotAllowed, match="new_msg_id must not be NULL"):
        conn.execute("SELECT outbox_replay(ids => ARRAY[1], new_msg_id => NULL)")


def test_bad_arguments_are_refused_whatever_the_plan(conn: Conn) -> None:
    """The refusals come before the INSERT: with a hash join over an empty outbox (PostgreSQL 18's
    plan here; forced on every major) the candidates are never read, so their own checks would not run."""
    conn.execute("SET enable_nestloop = off")
    conn.execute("SET enable_mergejoin = off")
    with pytest.raises(BadFilter, match="is not before until"):
        conn.execute("SELECT outbox_replay(since => now(), until => now() - interval '1 hour')")
    with pytest.raises(BadFilter, match="no filter given"):
        conn.execute("SELECT outbox_replay()")
    with pytest.raises(psycopg.errors.NullValueNotAllowed, match="include_replays must not be NULL"):
        conn.execute("SELECT outbox_replay(ids => ARRAY[1], include_replays => NULL)")


# -- copies of copies -----------------------------------------------------------------------------

def test_replays_copy_originals_only_and_do_not_compound(conn: Conn) -> None:
    """Replaying an aggregate twice copies its 3 originals twice, not 3 then 6: a copy records the
    event it copies (replay_of) and is a candidate only with include_replays."""
    originals = [insert(conn, "order", "o-17", "shipped") for _ in range(3)]
    insert(conn, "order", "o-18", "shipped")
    publish_all(conn)
    assert replay(conn, aggregate_id="o-17") == 3
    publish_all(conn)
    assert candidates(conn, aggregate_id="o-17") == originals
    assert replay(conn, aggregate_id="o-17", new_msg_id=True) == 3
    publish_all(conn)
    copies = conn.execute("SELECT id, replay_of, headers->>'Outbox-Replay-Of' FROM outbox "
                          "WHERE aggregate_id = 'o-17' AND id > %s ORDER BY id", (originals[-1],)).fetchall()
    assert [c[1] for c in copies] == originals * 2
    assert all(c[2] == str(c[1]) for c in copies)
    assert conn.execute("SELECT count(*) FROM outbox WHERE replay_of IS NULL").fetchone() == (4,)
    # Asked for: the copies too, and a copy of a copy names the copy it was made from.
    everything = candidates(conn, aggregate_id="o-17", include_replays=True)
    assert everything == originals + [c[0] for c in copies]
    assert candidates(conn, ids=[copies[0][0]]) == []
    last = max_id(conn)
    assert replay(conn, ids=[copies[0][0]], include_replays=True) == 1
    assert [c["replay_of"] for c in rows_after(conn, last)] == [copies[0][0]]


def test_producers_may_not_write_replay_of(dsn: str, conn: Conn) -> None:
    with login_roles(dsn, producer="outbox_producer") as logins, logins["producer"].connect() as c:
        with pytest.raises(Denied, match="permission denied for table outbox"):
            c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, replay_of) "
                      "VALUES ('order', '1', 'created', '{}', 1)")


# -- privileges ------------------------------------------------------------------------------

def test_operators_only(dsn: str, conn: Conn) -> None:
    ids = insert_series(conn, ["a", "b"])
    publish_all(conn)
    with login_roles(dsn, producer="outbox_producer", worker="outbox_worker", operator="outbox_operator") as logins:
        for who in ("worker", "producer"):
            with logins[who].connect() as c:
                for stmt in ("SELECT outbox_replay(ids => ARRAY[1])", "SELECT * FROM outbox_replay_candidates(ids => ARRAY[1])"):
                    with pytest.raises(Denied, match="permission denied for function outbox_replay"):
                        c.execute(stmt)
        last = max_id(conn)
        with logins["operator"].connect() as c:
            assert candidates(c, aggregate_type="order") == ids
            assert replay(c, aggregate_type="order") == 2
            # It may not read the payloads it copied, nor insert events of its own.
            with pytest.raises(Denied):
                c.execute("SELECT payload FROM outbox")
            with pytest.raises(Denied):
                c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                          "VALUES ('order', 'x', 'created', '{}')")
    assert [c["payload"] for c in rows_after(conn, last)] == [{"n": 1}, {"n": 2}]


# -- end to end: a worker and JetStream ----------------------------------------------------------

async def test_jetstream_drops_same_msg_id_copies_and_stores_new_ones_in_order(dsn: str, conn: Conn,
                                                                                  nats_server: Any) -> None:
    stream = await make_stream(nats_server.url, duplicate_window=600)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    duplicates: list[int] = []
    running = start(dsn, NatsPublisher(nats_server.url, on_duplicate=duplicates.append), batch_size=4)
    try:
        conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                     "SELECT 'order', 'o-' || (n % 3), 'step', jsonb_build_object('n', n) "
                     "FROM generate_series(1, 12) n")
        await wait_until(lambda: _equals(count_in(dsn, "published"), 12), 30, "12 events published")
        assert (await stream.js.stream_info(stream.name)).state.messages == 12
        originals = [r[0] for r in conn.execute("SELECT id FROM outbox ORDER BY id").fetchall()]
        per_aggregate = dict(conn.execute("SELECT aggregate_id::text, array_agg(id ORDER BY id) FROM outbox "
                                          "GROUP BY 1").fetchall())

        # Same msg_id: delivered by the worker, dropped by JetStream inside its duplicate window.
        assert replay(conn, aggregate_type="order") == 12
        await wait_until(lambda: _equals(count_in(dsn, "published"), 24), 30, "12 copies published")
        assert len(duplicates) == 12
        assert (await stream.js.stream_info(stream.name)).state.messages == 12

        # A new msg_id: stored again, in the original order of each aggregate.
        assert replay(conn, ids=originals, new_msg_id=True) == 12
        await wait_until(lambda: _equals(count_in(dsn, "published"), 36), 30, "12 new copies published")
        assert len(duplicates) == 12
        info = await stream.js.stream_info(stream.name)
        assert info.state.messages == 24
        replayed: dict[str, list[int]] = defaultdict(list)
        for seq in range(13, 25):
            m = await stream.js.get_msg(stream.name, seq)
            h = m.headers or {}
            replayed[h["Outbox-Aggregate-Id"]].append(int(h["Outbox-Replay-Of"]))
        assert replayed == per_aggregate
    finally:
        await running.stop()
        await stream.nc.close()


async def _equals(f: Any, n: int) -> bool:
    return bool(await f() == n)

