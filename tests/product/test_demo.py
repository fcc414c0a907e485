"""`outboxpg demo` (bin/demo): the whole flow on throwaway servers, and its latency count
(issue 10: "over 1999 events" of 2,000 in 2 runs of 3)."""

from __future__ import annotations

import re

import pytest

from outboxpg.demo import LatencyClock, run_demo


def test_an_event_that_arrives_before_the_commit_returns_is_counted() -> None:
    clock = LatencyClock()
    clock.committing("m-1")     # the producer sends COMMIT ...
    clock.received("m-1")       # ... the worker, woken by it, delivers before the reply is read
    clock.committing("m-2")
    clock.received("m-2")
    assert len(clock.latencies) == 2 and all(t >= 0 for t in clock.latencies)
    clock.received("m-unknown")  # not written by this demo: not timed
    assert len(clock.latencies) == 2 and clock.started == {}


@pytest.mark.slow
def test_demo_counts_every_event(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_demo(events=300, aggregates=10, rate=1000) == 0
    out = capsys.readouterr().out
    assert "OK: 300 of 300 events delivered (300 distinct)" in out, out
    m = re.search(r"commit -> consumer latency over (\d+) events", out)
    assert m and m.group(1) == "300", out
