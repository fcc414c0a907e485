"""The worker behind a real PgBouncer in transaction mode (Debian's pgbouncer, run by the
``pgbouncer`` fixture): ``--poll-only`` prepares nothing and leaves no session state on the
pooled server connections; without it the worker refuses to start, in one line."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import WORKER
from jetstream import make_stream, read_stream
from pgbouncer import PgBouncer, find_pgbouncer

from outboxpg import Event, enqueue_many
from outboxpg.embedded import free_port
from outboxpg.relay.pooler import behind_transaction_pooler


def spawn(dsn: str, nats_url: str, *extra: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([WORKER, "--dsn", dsn, "--nats-url", nats_url, "--name", "pooled",
                             "--summary-interval", "1", *extra],
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def published(conn: psycopg.Connection[Any]) -> int:
    return conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0]


def session_state(pgb: PgBouncer, dbname: str, pids: set[int]) -> dict[int, tuple[Any, ...]]:
    """What each of PgBouncer's server connections ``pids`` carries in its session: prepared
    statements, LISTEN channels, advisory locks, a non-default synchronous_commit.

    One client connection per server connection, each inside a transaction (so that none gives
    its server connection back): the pool hands idle server connections out before it opens new
    ones, so the transactions land on every server connection there is."""
    clients = [psycopg.connect(pgb.dsn_for(dbname), prepare_threshold=None) for _ in range(len(pids) + 2)]
    try:
        seen = {}
        for c in clients:
            row = c.execute(
                "SELECT pg_backend_pid(), (SELECT count(*) FROM pg_prepared_statements),"
                "       (SELECT count(*) FROM pg_listening_channels()),"
                "       (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),"
                "       current_setting('synchronous_commit')").fetchone()
            seen[row[0]] = row[1:]
        return seen
    finally:
        for c in clients:
            c.close()


def no_advisory_locks(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT pid, classid, objid, objsubid, mode FROM pg_locks WHERE locktype = 'advisory' "
                        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())").fetchall()


@pytest.mark.slow
@pytest.mark.parametrize("route", ["pgbouncer", "direct"])
async def test_poll_only_delivers_5000_events_once_and_in_order(
        route, dsn, conn, nats_server, pgbouncer, tmp_path, capsys):
    """The same run through PgBouncer (transaction mode) and straight to PostgreSQL, both with
    --poll-only: every event once, in order per aggregate, no database error, and afterwards no
    session state on any of PgBouncer's server connections. The rates are printed, not asserted."""
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    total, aggregates = 5_000, 100
    with psycopg.connect(dsn) as c:
        enqueue_many(c, [Event("order", str(i % aggregates), "updated", {"i": i}) for i in range(total)])
    worker_dsn = pgbouncer.dsn_for(conn.info.dbname) if route == "pgbouncer" else dsn
    log = tmp_path / "worker.log"
    t0 = time.monotonic()
    metrics_port = free_port()
    proc = spawn(worker_dsn, nats_server.url, "--poll-only", "--poll-interval", "1",
                 "--metrics-port", str(metrics_port), log=log)
    try:
        deadline = t0 + 120
        while published(conn) < total and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        wall = time.monotonic() - t0
        done = published(conn)
        # The metrics' database gauges come through the same route (one statement per scrape).
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    finally:
        rc = stop(proc)
    text = log.read_text()
    assert rc == 0, text
    assert done == total, f"{done} of {total} published in {wall:.1f} s\n{text[-3000:]}"
    assert "event=db_error" not in text, text[-3000:]
    assert "\noutboxpg_backlog_events 0.0\n" in scraped, scraped
    span = conn.execute("SELECT extract(epoch FROM max(published_at) - min(published_at)) FROM outbox").fetchone()[0]
    with capsys.disabled():
        print(f"\n[{route}] --poll-only: {total} events of {aggregates} aggregates delivered in {wall:.2f} s "
              f"from the worker's start ({total / wall:,.0f}/s); first to last published_at {float(span):.2f} s "
              f"({total / max(float(span), 1e-3):,.0f}/s)")

    msgs = await read_stream(stream)
    await stream.nc.close()
    assert len(msgs) == total and len({m.msg_id for m in msgs}) == total
    by_aggregate: dict[str, list[int]] = defaultdict(list)
    for m in msgs:
        by_aggregate[m.aggregate].append(m.outbox_id)
    expected: dict[str, list[int]] = defaultdict(list)
    for agg, id_ in conn.execute("SELECT aggregate_type || '/' || aggregate_id, id FROM outbox ORDER BY id"):
        expected[agg].append(id_)
    assert by_aggregate == expected

    if route == "pgbouncer":
        # The worker is gone, PgBouncer's server connections stay (server_idle_timeout is 600 s):
        # none of them may carry anything of the worker's session into other clients' transactions.
        assert no_advisory_locks(conn) == []
        servers = pgbouncer.server_pids(conn.info.dbname)
        assert servers, "PgBouncer keeps its server connections open after the worker left"
        state = session_state(pgbouncer, conn.info.dbname, servers)
        assert servers <= state.keys()
        assert {pid: state[pid] for pid in servers} == {pid: (0, 0, 0, "on") for pid in servers}


def test_worker_without_poll_only_behind_transaction_pooler_exits_2_in_one_line(conn, nats_server, pgbouncer,
                                                                                  tmp_path):
    log = tmp_path / "worker.log"
    proc = spawn(pgbouncer.dsn_for(conn.info.dbname), nats_server.url, log=log)
    try:
        rc = proc.wait(30)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise AssertionError(f"still running behind a transaction pooler:\n{log.read_text()[-2000:]}") from None
    lines = log.read_text().strip().splitlines()
    assert rc == 2, lines
    assert len(lines) == 1 and lines[0].startswith("outboxpg-worker: ") and "--poll-only" in lines[0], lines
    assert "transaction pooler" in lines[0]
    # It took no lock on its way out: producers are not made to NOTIFY.
    assert no_advisory_locks(conn) == []


@pytest.mark.parametrize("mode, pooled", [("transaction", True), ("statement", True), ("session", False)])
async def test_pooler_probe_tells_transaction_pooling_from_sessions(mode, pooled, dsn, pg_server):
    binary, why = find_pgbouncer()
    if binary is None:
        pytest.skip(why)
    assert not await behind_transaction_pooler(dsn), "a direct connection is a session"
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with PgBouncer(binary, pg_server.host, pg_server.port, pg_server.user, pg_server.password,
                   pool_mode=mode) as pgb:
        # Twice: the second probe finds idle server connections left by the first.
        assert [await behind_transaction_pooler(pgb.dsn_for(dbname)) for _ in range(2)] == [pooled, pooled]
