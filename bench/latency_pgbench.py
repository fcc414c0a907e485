"""Latency commit -> JetStream consumer at steady rates, with pgbench as the producer.

    .venv/bin/python bench/latency_pgbench.py                 # 1,000 and 5,000 events/s, 15 s each
    .venv/bin/python bench/latency_pgbench.py --rates 5000 --seconds 30

bench/e2e.py's latency phase produces from Python processes, one event per transaction; at
5,000 events/s they alone take about half of this 2-core machine, and the latency measured is
then mostly the queue of a saturated machine. Here pgbench (-R, 4 clients, synchronous_commit
off) writes the events, each carrying clock_timestamp() taken inside its INSERT, and a JetStream
consumer in this process subtracts that from its receive time. The INSERT's clock is read before
the COMMIT, so this counts a little more than commit -> consumer. One outboxpg-worker process
with its defaults; a database and a stream of its own, removed at the end (bench/e2e.py's Bench).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import nats
import orjson
from nats.js.api import DeliverPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402

SCRIPT = ("\\set a random(1, 100000)\n"
          "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
          "VALUES ('order', :a, 'created', jsonb_build_object('t', extract(epoch FROM clock_timestamp())));\n")


async def measure(b: e2e.Bench, script: str, rate: int, seconds: int) -> str:
    lat: list[float] = []
    nc = await nats.connect(b.args.nats_url)
    js = nc.jetstream()

    async def on_msg(m: nats.aio.msg.Msg) -> None:
        lat.append(time.time() - orjson.loads(m.data)["t"])

    sub = await js.subscribe(f"{b.prefix}.>", ordered_consumer=True, cb=on_msg, deliver_policy=DeliverPolicy.NEW)
    env = {**os.environ, "PGOPTIONS": "-c synchronous_commit=off"}
    conn = e2e.conninfo_to_dict(b.dsn)
    p = await asyncio.create_subprocess_exec(
        "pgbench", "-h", str(conn.get("host", "127.0.0.1")), "-p", str(conn.get("port", 5432)),
        "-U", str(conn.get("user", "postgres")), "-n", "-M", "prepared", "-f", script, "-c", "4", "-j", "2",
        "-R", str(rate), "-T", str(seconds), b.dbname, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await p.communicate()
    done = int(next((ln.split(":")[1] for ln in out.decode().splitlines() if "actually processed" in ln), "0"))
    end = time.monotonic() + 10
    while len(lat) < done and time.monotonic() < end:
        await asyncio.sleep(0.05)
    await sub.unsubscribe()
    await nc.close()
    if not lat:
        raise RuntimeError(f"no latency samples; pgbench said:\n{out.decode()}")
    lat.sort()

    def ms(q: float) -> float:
        return lat[min(len(lat) - 1, int(len(lat) * q))] * 1000

    return (f"latency insert->consumer at {rate:5d}/s (achieved {done / seconds:.0f}/s, {len(lat)} of {done} received): "
            f"p50 {ms(0.5):7.2f} ms  p99 {ms(0.99):7.2f} ms  max {lat[-1] * 1000:7.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dsn", default=os.environ.get("OUTBOXPG_BENCH_DSN", "host=127.0.0.1 user=postgres dbname=postgres"))
    ap.add_argument("--nats-url", default=os.environ.get("OUTBOXPG_BENCH_NATS", "nats://127.0.0.1:4222"))
    ap.add_argument("--rates", default="1000,5000", help="comma-separated events/s (default 1000,5000)")
    ap.add_argument("--seconds", type=int, default=15)
    a = ap.parse_args()
    args = argparse.Namespace(dsn=a.dsn, nats_url=a.nats_url, batch_size=500, concurrency=4, profile=None,
                              quiet_wait=0.0, workers="1", no_naive=True, quick=False, events=None,
                              aggregates=20_000, only=None)
    b = e2e.Bench(args)
    b.create_db()
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(SCRIPT)
    try:
        for rate in (int(r) for r in a.rates.split(",")):
            b.truncate()
            asyncio.run(b.reset_stream())
            b.start_worker("lat")
            time.sleep(2.0)   # worker up and idle
            try:
                print(asyncio.run(measure(b, f.name, rate, a.seconds)), flush=True)
            finally:
                b.stop_workers()
    finally:
        os.unlink(f.name)
        b.drop_db()
        asyncio.run(b.drop_stream())
    return 0


if __name__ == "__main__":
    sys.exit(main())
