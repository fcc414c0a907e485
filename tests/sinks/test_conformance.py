"""The conformance suite: what every built-in sink does against its real server, run through a real
``outboxpg-worker --sink URL`` process on a real database (events written by SQL). Each test runs
once per case in tests/sinks/cases/ (conftest.py); conformance.py says what a case is."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conformance import (
    Row,
    SinkCase,
    SinkWorker,
    Stored,
    check_order,
    count,
    fast_settings,
    insert_events,
    rows,
    until,
)

Conn = psycopg.Connection[Any]

# The row's own headers on every event of these tests: carried as they are, beside the outbox's ids.
HEADERS = {"x-conformance": "carried", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def interleaved(lengths: dict[str, int]) -> list[str]:
    """Aggregate ids in insert order: one event of each aggregate in turn, so that the runs of
    several aggregates interleave in the table."""
    out: list[str] = []
    for r in range(max(lengths.values())):
        out += [agg for agg, n in lengths.items() if r < n]
    return out


def prepared(case: SinkCase, conn: Conn, **settings: Any) -> None:
    fast_settings(conn, **settings)
    case.prepare(conn)


async def stored_after(case: SinkCase) -> list[Stored]:
    if case.settle:
        await asyncio.sleep(case.settle)
    return await case.read_back()


def retried(conn: Conn) -> list[Any]:
    """Events that took more than one attempt or failed once: (id, attempts, last_error), a few."""
    return conn.execute("SELECT id, attempts, last_error FROM outbox WHERE attempts <> 1 OR last_error IS NOT NULL "
                        "ORDER BY id LIMIT 5").fetchall()


def published(conn: Conn, n: int) -> Any:
    return lambda: count(conn, "state = 'published'") >= n


def same_events(stored: list[Stored], expected: list[Row]) -> None:
    """The server holds exactly the expected events' msg_ids, whatever duplicates."""
    got, want = {s.msg_id for s in stored}, {r.msg_id for r in expected}
    assert got == want, f"{len(want - got)} events missing, {len(got - want)} unexpected"


async def test_every_event_is_stored_once_in_order_with_its_headers_and_ids(sink_case: SinkCase, conn: Conn,
                                                                            dsn: str, tmp_path: Path) -> None:
    prepared(sink_case, conn)
    # Single events and runs of up to 12, interleaved: 40 aggregates, 180 events.
    lengths = {f"c{i}": [1, 1, 2, 3, 5, 8, 12, 4][i % 8] for i in range(40)}
    insert_events(conn, interleaved(lengths), headers=HEADERS)
    worker = SinkWorker(sink_case, dsn, tmp_path / "worker.log")
    try:
        total = sum(lengths.values())
        await until(published(conn, total), 30, f"{total} events published", worker)
    finally:
        assert await worker.stop() == 0, worker.text()
    events = rows(conn)
    stored = await stored_after(sink_case)
    same_events(stored, events)
    assert len(stored) == len(events), f"{len(stored) - len(events)} duplicates: {Counter(s.msg_id for s in stored).most_common(3)}"
    per = check_order(stored, {r.msg_id: r for r in events})
    assert {agg: len(ids) for agg, ids in per.items()} == {f"order/{a}": n for a, n in lengths.items()}
    by_msg_id = {r.msg_id: r for r in events}
    for s in stored:
        row = by_msg_id[s.msg_id]
        assert s.subject == row.subject, (s, row)
        assert json.loads(s.payload) == row.payload, (s, row)
        headers = {k.lower(): v for k, v in s.headers.items()}
        for name, value in {**HEADERS, "outbox-id": str(row.id), "outbox-aggregate-type": "order",
                            "outbox-aggregate-id": row.aggregate.split("/", 1)[1],
                            "outbox-event-type": "updated"}.items():
            assert headers.get(name) == value, f"header {name}: {headers.get(name)!r}, not {value!r}: {s}"
    assert not retried(conn), f"{retried(conn)}\n{worker.text()[-4000:]}"
    assert "event=first_delivery" in worker.text()


@pytest.mark.parametrize("how", ["cut", "restart"])
async def test_a_connection_cut_or_a_server_restart_mid_run_loses_nothing_and_keeps_order(
        sink_case: SinkCase, conn: Conn, dsn: str, tmp_path: Path, how: str) -> None:
    # Runs of 20 (a sink publishes a run one event after another): 4 aggregates of 150 events.
    prepared(sink_case, conn, max_run=20)
    lengths = {f"r{i}": 150 for i in range(4)}
    insert_events(conn, interleaved(lengths))
    total = sum(lengths.values())
    sink_case.proxy.latency = sink_case.strike_latency   # about 1.5 s of publishing: room to strike mid-run
    worker = SinkWorker(sink_case, dsn, tmp_path / "worker.log")
    try:
        await until(published(conn, 60), 30, "the first events published", worker, interval=0.01)
        if how == "cut":
            await sink_case.cut()
        else:
            await sink_case.stop()
            await sink_case.start()
        at_strike = count(conn, "state = 'published'")
        assert at_strike < total, "everything was published before the strike: nothing was tested"
        await until(published(conn, total), 60, f"{total} events published after the {how}", worker)
    finally:
        sink_case.proxy.latency = 0.0
        assert await worker.stop() == 0, worker.text()
    events = rows(conn)
    assert count(conn, "state = 'dead'") == 0
    stored = await stored_after(sink_case)
    same_events(stored, events)
    check_order(stored, {r.msg_id: r for r in events})
    if sink_case.dedups:
        assert len(stored) == len(events), f"{len(stored) - len(events)} duplicates on a server that drops them"


async def test_an_event_the_server_refuses_dies_at_its_first_attempt_and_the_others_flow(
        sink_case: SinkCase, conn: Conn, dsn: str, tmp_path: Path) -> None:
    if sink_case.too_large is None:
        pytest.skip(f"{sink_case.name}: no payload the server refuses: {sink_case.too_large_why}")
    prepared(sink_case, conn)
    # The insert itself refuses an event over max_event_bytes: room for this one, to let the server refuse it.
    conn.execute("UPDATE outbox_settings SET max_event_bytes = greatest(max_event_bytes, %s)",
                 (len(sink_case.too_large) + 65536,))
    before = insert_events(conn, ["poisoned"])
    (poison,) = insert_events(conn, ["poisoned"], payload=sink_case.too_large)
    behind = insert_events(conn, ["poisoned"])
    others = insert_events(conn, interleaved({f"o{i}": 3 for i in range(10)}))
    worker = SinkWorker(sink_case, dsn, tmp_path / "worker.log")
    try:
        await until(lambda: count(conn, f"id = {poison} AND state = 'dead'") == 1, 30, "the refused event dead",
                    worker)
        await until(published(conn, len(before) + len(others)), 30, "the other aggregates' events", worker)
        # The connection (or whatever the refusal did to it) still carries what comes next.
        later = insert_events(conn, interleaved({f"l{i}": 2 for i in range(3)}))
        await until(published(conn, len(before) + len(others) + len(later)), 30, "the events written after", worker)
    finally:
        assert await worker.stop() == 0, worker.text()
    dead = next(r for r in rows(conn) if r.id == poison)
    assert dead.attempts == 1, dead
    assert dead.last_error is not None and sink_case.refused_reason in dead.last_error, dead.last_error
    assert conn.execute("SELECT state::text, attempts FROM outbox WHERE id = %s", behind).fetchone() == ("pending", 0)
    events = rows(conn)
    stored = await stored_after(sink_case)
    same_events(stored, [r for r in events if r.state == "published"])
    check_order(stored, {r.msg_id: r for r in events})


async def test_a_server_down_longer_than_a_lease_kills_nothing_early_and_loses_nothing(
        sink_case: SinkCase, conn: Conn, dsn: str, tmp_path: Path) -> None:
    prepared(sink_case, conn)
    first = insert_events(conn, [f"d{i}" for i in range(5)])
    worker = SinkWorker(sink_case, dsn, tmp_path / "worker.log", lease=2.0, publish_timeout=1.0)
    try:
        await until(published(conn, len(first)), 30, "the events before the outage", worker)
        await sink_case.stop()
        try:
            during = insert_events(conn, interleaved({f"d{i}": 8 for i in range(5)}))
            await asyncio.sleep(3.0)    # longer than the lease: leases run out, retries come due
            assert worker.p.poll() is None, worker.text()
            assert count(conn, "state = 'dead'") == 0
            assert count(conn, f"id >= {during[0]} AND state = 'published'") == 0, "published with the server down"
        finally:
            await sink_case.start()
        total = len(first) + len(during)
        await until(published(conn, total), 60, f"{total} events published after the outage", worker)
    finally:
        assert await worker.stop() == 0, worker.text()
    assert count(conn, "state = 'dead'") == 0
    events = rows(conn)
    stored = await stored_after(sink_case)
    same_events(stored, events)
    check_order(stored, {r.msg_id: r for r in events})


async def test_a_slow_server_has_the_leases_extended_and_nothing_published_twice(
        sink_case: SinkCase, conn: Conn, dsn: str, tmp_path: Path) -> None:
    """Every answer of the server the case's ``slow_latency`` late (0.6 s; runs of 7 sent one event
    at a time: a batch takes at least 4.2 s), past a third of the 12 s lease, when the worker
    extends its leases, and with 1.8 s to spare before the 6 s publish timeout on a busy machine
    (0.26 s of delay of its own per round trip: the machine's load adds to each of the seven, not
    to the server's latency); a second worker is there to take back any lease that ran out."""
    prepared(sink_case, conn)
    workers = [SinkWorker(sink_case, dsn, tmp_path / f"{name}.log", name=name, lease=12.0, publish_timeout=6.0,
                          extra=("--log-level", "DEBUG")) for name in ("w1", "w2")]
    try:
        for w in workers:
            await until(lambda w=w: "event=start " in w.text(), 30, "the worker started", w)
        sink_case.proxy.latency = sink_case.slow_latency
        lengths = {f"s{i}": 7 for i in range(10)}
        insert_events(conn, interleaved(lengths))
        total = sum(lengths.values())
        await until(published(conn, total), 60, f"{total} events published", workers[0])
    finally:
        sink_case.proxy.latency = 0.0
        codes = [await w.stop() for w in workers]
    logs = "\n".join(w.text() for w in workers)
    assert codes == [0, 0], logs
    assert "event=lease_extended" in logs, logs
    assert "event=lease_lost" not in logs, logs
    assert not retried(conn), f"{retried(conn)}\n{logs[-4000:]}"
    events = rows(conn)
    stored = await stored_after(sink_case)
    same_events(stored, events)
    assert len(stored) == len(events), f"{len(stored) - len(events)} published twice"
    check_order(stored, {r.msg_id: r for r in events})
