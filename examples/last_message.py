"""Print the last message a JetStream stream stored on a subject: its headers and its payload.

    python3 examples/last_message.py --nats-url nats://127.0.0.1:4222 --stream OUTBOX \\
        --subject outbox.order.paid
"""

from __future__ import annotations

import argparse
import asyncio

import nats


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--stream", required=True)
    p.add_argument("--subject", required=True)
    args = p.parse_args()
    nc = await nats.connect(args.nats_url)
    try:
        msg = await nc.jetstream().get_last_msg(args.stream, args.subject)
    finally:
        await nc.close()
    print(f"stream {args.stream}, subject {msg.subject}")
    for name, value in (msg.headers or {}).items():
        print(f"  {name}: {value}")
    print(f"  payload: {msg.data.decode()}")


if __name__ == "__main__":
    asyncio.run(main())
