"""The publisher-function adapter alone (FunctionPublisher, what `--publisher module:callable`
runs): its CPU per event around an async function that returns at once, no worker, no database.

    .venv/bin/python bench/function_publisher.py
    .venv/bin/python bench/function_publisher.py --code /tmp/old     # another tree's outboxpg/

Batches of 500 events in two shapes: 500 single-event runs (every event of its own aggregate,
the uniform mix) and 10 runs of 50. For each, 5 batches to warm up, then 7 samples of 40
batches; printed: the median of the samples' process CPU time per event (time.process_time, this
process only). --code DIR imports outboxpg from DIR instead of this checkout (a `git archive` of
another commit, say), so that two revisions can be run one after the other, alternated.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BATCH = 500


async def measure() -> dict[str, float]:
    from outboxpg.events import OutboxEvent
    from outboxpg.relay.publishers import FunctionPublisher

    def event(i: int, aggregate: str) -> OutboxEvent:
        return OutboxEvent(id=i, subject="bench.x", aggregate_type="order", aggregate_id=aggregate,
                           event_type="created", payload=b'{"i": %d}' % i, headers={},
                           msg_id=f"m-{uuid.uuid4()}", attempt=0, created_at=datetime.now(UTC))

    async def publish(e: Any) -> None:
        return None

    adapter = FunctionPublisher(publish)
    shapes = {"500 single-event runs": [event(i, str(i)) for i in range(1, BATCH + 1)],
              "10 runs of 50": [event(i, str(i % 10)) for i in range(1, BATCH + 1)]}
    figures = {}
    for name, batch in shapes.items():
        for _ in range(5):
            await adapter.publish_batch(batch)
        samples = []
        for _ in range(7):
            t = time.process_time()
            for _ in range(40):
                await adapter.publish_batch(batch)
            samples.append((time.process_time() - t) / (40 * BATCH) * 1e6)
        figures[name] = statistics.median(samples)
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--code", type=Path, default=ROOT, metavar="DIR",
                    help="the tree whose outboxpg/ to import (default: this checkout)")
    args = ap.parse_args()
    if not (args.code / "outboxpg" / "relay" / "publishers.py").is_file():
        ap.error(f"--code: no outboxpg/relay/publishers.py under {args.code}")
    sys.path.insert(0, str(args.code.resolve()))
    figures = asyncio.run(measure())
    print(f"FunctionPublisher of {args.code}: CPU per event, median of 7 samples of 40 batches of {BATCH}")
    for name, us in figures.items():
        print(f"  {name:<24} {us:6.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
