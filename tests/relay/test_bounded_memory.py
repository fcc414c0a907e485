"""Bounded memory (issue 25, case 6): a claim hands out at most a byte budget of events
(outbox_settings.max_claim_bytes, or outboxpg-worker --claim-bytes / OUTBOXPG_CLAIM_BYTES), so
ten events of 40 MB cost the worker a bounded amount of memory, however many there are, and the
other aggregates keep flowing past them. They were written with max_event_bytes raised to 64 MB;
over NATS' max_payload (1 MiB), they are dead-lettered at once, unsent."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import Proc
from helpers import set_settings

from outboxpg.embedded import EmbeddedNats

Conn = psycopg.Connection[Any]

BIG = 40_000_000
# Peak RSS the worker may reach (measured: see the commit that added this test). Before the byte
# budget, the ten events came in one claim (924 MB in the report).
MAX_RSS = 400 * 1024 * 1024


def peak_rss(pid: int) -> int:
    """The process's peak resident set size (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def write_big_and_small(conn: Conn) -> tuple[list[int], list[int]]:
    set_settings(conn, max_event_bytes=64_000_000)
    big = [conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                        "VALUES ('file', %s, 'uploaded', jsonb_build_object('blob', repeat('x', %s))) RETURNING id",
                        (f"f-{n}", BIG)).fetchone()[0] for n in range(10)]
    small = [r[0] for r in conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
        "SELECT 'order', 'o-' || (n % 20), 'created', jsonb_build_object('n', n) FROM generate_series(1, 200) n "
        "RETURNING id").fetchall()]
    return big, small


def run_until_settled(conn: Conn, w: Proc, big: list[int], small: list[int]) -> tuple[float, int]:
    """(seconds until every small event was published, the worker's peak RSS once all is settled)."""
    start = time.monotonic()
    small_done = None
    while True:
        assert w.p.poll() is None, w.text()
        states = dict(conn.execute("SELECT id, state::text FROM outbox WHERE id = ANY(%s)", (big + small,)).fetchall())
        if small_done is None and all(states[i] == "published" for i in small):
            small_done = time.monotonic() - start
        if small_done is not None and all(states[i] == "dead" for i in big):
            return small_done, peak_rss(w.p.pid)
        assert time.monotonic() - start < 120, states
        time.sleep(0.1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("budget", ["setting", "flag", "environment"])
def test_forty_megabyte_events_cost_a_bounded_amount_of_memory(dsn: str, conn: Conn, tmp_path: Path,
                                                               nats_server: EmbeddedNats, budget: str) -> None:
    big, small = write_big_and_small(conn)
    args: list[str] = []
    env: dict[str, str] = {}
    if budget == "setting":
        set_settings(conn, max_claim_bytes=50_000_000)
    elif budget == "flag":
        args = ["--claim-bytes", "50000000"]
    else:
        env = {"OUTBOXPG_CLAIM_BYTES": "50000000"}
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--ensure-stream", "MEMORY", *args, env=env)
    try:
        small_seconds, rss = run_until_settled(conn, w, big, small)
    finally:
        assert w.stop() == 0, w.text()
    print(f"budget from the {budget}: peak RSS {rss / 2**20:.0f} MiB, small events published in {small_seconds:.1f} s")
    assert rss < MAX_RSS, f"peak RSS {rss / 2**20:.0f} MiB"
    assert small_seconds < 30, "the other aggregates waited"
    last_errors = [r[0] for r in conn.execute("SELECT last_error FROM outbox WHERE id = ANY(%s)", (big,)).fetchall()]
    assert all("exceeds the NATS server's max_payload" in e for e in last_errors), last_errors[0]
