"""outboxpg.testing, as an application uses it: a test project (pytester) that points
outbox_dsn at the real test database, writes events in a transaction and asserts what drain
published, in order; sync and async; a failing event is retried, not lost."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = '''
import pytest

@pytest.fixture
def outbox_dsn():
    return {dsn!r}
'''

TESTS = '''
import asyncio
import psycopg
import outboxpg
from outboxpg.relay.publishers import PermanentError


def place_order(dsn, order_id):
    with psycopg.connect(dsn) as conn:          # the request's transaction
        outboxpg.enqueue(conn, "order", order_id, "OrderPlaced", {{"id": order_id}})
        outboxpg.enqueue(conn, "order", order_id, "OrderPaid", {{"id": order_id}})


def test_publishes_in_order(outbox_dsn, outbox_drain, outbox_published):
    place_order(outbox_dsn, "o-1")
    assert [e.event_type for e in outbox_drain()] == ["OrderPlaced", "OrderPaid"]
    assert outbox_published.payloads == [{{"id": "o-1"}}, {{"id": "o-1"}}]
    assert outbox_drain() == []                 # nothing left to claim


def test_many_batches(outbox_dsn, outbox_drain, outbox_published):
    with psycopg.connect(outbox_dsn) as conn:
        for n in range(250):
            outboxpg.enqueue(conn, "counter", "c", "Counted", {{"n": n}})
    outbox_drain()
    assert [p["n"] for p in outbox_published.payloads] == list(range(250))


async def test_async(outbox_dsn, outbox_drain_async, outbox_published):
    place_order(outbox_dsn, "o-2")
    events = await outbox_drain_async()
    assert [e.subject for e in events] == outbox_published.subjects and len(events) == 2


def test_failure_is_reported(outbox_dsn, outbox_drain, outbox_published):
    place_order(outbox_dsn, "o-3")
    outbox_published.fail = lambda e: PermanentError("no") if e.event_type == "OrderPlaced" else None
    assert outbox_drain() == []                  # dead-lettered; OrderPaid waits behind it
    with psycopg.connect(outbox_dsn) as conn:
        assert conn.execute("SELECT state FROM outbox WHERE event_type = 'OrderPlaced' AND aggregate_id = 'o-3'"
                            ).fetchone() == ("dead",)
'''


def test_plugin_in_an_application(pytester: pytest.Pytester, dsn: str) -> None:
    pytester.makeconftest(CONFTEST.format(dsn=dsn))
    pytester.makepyfile(test_app=TESTS.format())
    pytester.makeini("[pytest]\nasyncio_mode = auto\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)


def test_without_outbox_dsn_it_says_what_to_do(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_app="def test_it(outbox_drain):\n    outbox_drain()\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*define an `outbox_dsn` fixture in your conftest.py*"])
    assert result.ret != 0
