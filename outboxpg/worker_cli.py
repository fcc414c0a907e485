"""``outboxpg-worker``: run the relay from the command line.

Every flag can also come from an environment variable, OUTBOXPG_<FLAG> (e.g. OUTBOXPG_DSN,
OUTBOXPG_BATCH_SIZE, OUTBOXPG_POLL_ONLY=1). Flags win over the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import psycopg

from outboxpg.cli_common import describe_connection_error
from outboxpg.worker import Worker, WorkerConfig

log = logging.getLogger("outboxpg.worker")

_TRUE = {"1", "true", "yes", "on"}


def _env(name: str, default: Any) -> Any:
    return os.environ.get(f"OUTBOXPG_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    d = WorkerConfig(dsn="")
    p = argparse.ArgumentParser(
        prog="outboxpg-worker",
        description="Deliver outbox events to NATS JetStream (or to your own publisher). "
                    "Every flag also reads OUTBOXPG_<FLAG> from the environment.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dsn", default=_env("DSN", ""),
                   help="PostgreSQL connection string or URI [OUTBOXPG_DSN; empty: libpq's PG* variables]")
    p.add_argument("--nats-url", default=_env("NATS_URL", "nats://127.0.0.1:4222"),
                   help="NATS server URL [OUTBOXPG_NATS_URL]")
    p.add_argument("--batch-size", type=int, default=int(_env("BATCH_SIZE", d.batch_size)),
                   help="events per claim [OUTBOXPG_BATCH_SIZE]")
    p.add_argument("--concurrency", type=int, default=int(_env("CONCURRENCY", d.concurrency)),
                   help="batches in flight at once [OUTBOXPG_CONCURRENCY]")
    p.add_argument("--lease", type=float, default=float(_env("LEASE", d.lease)),
                   help="seconds a claimed batch is leased; at least twice --publish-timeout [OUTBOXPG_LEASE]")
    p.add_argument("--publish-timeout", type=float, default=float(_env("PUBLISH_TIMEOUT", d.publish_timeout)),
                   help="seconds to wait for a publish (JetStream ack) before failing it [OUTBOXPG_PUBLISH_TIMEOUT]")
    p.add_argument("--poll-interval", type=float, default=float(_env("POLL_INTERVAL", d.poll_interval)),
                   help="fallback poll when no notification comes, seconds [OUTBOXPG_POLL_INTERVAL]")
    p.add_argument("--poll-only", action="store_true", default=_env("POLL_ONLY", "").lower() in _TRUE,
                   help="no LISTEN and no session locks: poll every --poll-interval (for PgBouncer in "
                        "transaction mode) [OUTBOXPG_POLL_ONLY]")
    p.add_argument("--ensure-stream", default=_env("ENSURE_STREAM", None), metavar="NAME",
                   help="create or update JetStream stream NAME to capture <subject_prefix>.> with a "
                        "duplicate window covering lease + backoff cap [OUTBOXPG_ENSURE_STREAM]")
    p.add_argument("--publisher", default=_env("PUBLISHER", None), metavar="MODULE:CALLABLE",
                   help="publish with your own callable (fn(event), sync or async) or object with "
                        "publish_batch(); default: NATS JetStream [OUTBOXPG_PUBLISHER]")
    p.add_argument("--name", default=_env("NAME", d.name),
                   help="worker name recorded in locked_by [OUTBOXPG_NAME]")
    p.add_argument("--summary-interval", type=float, default=float(_env("SUMMARY_INTERVAL", d.summary_interval)),
                   help="seconds between summary log lines [OUTBOXPG_SUMMARY_INTERVAL]")
    p.add_argument("--maintenance-interval", type=float,
                   default=float(_env("MAINTENANCE_INTERVAL", d.maintenance_interval)),
                   help="run outbox_maintain() at start and every this many seconds; 0: never "
                        "(one worker of many does it, under an advisory lock) [OUTBOXPG_MAINTENANCE_INTERVAL]")
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", 0)),
                   help="serve Prometheus metrics on this port; 0: off [OUTBOXPG_METRICS_PORT]")
    p.add_argument("--metrics-addr", default=_env("METRICS_ADDR", "127.0.0.1"),
                   help="address the metrics server binds to [OUTBOXPG_METRICS_ADDR]")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"),
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level [OUTBOXPG_LOG_LEVEL]")
    return p


async def _stream_setup(args: argparse.Namespace, publisher: Any, cfg: WorkerConfig, prefix: str,
                        backoff_cap: timedelta) -> None:
    """Check (and with --ensure-stream, create) the stream the worker will publish into."""
    from outboxpg.nats_publisher import check_stream, ensure_stream

    window = timedelta(seconds=cfg.lease) + backoff_cap + timedelta(seconds=60)
    if args.ensure_stream:
        log.info("event=ensure_stream result=%r", await ensure_stream(publisher.js, args.ensure_stream,
                                                                       [f"{prefix}.>"], window))
    for problem in await check_stream(publisher.js, f"{prefix}.check", timedelta(seconds=cfg.lease) + backoff_cap):
        log.warning("event=stream_check problem=%r", problem)


async def _main(args: argparse.Namespace) -> int:
    cfg = WorkerConfig(dsn=args.dsn, batch_size=args.batch_size, concurrency=args.concurrency, lease=args.lease,
                       poll_interval=args.poll_interval, poll_only=args.poll_only,
                       publish_timeout=args.publish_timeout, name=args.name,
                       summary_interval=args.summary_interval, maintenance_interval=args.maintenance_interval)
    cfg.validate()
    # Fail fast, in one line, on a wrong DSN or a database without the schema.
    async with await psycopg.AsyncConnection.connect(cfg.dsn, autocommit=True, connect_timeout=10) as conn:
        row = await (await conn.execute("SELECT to_regprocedure('outbox_claim(integer,interval,text)')")).fetchone()
        if row is None or row[0] is None:
            raise SystemExit("outboxpg-worker: the outbox schema is not installed in this database: "
                             "run outboxpg migrate --dsn ...")
        # What the stream check needs (columns the outbox_worker role may read).
        settings = await (await conn.execute("SELECT subject_prefix, backoff_cap FROM outbox_settings")).fetchone()
        assert settings is not None
    if args.publisher:
        from outboxpg.publishers import FunctionPublisher, load_publisher

        publisher = load_publisher(args.publisher)
        if isinstance(publisher, FunctionPublisher):
            publisher.timeout = cfg.publish_timeout
    else:
        from outboxpg.nats_publisher import NatsPublisher

        publisher = NatsPublisher(args.nats_url, ack_timeout=cfg.publish_timeout)
        await publisher.start()
        await _stream_setup(args, publisher, cfg, *settings)
    metrics = None
    if args.metrics_port:
        from outboxpg.metrics import WorkerMetrics

        metrics = WorkerMetrics(cfg.dsn)
        metrics.serve(args.metrics_port, args.metrics_addr)
        log.info("event=metrics_serving addr=%s port=%d", args.metrics_addr, args.metrics_port)
    worker = Worker(cfg, publisher, metrics)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    await worker.run()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    try:
        return asyncio.run(_main(args))
    except ValueError as exc:
        print(f"outboxpg-worker: {exc}", file=sys.stderr)
        return 2
    except psycopg.OperationalError as exc:
        print(f"outboxpg-worker: {describe_connection_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
