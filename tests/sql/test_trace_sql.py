"""Trace context from plain SQL: SET LOCAL outboxpg.traceparent (migrations/0023_outbox_trace_context.sql)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from helpers import Running
from jetstream import make_stream
from workers import wait_until

from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.worker import Worker, WorkerConfig

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
INSERT = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) "
          "VALUES ('order', %s, 'created', '{}', %s::jsonb) RETURNING id")


def insert(conn: psycopg.Connection[Any], agg: str, headers: str = "{}") -> int:
    return int(conn.execute(INSERT, (agg, headers)).fetchone()[0])


def headers(conn: psycopg.Connection[Any], i: int) -> dict[str, str]:
    return conn.execute("SELECT headers FROM outbox WHERE id = %s", (i,)).fetchone()[0]


def test_set_local_traceparent_goes_into_every_event_of_the_transaction(conn):
    with conn.transaction():
        conn.execute(f"SET LOCAL outboxpg.traceparent = '{PARENT}'")
        conn.execute("SET LOCAL outboxpg.tracestate = 'shop=1'")
        a = insert(conn, "1")
        b = insert(conn, "2", '{"tenant": "t-9"}')
    after = insert(conn, "3")
    assert headers(conn, a) == {"traceparent": PARENT, "tracestate": "shop=1"}
    assert headers(conn, b) == {"tenant": "t-9", "traceparent": PARENT, "tracestate": "shop=1"}
    assert headers(conn, after) == {}                      # SET LOCAL ended with its transaction


def test_headers_that_hold_a_traceparent_keep_theirs(conn):
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with conn.transaction():
        conn.execute(f"SET LOCAL outboxpg.traceparent = '{PARENT}'")
        i = insert(conn, "1", f'{{"TraceParent": "{own}"}}')
    assert headers(conn, i) == {"TraceParent": own}


def test_a_malformed_traceparent_fails_the_insert_naming_the_setting(conn):
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="outboxpg.traceparent is not a W3C traceparent"):
        with conn.transaction():
            conn.execute("SET LOCAL outboxpg.traceparent = 'not-a-trace'")
            insert(conn, "1")
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)


async def test_the_nats_message_carries_the_sql_producers_trace_context(dsn, conn, nats_server):
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    with conn.transaction():
        conn.execute(f"SET LOCAL outboxpg.traceparent = '{PARENT}'")
        insert(conn, "1")
    running = Running(Worker(WorkerConfig(dsn=dsn, poll_interval=0.2), NatsPublisher(nats_server.url)))

    async def published() -> bool:
        return conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone() == (1,)

    try:
        await wait_until(published, 30, "the event published")
    finally:
        await running.stop()
    info = await stream.js.stream_info(stream.name)
    msg = await stream.js.get_msg(stream.name, info.state.last_seq)
    assert msg.headers["traceparent"] == PARENT
    await stream.nc.close()
