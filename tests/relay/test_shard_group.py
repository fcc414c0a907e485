"""outboxpg-worker --shard-group: two worker processes split the shards between them (0/2 and
1/2); one is killed with SIGKILL while it holds leases; the other takes over every bucket at
once (0/1) and, once the dead worker's leases end, its runs. Every event is in the stream once,
in order per aggregate."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest
from commands import WORKER
from jetstream import make_stream, read_stream
from test_worker_process import fill, stop, wait_for


def spawn(dsn: str, nats_url: str, name: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [WORKER, "--dsn", dsn, "--nats-url", nats_url, "--name", name, "--shard-group", "relays",
         "--batch-size", "50", "--concurrency", "2", "--lease", "3", "--publish-timeout", "1",
         "--summary-interval", "1"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def shards_logged(log: Path) -> list[str]:
    return re.findall(r"event=shard worker=\S+ group=relays shard=(\S+)", log.read_text())


def wait_log(log: Path, shard: str, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while shard not in shards_logged(log):
        assert time.monotonic() < end, f"{log.name}: no shard={shard} in {shards_logged(log)}"
        time.sleep(0.05)


@pytest.mark.slow
async def test_a_killed_members_shard_is_taken_over_every_event_once_in_order(dsn, conn, nats_server, tmp_path):
    conn.execute("SELECT outbox_shards_enable()")
    conn.execute("UPDATE outbox_settings SET backoff_base = '50 milliseconds', backoff_cap = '200 milliseconds'")
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    total = 10_000
    logs = {n: tmp_path / f"{n}.log" for n in ("first", "second")}
    first = spawn(dsn, nats_server.url, "first", logs["first"])
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_log(logs["first"], "0/1")                         # alone: the whole outbox
        second = spawn(dsn, nats_server.url, "second", logs["second"])
        wait_log(logs["second"], "1/2")                        # the second slot: the upper half
        wait_log(logs["first"], "0/2")
        fill(dsn, total, aggregates=400)                       # written once both have their shard
        # Kill the second at a moment it holds leases in its shard (mid-run): frozen (SIGSTOP)
        # every few ms until it is caught holding some, then killed outright.
        holding = ("SELECT id FROM outbox WHERE state = 'processing' AND locked_by = 'second' "
                   "AND outbox_aggregate_bucket(aggregate_type, aggregate_id) >= 32")
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the second worker never held a lease in its shard"
            if not conn.execute(holding).fetchall():
                time.sleep(0.005)
                continue
            second.send_signal(signal.SIGSTOP)
            time.sleep(0.2)      # a statement it sent just before (a complete) still runs: let it end
            if conn.execute(holding).fetchall():
                break
            second.send_signal(signal.SIGCONT)
        second.send_signal(signal.SIGKILL)
        second.wait(10)
        wait_for(conn, "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE '%second%'", 0, timeout=10)
        leased = {r[0] for r in conn.execute("SELECT id FROM outbox WHERE state = 'processing' "
                                             "AND locked_by = 'second'").fetchall()}
        assert leased, "the killed worker held no lease"
        wait_log(logs["first"], "0/1", timeout=10)              # its session's lock went with it
        wait_for(conn, "SELECT count(*) FROM outbox WHERE state = 'published'", total, timeout=90)
    finally:
        stop(first)                                            # processes this test started, by PID
        if second is not None and second.poll() is None:
            second.kill()
            second.wait()
    # The dead worker's runs: fenced until their leases ended, then published by the first.
    rows = conn.execute("SELECT id, locked_by, attempts FROM outbox WHERE id = ANY (%s)", (list(leased),)).fetchall()
    assert {r[1] for r in rows} == {"first"} and min(r[2] for r in rows) >= 1
    msgs = await read_stream(stream)
    await stream.nc.close()
    assert len({m.msg_id for m in msgs}) == total and len(msgs) == total   # once each (msg_id dedup)
    per_aggregate: dict[str, list[int]] = defaultdict(list)
    for m in msgs:                                             # stream order
        per_aggregate[m.aggregate].append(m.outbox_id)
    assert len(per_aggregate) == 400
    for aggregate, ids in per_aggregate.items():
        assert ids == sorted(ids), f"{aggregate} out of id order"
