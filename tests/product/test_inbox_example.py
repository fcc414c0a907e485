"""examples/inbox_consumer.py against a real nats-server and PostgreSQL: every event once in the
consumer's table, though the stream holds duplicates and a crash between commit and ack redelivers."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import psycopg
from jetstream import make_stream

from outboxpg import schema
from outboxpg.embedded import EmbeddedNats

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "inbox_consumer.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("inbox_consumer", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Crash(Exception):
    pass


async def test_each_event_once(empty_dsn: str, nats_server: EmbeddedNats) -> None:
    schema.migrate_inbox(empty_dsn)                      # no outbox in the consumer's database
    example = _example()
    handle = await make_stream(nats_server.url, duplicate_window=0.5)
    try:
        for i in range(20):
            await handle.js.publish(f"{handle.prefix}.order", b"%d" % i, headers={"Nats-Msg-Id": f"evt-{i}"})
        await asyncio.sleep(0.8)                         # past the stream's duplicate window:
        for i in range(5):                               # the same ids again, stored twice
            await handle.js.publish(f"{handle.prefix}.order", b"%d" % i, headers={"Nats-Msg-Id": f"evt-{i}"})

        def crash_once(msg_id: str, first: bool) -> None:   # after the commit, before the ack
            if msg_id == "evt-7" and first:
                raise Crash(msg_id)

        try:
            await example.consume(empty_dsn, nats_server.url, handle.name, f"{handle.prefix}.>", "billing",
                                  ack_wait=1.0, idle_exit=1.0, before_ack=crash_once)
        except Crash:
            pass
        counts = await example.consume(empty_dsn, nats_server.url, handle.name, f"{handle.prefix}.>", "billing",
                                       ack_wait=1.0, idle_exit=2.0)
    finally:
        await handle.nc.close()
    with psycopg.connect(empty_dsn) as c:
        rows = c.execute("SELECT count(*), count(DISTINCT msg_id) FROM billing_effects").fetchone()
    assert rows == (20, 20)
    assert counts["duplicates"] >= 6                     # the 5 stored twice and evt-7's redelivery
