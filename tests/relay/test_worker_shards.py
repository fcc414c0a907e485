"""Workers with shards (--shard I/N, --shard-group) against a real PostgreSQL (and a real
nats-server): two workers, one per shard, deliver every event once, in order per aggregate, each
only the aggregates of its own shard; an idle worker of a shard claims what comes due in its
shard, also when another worker holds the wakeup lock, and after its shard changed."""

from __future__ import annotations

from collections import defaultdict

import psycopg
from helpers import Running, aggregate_of_shard
from jetstream import make_stream, read_stream
from workers import all_in, count_in, equals, fleet_idle, queued_for_wakeup_lock, start, wait_until

from outboxpg import Event, enqueue_many
from outboxpg.events import OutboxEvent
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.publishers import FunctionPublisher


async def test_one_worker_per_shard_delivers_its_shard_once_in_order(dsn, conn, nats_server, fast_retries):
    conn.execute("SELECT outbox_shards_enable()")
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    workers = [start(dsn, NatsPublisher(nats_server.url), batch_size=50, concurrency=2, name=f"shard-{i}",
                     shard=f"{i}/2") for i in range(2)]
    async with await psycopg.AsyncConnection.connect(dsn) as producer:
        for chunk in range(6):
            async with producer.transaction():
                await enqueue_many(producer, [Event("order", str(i % 120), "updated", {"i": i})
                                              for i in range(chunk * 500, chunk * 500 + 500)])
    await wait_until(lambda: equals(count_in(dsn, "published"), 3_000), 120, "3,000 events published")
    for w in workers:
        await w.stop()
    delivered = [w.worker.stats.delivered for w in workers]
    assert sum(delivered) == 3_000 and min(delivered) > 0, delivered

    # Each worker leased its own shard's aggregates only.
    rows = conn.execute("SELECT locked_by, outbox_aggregate_bucket(aggregate_type, aggregate_id) < 32, count(*) "
                        "FROM outbox GROUP BY 1, 2 ORDER BY 1, 2").fetchall()
    assert rows == [("shard-0", True, rows[0][2]), ("shard-1", False, rows[1][2])], rows

    msgs = await read_stream(stream)
    await stream.nc.close()
    assert len(msgs) == 3_000 and len({m.msg_id for m in msgs}) == 3_000
    per_aggregate: dict[str, list[int]] = defaultdict(list)
    for m in msgs:  # stream order
        per_aggregate[m.aggregate].append(m.outbox_id)
    assert len(per_aggregate) == 120
    for aggregate, ids in per_aggregate.items():
        assert ids == sorted(ids), f"{aggregate} delivered out of id order"



async def test_a_shard_worker_queued_behind_another_claims_what_comes_due_in_its_shard(dsn, conn):
    """The wakeup lock is held by another idle worker (here a session of the test's), whose claims
    cover its own shard only; this worker, shard 1/2, queues behind it. An event of its shard
    scheduled a second ahead comes due with no notification: the worker claims it at its shard's
    next wakeup, as the holder would. Before, only the holder slept until the next wakeup or the
    poll, and a worker queued behind the holder of another shard never claimed it."""
    conn.execute("SELECT outbox_shards_enable()")
    delivered: list[str] = []

    async def publish(event: OutboxEvent) -> None:
        delivered.append(event.aggregate_id)

    with psycopg.connect(dsn, autocommit=True) as other:
        other.execute("SELECT outbox_worker_idle()")           # the other shard's idle worker
        running = start(dsn, FunctionPublisher(publish), name="shard-1", shard="1/2", poll_interval=120)
        try:
            await wait_until(queued_for_wakeup_lock(conn), 10, "the worker queued for the wakeup lock")
            aggregate = aggregate_of_shard(conn, "1/2")
            conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, deliver_at) "
                         "VALUES ('order', %s, 'created', '{}', now() + interval '1 second')", (aggregate,))
            took = await wait_until(all_in(dsn, "published", 1), 10, "the scheduled event published")
            assert delivered == [aggregate]
            assert took < 3, took
        finally:
            await running.stop()


async def test_an_idle_group_member_whose_shard_widens_sleeps_until_its_new_shards_next_wakeup(dsn, conn):
    """Two idle members of a shard group; an event of the first one's shard is scheduled three
    seconds ahead; the first one stops before then. The second takes the lock (its claim then is
    of its old shard) and widens its shard to 0/1 at its next look of the group: it looks at once
    with the new shard, and sleeps until that shard's next wakeup, the scheduled event's time,
    not until its poll."""
    conn.execute("SELECT outbox_shards_enable()")
    delivered: list[str] = []

    async def publish(event: OutboxEvent) -> None:
        delivered.append(event.aggregate_id)

    first = start(dsn, FunctionPublisher(publish), name="first", shard_group="relays", poll_interval=120)
    await wait_until(lambda: _shard_is(first, "0/1"), 10, "the first member's shard")
    second = start(dsn, FunctionPublisher(publish), name="second", shard_group="relays", poll_interval=120)
    try:
        await wait_until(lambda: _shard_is(first, "0/2"), 10, "the first member's shard narrowed")
        await wait_until(fleet_idle(conn, [first, second]), 10, "both members idle")
        aggregate = aggregate_of_shard(conn, "0/2")
        conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, deliver_at) "
                     "VALUES ('order', %s, 'created', '{}', now() + interval '3 seconds')", (aggregate,))
        await wait_until(fleet_idle(conn, [first, second]), 10, "both members idle again")
        await first.stop()
        await wait_until(lambda: _shard_is(second, "0/1"), 10, "the second member's shard widened")
        await wait_until(all_in(dsn, "published", 1), 10, "the scheduled event published")
        assert delivered == [aggregate]
    finally:
        await second.stop()


async def _shard_is(running: Running, shard: str) -> bool:
    group = running.worker.shard_group
    return group is not None and group.shard == shard
