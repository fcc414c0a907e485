#!/usr/bin/env python3
"""The transactional inbox: what it costs per message, and whether a consumer killed between its
commit and its ack ever applies a side effect twice.

    .venv/bin/python bench/inbox.py                  # cost, then 1,000 kills (a few minutes)
    .venv/bin/python bench/inbox.py --kills 100      # scaled down
    .venv/bin/python bench/inbox.py --skip-kills     # the cost only

Starts its own throwaway PostgreSQL and nats-server (outboxpg.embedded), installs the inbox alone
(outboxpg.schema.migrate_inbox: no outbox), and stops them at the end.

1. Cost per message, one message per transaction, one connection:
     own    BEGIN; INSERT the consumer's side-effect row; COMMIT
     inbox  BEGIN; SELECT outbox_inbox_receive(...); INSERT the same row; COMMIT
   measured from Python (psycopg, round trips included) and inside the server (a DO loop of N,
   no commit per message: the SQL alone). Runs alternate (own, inbox, own, inbox, ...); best of each.
2. Kills: --messages events published to a JetStream stream, each with its Nats-Msg-Id; consumers
   (examples/inbox_consumer.py's consume(), in forked processes) SIGKILL themselves right after the
   commit of a message's side effect and before its ack, after 1-3 such commits each, until
   --kills kills are done and a last consumer drains the stream (or --max-seconds pass). A killed
   consumer's message is redelivered after ack_wait (1 s). Then it counts side-effect rows per
   message id: duplicates (target 0) and missing ones (target 0).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import psycopg

from outboxpg import schema
from outboxpg.embedded import EmbeddedNats, EmbeddedPostgres

ROOT = Path(__file__).resolve().parents[1]
OWN = "INSERT INTO effects (msg_id, payload) VALUES (%s, %s)"


def load_example():
    spec = importlib.util.spec_from_file_location("inbox_consumer", ROOT / "examples" / "inbox_consumer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cost(dsn: str, n: int, rounds: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE effects (msg_id text NOT NULL, payload text, at timestamptz NOT NULL DEFAULT now())")
    client = {"own": [], "inbox": []}
    server = {"own": [], "inbox": []}
    with psycopg.connect(dsn) as c:
        for r in range(rounds):
            for kind in ("own", "inbox"):
                tag = f"{kind}-{r}-"
                t = time.perf_counter()
                for i in range(n):
                    if kind == "inbox":
                        c.execute("SELECT outbox_inbox_receive('bench', %s)", (tag + str(i),))
                    c.execute(OWN, (tag + str(i), "payload"))
                    c.commit()
                client[kind].append((time.perf_counter() - t) / n * 1e6)
                receive = "PERFORM outbox_inbox_receive('bench', 's" + tag + "' || i);" if kind == "inbox" else ""
                t = time.perf_counter()
                c.execute("DO $$ BEGIN FOR i IN 1.." + str(n) + " LOOP " + receive +
                          " INSERT INTO effects (msg_id, payload) VALUES ('s" + tag + "' || i, 'payload'); END LOOP; END $$")
                c.commit()
                server[kind].append((time.perf_counter() - t) / n * 1e6)
        c.execute("TRUNCATE effects, outbox_inbox")
        c.commit()
    print(f"cost per message, {n} messages x {rounds} rounds, best round (µs):")
    for label, d in (("client (psycopg, a transaction each)", client), ("server (DO loop, SQL only)", server)):
        own, inb = min(d["own"]), min(d["inbox"])
        print(f"  {label:38s} own insert {own:8.1f}   inbox + own insert {inb:8.1f}   "
              f"inbox adds {inb - own:7.1f} ({(inb / own - 1) * 100:+.0f}%)")


async def publish(url: str, messages: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name="BENCH", subjects=["bench.>"])
    pending = []
    for i in range(messages):
        pending.append(js.publish("bench.event", b"%d" % i, headers={"Nats-Msg-Id": f"evt-{i}"}))
        if len(pending) == 200:
            await asyncio.gather(*pending)
            pending = []
    await asyncio.gather(*pending)
    await nc.close()


def child(example, dsn: str, url: str, kill_after: int | None) -> None:
    done = 0

    def before_ack(msg_id: str, first: bool) -> None:
        nonlocal done
        done += first
        if kill_after is not None and done >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)      # committed, not acked

    try:
        asyncio.run(example.consume(dsn, url, "BENCH", "bench.>", "bench", batch=5, ack_wait=1.0,
                                    idle_exit=None if kill_after is not None else 3.0, before_ack=before_ack))
    finally:
        os._exit(0)


def kills(dsn: str, url: str, messages: int, target: int, max_seconds: float) -> None:
    example = load_example()
    asyncio.run(publish(url, messages))
    rng = random.Random(1)
    killed = clean = 0
    started = time.monotonic()
    while time.monotonic() - started < max_seconds:
        kill_after = rng.randint(1, 3) if killed < target else None
        pid = os.fork()
        if pid == 0:
            child(example, dsn, url, kill_after)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
            killed += 1
        else:
            clean += 1
            with psycopg.connect(dsn) as c:
                if c.execute("SELECT count(DISTINCT msg_id) FROM billing_effects").fetchone()[0] >= messages:
                    break
    elapsed = time.monotonic() - started
    with psycopg.connect(dsn) as c:
        rows, distinct = c.execute("SELECT count(*), count(DISTINCT msg_id) FROM billing_effects").fetchone()
    print(f"kills: {messages} messages, {killed} consumers SIGKILLed after a commit and before its ack, "
          f"{clean} ran to the end, {elapsed:.0f} s")
    print(f"  side effects {rows}, distinct messages {distinct}: duplicates {rows - distinct} (target 0), "
          f"missing {messages - distinct} (target 0)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3000, help="messages per cost round (default 3000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kills", type=int, default=1000)
    p.add_argument("--messages", type=int, default=None, help="default: 2.5 x --kills")
    p.add_argument("--max-seconds", type=float, default=900)
    p.add_argument("--skip-kills", action="store_true")
    args = p.parse_args()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"bench/inbox.py {datetime.date.today()} commit {commit} cpus {os.cpu_count()} "
          f"args {' '.join(sys.argv[1:]) or '(none)'}")
    with EmbeddedPostgres() as pg:
        with psycopg.connect(pg.dsn, autocommit=True) as c:
            c.execute("CREATE DATABASE bench_cost")
            c.execute("CREATE DATABASE bench_kills")
        for db in ("bench_cost", "bench_kills"):
            schema.migrate_inbox(pg.dsn_for(db))
        cost(pg.dsn_for("bench_cost"), args.n, args.rounds)
        if not args.skip_kills:
            with EmbeddedNats() as server:
                kills(pg.dsn_for("bench_kills"), server.url, args.messages or int(args.kills * 2.5), args.kills,
                      args.max_seconds)


if __name__ == "__main__":
    main()
