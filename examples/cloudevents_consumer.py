"""Read the last message JetStream stored on a subject and parse it with the CloudEvents Python
SDK, as a consumer of ``outboxpg-worker --cloudevents`` would (binary content mode: the ce-*
headers and content-type are handed to the SDK's HTTP binary-mode reader, the data as it is).

    pip install 'outboxpg[cloudevents]'    # nats-py and the CloudEvents SDK
    python3 examples/cloudevents_consumer.py --nats-url nats://127.0.0.1:4222 --stream OUTBOX \\
        --subject outbox.order.paid
"""

from __future__ import annotations

import argparse
import asyncio

import nats
from cloudevents.core.bindings.http import HTTPMessage, from_binary_event


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
    headers = msg.headers or {}
    print("headers:")
    for name, value in headers.items():
        print(f"  {name}: {value}")
    print(f"data: {msg.data.decode()}")
    event = from_binary_event(HTTPMessage(headers=dict(headers), body=msg.data))
    print("read by the CloudEvents SDK:")
    for name, value in event.get_attributes().items():
        print(f"  {name:<16} {value}")
    print(f"  {'data':<16} {event.get_data()}")


if __name__ == "__main__":
    asyncio.run(main())
