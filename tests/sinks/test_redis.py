"""The Redis Streams sink (outboxpg.sinks.redis) against private redis-server instances: what an
entry holds, a stream per subject or one stream, de-duplication of a retried publish after a lost
answer, MAXLEN trimming, what is permanent, what start() says, and a real Worker through it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
from redisd import RedisServer, ReplyLoser
from workers import all_in, event, start, wait_until

from outboxpg import Event, enqueue_many
from outboxpg.embedded import free_port
from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import NotSent, PermanentError
from outboxpg.sinks import open_sink
from outboxpg.sinks.base import SinkRefused, SinkSettings, SinkUnreachable
from outboxpg.sinks.redis import RedisSink


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[RedisServer]:
    srv = RedisServer(tmp_path / "redis")
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def db(server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = server.client()
    yield client
    await client.aclose()


async def opened(url: str, **options: str) -> RedisSink:
    sink = open_sink(SinkSettings(url=url, options=options, publish_timeout=3.0))
    assert isinstance(sink, RedisSink)
    await sink.start()
    return sink


def run_of(aggregate: str, n: int, first_id: int = 1, subject: str = "outbox.order.updated",
           **kw: Any) -> list[OutboxEvent]:
    return [event(first_id + k, subject, aggregate_id=aggregate, payload=b'{"n": %d}' % k, **kw) for k in range(n)]


async def entries(db: redis.asyncio.Redis, stream: str) -> list[dict[str, bytes]]:
    return [{k.decode(): v for k, v in fields.items()} for _id, fields in await db.xrange(stream)]


# -- options, no server --------------------------------------------------------------------------

def test_options_are_checked_when_the_sink_is_opened_and_the_password_never_shown() -> None:
    sink = open_sink(SinkSettings(url="redis://app:s3cret@127.0.0.1:6399/2?stream=events&maxlen=1000"))
    assert isinstance(sink, RedisSink)
    assert (sink.stream, sink.maxlen, sink.dedupe_window, sink.client_options) == ("events", 1000, 600, {})
    assert "s3cret" not in sink.describe() and "stream 'events'" in sink.describe() and "maxlen~1000" in sink.describe()
    flags = open_sink(SinkSettings(url="rediss://h?maxlen=5", options={"maxlen": "7", "dedupe_window": "900"}))
    assert isinstance(flags, RedisSink) and (flags.maxlen, flags.dedupe_window, flags.stream) == (7, 900, None)
    for url, wrong in [("redis://h?maxlen=0", "maxlen='0'"), ("redis://h?maxlen=many", "maxlen='many'"),
                       ("redis://h?dedupe_window=-1", "dedupe_window"), ("redis://h?stream=", "empty stream"),
                       ("redis://h?streams=x", "unknown option 'streams'"), ("redis://u:pw@h:port", "redis://h:...: the port is not a number"),
                       ("redis://:pw@/", "no host"), ("redis://h?db=x", "db='x'")]:
        with pytest.raises(ValueError, match=wrong) as info:
            open_sink(SinkSettings(url=url))
        assert "\n" not in str(info.value) and "pw" not in str(info.value)


# -- what is stored ------------------------------------------------------------------------------

async def test_an_entry_per_event_in_the_stream_of_its_subject_with_the_ids_and_row_headers(
        server: RedisServer, db: redis.asyncio.Redis) -> None:
    sink = await opened(server.url)
    try:
        headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                   "OUTBOX-ID": "forged", "payload": "forged"}
        events = [event(1, "outbox.order.created", aggregate_id="a", headers=headers),
                  event(2, "outbox.order.paid", aggregate_id="a", event_type="paid"),
                  event(3, "outbox.order.created", aggregate_id="b", attempt=2)]
        assert list(await sink.publish_batch(events)) == [None, None, None]
    finally:
        await sink.close()
    created = await entries(db, "outbox.order.created")
    assert [e["msg_id"].decode() for e in created] == [events[0].msg_id, events[2].msg_id]
    assert created[0] == {"msg_id": events[0].msg_id.encode(), "subject": b"outbox.order.created",
                          "Outbox-Id": b"1", "Outbox-Event-Type": b"created", "Outbox-Aggregate-Type": b"order",
                          "Outbox-Aggregate-Id": b"a", "Outbox-Attempt": b"0",
                          "traceparent": headers["traceparent"].encode(), "payload": b'{"i": 1}'}
    assert list(created[0])[-1] == "payload"
    assert created[1]["Outbox-Attempt"] == b"2"
    paid = await entries(db, "outbox.order.paid")
    assert [(e["Outbox-Id"], e["Outbox-Event-Type"]) for e in paid] == [(b"2", b"paid")]
    # The dedupe key holds the entry id, and expires within the window.
    entry_id = (await db.xrange("outbox.order.paid"))[0][0]
    assert await db.get(f"outboxpg:dedupe:{events[1].msg_id}") == entry_id
    assert 590 <= await db.ttl(f"outboxpg:dedupe:{events[1].msg_id}") <= 600


async def test_one_stream_for_every_subject_keeps_each_aggregates_order_across_chunks(
        server: RedisServer, db: redis.asyncio.Redis) -> None:
    sink = await opened(server.url, stream="all-events", dedupe_prefix="t:", dedupe_window="30")
    try:
        # A run of 150 (three script calls of at most 64), runs of 1 and 5, interleaved in the batch.
        long = run_of("long", 150, 1, subject="outbox.order.updated")
        short = run_of("short", 5, 1000, subject="outbox.order.paid")
        single = [event(2000 + k, f"outbox.thing{k}.created", aggregate_id=f"s{k}") for k in range(20)]
        runs = [long, short] + [[e] for e in single]
        batch = [r[k] for k in range(150) for r in runs if k < len(r)]   # interleaved, each run in id order
        assert list(await sink.publish_batch(batch)) == [None] * len(batch)
    finally:
        await sink.close()
    stored = await entries(db, "all-events")
    assert len(stored) == 175
    assert await db.exists("outbox.order.updated") == 0
    assert len(await db.keys("t:*")) == 175 and 25 <= await db.ttl(f"t:{long[0].msg_id}") <= 30
    per: dict[bytes, list[int]] = {}
    for e in stored:
        per.setdefault(e["Outbox-Aggregate-Id"], []).append(int(e["Outbox-Id"]))
    assert per[b"long"] == list(range(1, 151)) and per[b"short"] == list(range(1000, 1005))


async def test_the_urls_database_number_is_where_the_entries_go(server: RedisServer, db: redis.asyncio.Redis) -> None:
    for url, options in [(f"{server.url}/3", {}), (server.url, {"db": "5"})]:
        sink = await opened(url, **options)
        try:
            assert list(await sink.publish_batch([event(1, "outbox.order.created")])) == [None]
        finally:
            await sink.close()
    assert await db.exists("outbox.order.created") == 0
    for n in (3, 5):
        other = server.client(db=n)
        assert await other.xlen("outbox.order.created") == 1
        await other.aclose()


async def test_maxlen_trims_each_stream_approximately(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "redis", ["--stream-node-max-entries", "10"])
    await srv.start()
    db = srv.client()
    try:
        sink = await opened(srv.url, maxlen="20")
        try:
            for n in range(6):
                batch = [event(n * 50 + k, "outbox.order.updated", aggregate_id=f"a{k}") for k in range(50)]
                assert list(await sink.publish_batch(batch)) == [None] * 50
        finally:
            await sink.close()
        length = await db.xlen("outbox.order.updated")
        assert 20 <= length <= 30, length   # '~': whole nodes of 10 entries go, never below 20
        last = await db.xrevrange("outbox.order.updated", count=1)
        assert last[0][1][b"Outbox-Id"] == b"299"
    finally:
        await db.aclose()
        await srv.stop()


# -- retries store nothing twice -----------------------------------------------------------------

async def test_the_same_batch_published_again_stores_nothing_twice(server: RedisServer, db: redis.asyncio.Redis) -> None:
    sink = await opened(server.url)
    try:
        batch = run_of("a", 3) + [event(10, "outbox.order.updated", aggregate_id="b")]
        assert list(await sink.publish_batch(batch)) == [None] * 4
        await db.script_flush()   # as a restart without persistence does: NOSCRIPT, then loaded again
        assert list(await sink.publish_batch(batch[1:])) == [None] * 3
        assert sink.duplicates == 3
    finally:
        await sink.close()
    assert [e["msg_id"].decode() for e in await entries(db, "outbox.order.updated")] == [e.msg_id for e in batch]


async def test_a_publish_retried_after_its_answer_was_lost_stores_nothing_twice(
        server: RedisServer, db: redis.asyncio.Redis) -> None:
    proxy = ReplyLoser(server.port)
    port = await proxy.start()
    sink = await opened(f"redis://127.0.0.1:{port}")
    try:
        batch = run_of("a", 3) + [event(10, "outbox.order.updated", aggregate_id="b")]
        # The script runs in Redis, its answer is lost with the connection: redis-py sends the
        # pipeline again on a new connection (one retry), and the script finds every event stored.
        proxy.lose = 1
        assert list(await sink.publish_batch(batch)) == [None] * 4
        assert proxy.lost == 1 and sink.duplicates == 4
        # Lost twice (the retry too): the runs' first events fail, the rest are not sent; the
        # worker's next attempt stores nothing twice either.
        more = run_of("c", 2, 20)
        proxy.lose = 2
        outcomes = await sink.publish_batch(more)
        assert proxy.lost == 3
        assert isinstance(outcomes[0], RuntimeError) and isinstance(outcomes[1], NotSent), outcomes
        assert "Redis" in str(outcomes[0])
        assert list(await sink.publish_batch(more)) == [None, None]
        assert sink.duplicates == 6
    finally:
        await sink.close()
        await proxy.close()
    assert [e["msg_id"].decode() for e in await entries(db, "outbox.order.updated")] == [e.msg_id for e in batch + more]


async def test_a_server_down_fails_each_runs_first_event_and_is_the_sinks_health_problem_until_back(
        server: RedisServer, db: redis.asyncio.Redis) -> None:
    sink = await opened(server.url)
    try:
        assert list(await sink.publish_batch(run_of("a", 2))) == [None, None]
        assert sink.health_problem() is None
        await server.stop()
        batch = run_of("a", 2, 10) + [event(20, "outbox.order.updated", aggregate_id="b")]
        outcomes = await sink.publish_batch(batch)
        assert [type(o) for o in outcomes] == [RuntimeError, NotSent, RuntimeError], outcomes
        assert str(outcomes[0]).startswith("Redis: ConnectionError: Error 111 connecting")
        assert sink.health_problem() == str(outcomes[0])
        await server.start()   # the AOF kept the entries; the script cache is empty again
        assert list(await sink.publish_batch(batch)) == [None] * 3
        assert sink.health_problem() is None
    finally:
        await sink.close()
    assert [e["Outbox-Id"] for e in await entries(db, "outbox.order.updated")] == [b"1", b"2", b"10", b"11", b"20"]


# -- what is permanent ---------------------------------------------------------------------------

async def test_a_stream_key_of_another_type_dead_letters_that_event_and_the_others_are_stored(
        server: RedisServer, db: redis.asyncio.Redis) -> None:
    await db.set("outbox.order.blocked", "a string")
    sink = await opened(server.url)
    try:
        batch = [event(1, "outbox.order.updated", aggregate_id="a"), event(2, "outbox.order.blocked", aggregate_id="a"),
                 event(3, "outbox.order.updated", aggregate_id="a"), event(4, "outbox.order.updated", aggregate_id="b")]
        outcomes = await sink.publish_batch(batch)
    finally:
        await sink.close()
    assert outcomes[0] is None and outcomes[3] is None
    assert isinstance(outcomes[1], PermanentError) and "WRONGTYPE" in str(outcomes[1])
    assert "outbox.order.blocked" in str(outcomes[1])
    assert isinstance(outcomes[2], NotSent)
    assert [e["Outbox-Id"] for e in await entries(db, "outbox.order.updated")] == [b"1", b"4"]
    assert await db.exists(f"outboxpg:dedupe:{batch[1].msg_id}") == 0


async def test_redis_out_of_memory_is_retried_not_dead_lettered(server: RedisServer, db: redis.asyncio.Redis) -> None:
    sink = await opened(server.url)
    try:
        await db.config_set("maxmemory", "1")   # noeviction (the default): every write refused
        batch = run_of("a", 2) + [event(10, "outbox.order.updated", aggregate_id="b")]
        outcomes = await sink.publish_batch(batch)
        assert [type(o) for o in outcomes] == [RuntimeError, NotSent, RuntimeError], outcomes
        assert "OOM" in str(outcomes[0]) and not isinstance(outcomes[0], PermanentError)
        assert sink.health_problem() is None   # Redis answered: it is reachable
        await db.config_set("maxmemory", "0")
        assert list(await sink.publish_batch(batch)) == [None] * 3
    finally:
        await db.config_set("maxmemory", "0")
        await sink.close()
    assert [e["Outbox-Id"] for e in await entries(db, "outbox.order.updated")] == [b"1", b"2", b"10"]


async def test_an_event_over_proto_max_bulk_len_is_permanent_and_never_sent(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "redis", ["--proto-max-bulk-len", "1mb"])
    await srv.start()
    db = srv.client()
    try:
        sink = await opened(srv.url)
        try:
            assert sink.max_bulk_len == 1024 * 1024
            big = b'{"x": "' + b"y" * (1024 * 1024) + b'"}'
            batch = [event(1, "outbox.order.updated", aggregate_id="a"),
                     event(2, "outbox.order.updated", aggregate_id="a", payload=big),
                     event(3, "outbox.order.updated", aggregate_id="a"),
                     event(4, "outbox.order.updated", aggregate_id="b", payload=b'{"x": "' + b"y" * 900_000 + b'"}')]
            outcomes = await sink.publish_batch(batch)
            assert outcomes[0] is None and outcomes[3] is None
            assert isinstance(outcomes[1], PermanentError) and isinstance(outcomes[2], NotSent)
            assert str(outcomes[1]) == (f"payload of {len(big)} bytes exceeds the Redis server's "
                                        "proto-max-bulk-len of 1048576")
        finally:
            await sink.close()
        assert [e["Outbox-Id"] for e in await entries(db, "outbox.order.updated")] == [b"1", b"4"]
    finally:
        await db.aclose()
        await srv.stop()


# -- start ---------------------------------------------------------------------------------------

async def test_start_unreachable_wrong_password_and_not_redis_are_unreachable(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "redis", ["--requirepass", "right-secret"])
    await srv.start()
    nobody = RedisServer(tmp_path / "none")   # a free port nobody listens on

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    not_redis = await asyncio.start_server(http, "127.0.0.1", 0)
    not_redis_port = not_redis.sockets[0].getsockname()[1]
    try:
        for url, says in [(nobody.url, "Error 111 connecting"),
                          (f"redis://:wrong-secret@127.0.0.1:{srv.port}", "login refused"),
                          (f"redis://127.0.0.1:{srv.port}", "Authentication required"),
                          (f"redis://127.0.0.1:{not_redis_port}", "not a Redis server")]:
            sink = open_sink(SinkSettings(url=url, publish_timeout=2.0))
            try:
                with pytest.raises(SinkUnreachable, match=says) as info:
                    await sink.start()
            finally:
                await sink.close()
            assert "\n" not in str(info.value) and "secret" not in str(info.value)
        ok = await opened(f"redis://:right-secret@127.0.0.1:{srv.port}")
        assert list(await ok.publish_batch([event(1, "outbox.x")])) == [None]
        await ok.close()
    finally:
        not_redis.close()
        await srv.stop()


async def test_start_refuses_a_login_the_acl_keeps_from_scripts_or_xadd_and_a_cluster(
        server: RedisServer, db: redis.asyncio.Redis, tmp_path: Path) -> None:
    await db.execute_command("ACL", "SETUSER", "noscripts", "on", ">pw", "~*", "+@all", "-@scripting")
    await db.execute_command("ACL", "SETUSER", "noxadd", "on", ">pw", "~*", "+@all", "-xadd")
    await db.execute_command("ACL", "SETUSER", "onekey", "on", ">pw", "~events", "~outboxpg:dedupe:*", "+@all")
    for user, says in [("noscripts", "may not run the sink's scripts: NoPermissionError: .*eval"), ("noxadd", "may not XADD to")]:
        sink = open_sink(SinkSettings(url=f"redis://{user}:pw@127.0.0.1:{server.port}"))
        try:
            with pytest.raises(SinkRefused, match=says):
                await sink.start()
        finally:
            await sink.close()
    # Key patterns: the stream named by stream= is checked.
    sink = await opened(f"redis://onekey:pw@127.0.0.1:{server.port}", stream="events")
    await sink.close()
    with pytest.raises(SinkRefused, match="may not use the key 'other' or the keys outboxpg:dedupe:.*: NoPermissionError"):
        await opened(f"redis://onekey:pw@127.0.0.1:{server.port}", stream="other")

    cluster = RedisServer(tmp_path / "cluster", ["--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                                                 "--cluster-config-file", str(tmp_path / "cluster" / "nodes.conf")])
    await cluster.start()
    try:
        sink = open_sink(SinkSettings(url=cluster.url))
        try:
            with pytest.raises(SinkRefused, match="Redis Cluster is not supported"):
                await sink.start()
        finally:
            await sink.close()
    finally:
        await cluster.stop()


# -- through a worker ----------------------------------------------------------------------------

async def test_a_worker_delivers_through_the_sink_once_each_in_order_despite_lost_answers(
        dsn: str, conn: Any, server: RedisServer, db: redis.asyncio.Redis, fast_retries: None) -> None:
    proxy = ReplyLoser(server.port)
    port = await proxy.start()
    sink = open_sink(SinkSettings(url=f"redis://127.0.0.1:{port}?stream=orders", publish_timeout=2.0))
    prefix = f"t{uuid.uuid4().hex[:8]}"
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s, max_run = 40", (prefix,))
    running = start(dsn, sink, batch_size=100, concurrency=2)
    try:
        written = 0
        for chunk in range(6):
            if chunk % 2:
                proxy.lose = 2   # an answer lost, then the retry's: the worker retries the event
            enqueue_many(conn, [Event("order", f"o{i % 8}", "updated", {"i": i}) for i in range(written, written + 100)])
            written += 100
            await asyncio.sleep(0.2)
        await wait_until(all_in(dsn, "published", 600), 30, "600 events published")
    finally:
        await running.stop()
        await proxy.close()
    assert proxy.lost >= 2
    stored = await entries(db, "orders")
    rows = conn.execute("SELECT msg_id, id, aggregate_id FROM outbox ORDER BY id").fetchall()
    assert sorted(e["msg_id"].decode() for e in stored) == sorted(r[0] for r in rows)   # each once
    per: dict[bytes, list[int]] = {}
    for e in stored:
        assert e["subject"] == f"{prefix}.order.updated".encode()
        per.setdefault(e["Outbox-Aggregate-Id"], []).append(int(e["Outbox-Id"]))
    assert len(per) == 8 and all(ids == sorted(ids) for ids in per.values())


async def test_rediss_checks_the_servers_certificate(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "tls", tls=True)
    await srv.start()
    try:
        url = f"rediss://127.0.0.1:{srv.port}"
        sink = await opened(url, ssl_ca_certs=str(srv.ca_file))
        try:
            assert list(await sink.publish_batch([event(1, "outbox.order.created")])) == [None]
        finally:
            await sink.close()
        for wrong, says in [(url, "certificate verify failed"), (srv.url, "Connection (reset|closed|lost)")]:   # no CA given; no TLS at all
            other = open_sink(SinkSettings(url=wrong, publish_timeout=2.0))
            try:
                with pytest.raises(SinkUnreachable, match=says) as info:
                    await other.start()
                assert "\n" not in str(info.value)
            finally:
                await other.close()
    finally:
        await srv.stop()
