"""A JetStream pull consumer that processes each event exactly once, with the transactional inbox.

For each message, in one transaction of the consumer's own database: outbox_inbox_receive(consumer,
Nats-Msg-Id), and only when that answers true, the consumer's own write (here a row of
billing_effects); commit; then ack. A crash before the commit leaves neither (the redelivery is
processed); a crash after it and before the ack leaves both (the redelivery answers false and is
only acked). The database needs the inbox, not the outbox:

  outboxpg migrate --inbox --dsn 'dbname=billing'
  python examples/inbox_consumer.py --dsn 'dbname=billing' --nats nats://127.0.0.1:4222 \\
      --stream OUTBOX --subject 'outbox.>' --durable billing
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from typing import Any

import nats
import psycopg
from nats.js.api import AckPolicy, ConsumerConfig

from outboxpg import inbox

CONSUMER = "billing"
EFFECTS = """CREATE TABLE IF NOT EXISTS billing_effects (
    msg_id       text        NOT NULL,
    subject      text        NOT NULL,
    payload      bytea,
    processed_at timestamptz NOT NULL DEFAULT now())"""
SIDE_EFFECT = "INSERT INTO billing_effects (msg_id, subject, payload) VALUES (%s, %s, %s)"


def message_id(msg: Any) -> str:
    """Nats-Msg-Id (outboxpg-worker sets it on every event); without one, the stream sequence,
    which a redelivery of the same stored message keeps."""
    return (msg.headers or {}).get("Nats-Msg-Id") or f"{msg.metadata.stream}:{msg.metadata.sequence.stream}"


async def consume(dsn: str, nats_url: str, stream: str, subject: str, durable: str, *,
                  batch: int = 10, ack_wait: float = 30.0, idle_exit: float | None = None,
                  before_ack: Callable[[str, bool], None] | None = None) -> dict[str, int]:
    """Consume until cancelled (or ``idle_exit`` seconds without a message); returns counts.
    ``before_ack(msg_id, first)`` is called after the commit and before the ack (the benchmark
    kills the process there)."""
    counts = {"processed": 0, "duplicates": 0}
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.jetstream().pull_subscribe(
            subject, durable=durable, stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait))
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(EFFECTS)
            idle = 0.0
            while idle_exit is None or idle < idle_exit:
                try:
                    msgs = await sub.fetch(batch, timeout=0.5)
                # Nothing came: nats-py raises its own TimeoutError, or asyncio's when the time ran
                # out before it asked; both are TimeoutError.
                except TimeoutError:
                    idle += 0.5
                    continue
                idle = 0.0
                for msg in msgs:
                    msg_id = message_id(msg)
                    async with conn.transaction():
                        first = await inbox.receive(conn, CONSUMER, msg_id)
                        if first:
                            await conn.execute(SIDE_EFFECT, (msg_id, msg.subject, msg.data))
                    counts["processed" if first else "duplicates"] += 1
                    if before_ack is not None:
                        before_ack(msg_id, first)
                    await msg.ack()
    finally:
        await nc.close()
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", required=True)
    p.add_argument("--nats", default="nats://127.0.0.1:4222")
    p.add_argument("--stream", required=True)
    p.add_argument("--subject", required=True)
    p.add_argument("--durable", default=CONSUMER)
    p.add_argument("--idle-exit", type=float, default=None, help="stop after this many seconds without a message")
    args = p.parse_args()
    counts = asyncio.run(consume(args.dsn, args.nats, args.stream, args.subject, args.durable,
                                 idle_exit=args.idle_exit))
    print(f"processed {counts['processed']}, duplicates skipped {counts['duplicates']}")


if __name__ == "__main__":
    main()
