"""Workers with shards (--shard I/N) against a real PostgreSQL and a real nats-server: two
workers, one per shard, deliver every event once, in order per aggregate, each only the
aggregates of its own shard."""

from __future__ import annotations

from collections import defaultdict

import psycopg
from jetstream import make_stream, read_stream
from workers import count_in, equals, start, wait_until

from outboxpg import Event, enqueue_many
from outboxpg.relay.nats.publisher import NatsPublisher


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
