"""What the worker's NATS headers cost it per message: nats-py's publish with the headers the
worker sends, against the same message without headers.

    .venv/bin/python bench/nats_headers.py                  # a nats-server of its own
    .venv/bin/python bench/nats_headers.py --nats-url nats://127.0.0.1:4222 --messages 100000

The headers are the worker's own (outboxpg.relay.nats.headers.message_headers for an event of
the demo's shape; an atomic batch's Nats-Batch-Id and Nats-Batch-Sequence before them, as
batches.py sends a long run), published with nats-py's Client.publish to a subject no stream
captures (the server drops the messages: this is the client's side alone). Printed: the
process's CPU time per publish, the median of --repeat rounds, then where the time of the
header block goes (nats-py checks every name with a regular expression and trims and
translates every value, each publish).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import statistics
import sys
import time
import timeit
import uuid
from datetime import UTC, datetime
from pathlib import Path

import nats
import nats.aio.client as nats_client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from outboxpg.embedded import EmbeddedNats  # noqa: E402
from outboxpg.events import OutboxEvent  # noqa: E402
from outboxpg.relay.nats.headers import BATCH_HEADER_BYTES, message_headers  # noqa: E402

SUBJECT = "bench.nats_headers.dropped"


def sample_event() -> OutboxEvent:
    return OutboxEvent(id=1234567, subject=SUBJECT, aggregate_type="order", aggregate_id="order-0020",
                       event_type="created", payload=b'{"order": "order-0020", "status": "created"}',
                       headers={}, msg_id=str(uuid.uuid4()), attempt=1, created_at=datetime.now(UTC))


async def per_publish(url: str, messages: int, repeat: int) -> tuple[float, float, int]:
    """Median CPU µs per publish with the worker's headers, and without; the header count."""
    event = sample_event()
    outbox = message_headers(event, None, 0, BATCH_HEADER_BYTES)
    assert isinstance(outbox, dict)
    batch_id = uuid.uuid4().hex
    nc = await nats.connect(url)
    with_headers, without = [], []
    try:
        for _ in range(repeat):
            t = time.process_time()
            for n in range(messages):
                headers = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(n % 100 + 1), **outbox}
                await nc.publish(SUBJECT, event.payload, headers=headers)
            await nc.flush()
            with_headers.append((time.process_time() - t) / messages * 1e6)
            t = time.process_time()
            for _ in range(messages):
                await nc.publish(SUBJECT, event.payload)
            await nc.flush()
            without.append((time.process_time() - t) / messages * 1e6)
    finally:
        await nc.close()
    return statistics.median(with_headers), statistics.median(without), len(outbox) + 2


def header_parts(count: int) -> dict[str, float]:
    """µs per header block of ``count`` headers, for the steps nats-py's publish takes on it."""
    event = sample_event()
    outbox = message_headers(event, None, 0, BATCH_HEADER_BYTES)
    assert isinstance(outbox, dict)
    headers = {"Nats-Batch-Id": uuid.uuid4().hex, "Nats-Batch-Sequence": "17", **outbox}
    key_re = nats_client._HEADER_KEY_RE            # what nats-py uses (its private names)
    newlines = nats_client._HEADER_VALUE_NEWLINES
    n = 100_000
    return {
        "names checked (re.fullmatch)": timeit.timeit(lambda: [key_re.fullmatch(k.strip()) for k in headers],
                                                      number=n) / n * 1e6,
        "values trimmed and translated": timeit.timeit(lambda: [v.strip().translate(newlines)
                                                                for v in headers.values()], number=n) / n * 1e6,
        "names and values encoded": timeit.timeit(lambda: [(k.encode(), v.encode()) for k, v in headers.items()],
                                                  number=n) / n * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nats-url", default=None, help="a running nats-server (default: one of its own)")
    ap.add_argument("--messages", type=int, default=50_000, help="publishes per round (default 50,000)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the median is printed (default 3)")
    args = ap.parse_args()
    if args.messages < 1 or args.repeat < 1:
        ap.error("--messages and --repeat must be at least 1")
    server = None
    url = args.nats_url
    if url is None:
        server = EmbeddedNats().start()
        url = server.url
    try:
        with_headers, without, count = asyncio.run(per_publish(url, args.messages, args.repeat))
    finally:
        if server is not None:
            server.stop(remove=True)
    print(f"nats-py {importlib.metadata.version('nats-py')}, {args.messages:,} publishes x {args.repeat}, CPU of this process:")
    print(f"  with the worker's {count} headers (an atomic batch's message): {with_headers:5.1f} µs per publish")
    print(f"  without headers:                                   {without:5.1f} µs per publish")
    print("  of a header block, per publish:")
    for what, us in header_parts(count).items():
        print(f"    {what:32s} {us:5.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
