"""Metrics cardinality (issue 25, case 9): event_type is a Prometheus label and producers choose event
types; 100,000 of them made /metrics 54 MB. The worker keeps the first --metrics-event-types (100)
values and counts every other event type as 'other'. A real outboxpg-worker, PostgreSQL and
nats-server; /metrics scraped over HTTP."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import Proc
from helpers import set_settings
from jetstream import delete_stream

from outboxpg.embedded import EmbeddedNats, free_port

Conn = psycopg.Connection[Any]
DELIVERED = re.compile(r'^outboxpg_events_delivered_total\{event_type="([^"]*)"\} ([0-9.e+]+)$', re.M)


@pytest.mark.parametrize(("flag", "kept"), [(None, 100), ("7", 7)])
def test_a_thousand_event_types_keep_metrics_small(dsn: str, conn: Conn, tmp_path: Path, nats_server: EmbeddedNats,
                                                   flag: str | None, kept: int) -> None:
    t = uuid.uuid4().hex[:8]
    set_settings(conn, subject_prefix=f"p{t}")
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', 'o-' || n, 'type-' || n, '{}' FROM generate_series(1, 1000) n")
    port = free_port()
    w = Proc(tmp_path, "--dsn", dsn, "--nats-url", nats_server.url, "--ensure-stream", f"S{t}",
             "--metrics-port", str(port), *(("--metrics-event-types", flag) if flag else ()))
    try:
        # The worker counts a batch delivered after its complete commits: the rows can read
        # 'published' a moment before the counters show them, so scrape until they do.
        end = time.monotonic() + 30
        while True:
            assert time.monotonic() < end and w.p.poll() is None, w.text()
            if conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone() == (1000,):
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
                if sum(float(v) for _, v in DELIVERED.findall(body.decode())) == 1000:
                    break
            time.sleep(0.05)
    finally:
        assert w.stop() == 0, w.text()
        asyncio.run(delete_stream(nats_server.url, f"S{t}"))
    delivered = {label: float(value) for label, value in DELIVERED.findall(body.decode())}
    assert len(delivered) == kept + 1, sorted(delivered)
    assert delivered.pop("other") == 1000 - kept
    assert all(v == 1 for v in delivered.values())
    print(f"/metrics: {len(body)} bytes")
    assert len(body) < 40_000, f"/metrics is {len(body)} bytes"


def test_a_negative_cap_is_one_line(dsn: str) -> None:
    import subprocess

    from commands import WORKER

    r = subprocess.run([WORKER, "--dsn", dsn, "--metrics-port", "1", "--metrics-event-types", "-1"],
                       capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (2, ""), r
    assert r.stderr == "outboxpg-worker: --metrics-event-types must be 0 or more, got -1\n", r
