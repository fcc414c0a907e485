"""``outboxpg-worker``: run the relay from the command line.

Every flag can also come from an environment variable, OUTBOXPG_<FLAG> (e.g. OUTBOXPG_DSN,
OUTBOXPG_BATCH_SIZE, OUTBOXPG_POLL_ONLY=1). Flags win over the environment. Each option is
declared once (outboxpg.option), as a field of WorkerConfig (outboxpg.relay.config) or of
CommandOptions below; flags, variables and help are built from those (outboxpg.cli.options).

At start it fails fast, with one line on stderr and an exit code of the table in
outboxpg.cli.errors, on what no retry can fix: 2 a bad flag, a malformed DSN or none given;
3 PostgreSQL cannot be reached, --nats-url names a server that is not NATS, or the --sink server
cannot be reached or refuses the login; 4 the outbox schema is missing or too old; 5 JetStream is
off, or no stream captures the subject prefix or an allowed subject prefix (unless
--wait-for-stream), or the --sink server cannot take the events; 1 the login may not run the worker's
functions, roles besides the owners' may create objects in the install schema
(outbox_untrusted_creators()), or another database error at start. What may come right by
itself is waited for, with a warning per try and a growing pause: an unreachable NATS server at
start (then nats-py reconnects on its own). No log line shows the DSN's, the NATS URL's or the
--sink URL's password, nor the webhook secret. --sink URL picks the sink by the URL's scheme:
nats:// is the NATS path below, every other one a built-in sink (outboxpg.cli.worker_sink).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from outboxpg import sql_api, statements
from outboxpg.cli.common import (
    describe_connection_error,
    not_installed,
    package_version,
    parse_dsn,
    redact,
    restore_double_dash,
    secrets_of,
    untrusted_creators_text,
)
from outboxpg.cli.databases import DatabaseOptions, Databases, check_all, merged_settings, several, targets_from
from outboxpg.cli.errors import (
    EXIT_BROKER,
    EXIT_CODES,
    EXIT_CONNECT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_SCHEMA,
    EXIT_USAGE,
    CliError,
)
from outboxpg.cli.options import OneLineParser, add_options, from_args
from outboxpg.cli.worker_sink import (
    check_sink_flags,
    is_nats,
    open_configured,
    sink_secrets,
    sink_settings,
    start_sink,
    url_secrets,
    webhook_secret,
)
from outboxpg.cloudevents import SPEC_VERSION, CloudEvents, check_source, default_source
from outboxpg.option import option
from outboxpg.relay.backoff import next_delay
from outboxpg.relay.config import shard_range
from outboxpg.relay.fleet import DatabaseLabelFilter
from outboxpg.relay.health import Health
from outboxpg.relay.nats.subjects import MAX_SUBJECTS, Subject, missing_text, under_allowed, under_prefix
from outboxpg.relay.pooler import POOLER_HINT, behind_transaction_pooler
from outboxpg.relay.worker import WorkerConfig, application_name
from outboxpg.sinks import scheme_of
from outboxpg.sinks.base import without_credentials
from outboxpg.text import describe, first_line, join_lines, printable

log = logging.getLogger("outboxpg.worker")

# nats-server's own default address: a worker beside its broker needs no flag. A server there
# that is not NATS, or whose JetStream has no stream for the outbox's subjects, is refused at start.
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"

# How often --wait-for-stream checks again.
STREAM_RECHECK_SECONDS = 5.0


@dataclass
class CommandOptions:
    """The options of the command beside WorkerConfig's: where to publish, metrics, logging."""

    nats_url: str = option("NATS server URL, or several separated by commas (nats://, tls://, ws://, wss://); "
                           "the worker logs the one it uses at start and refuses a server that is not NATS or "
                           "has no stream for the outbox's subjects", DEFAULT_NATS_URL)
    wait_for_stream: bool = option("when JetStream is off or no stream captures the outbox's subjects at start, "
                                   "say so once and check again every 5 s instead of exiting with code 5", False)
    ensure_stream: str | None = option(
        "create or update JetStream stream NAME to capture <subject_prefix>.> and the explicit subjects of "
        "unfinished events under outbox_settings.allowed_subject_prefixes that no stream captures (never any "
        "other), with a duplicate window covering lease + backoff cap, and allow_atomic (atomic batch publish) "
        "on nats-server 2.12+", None, metavar="NAME")
    sink: str | None = option("where to publish, a URL whose scheme picks the sink: nats:// or tls:// (NATS "
                              "JetStream, as --nats-url), amqp:// amqps:// (RabbitMQ), redis:// rediss:// (Redis "
                              "Streams), mqtt:// mqtts:// (MQTT), http:// https:// (signed webhooks); its options in "
                              "the query (docs/reference/sinks.md); default: --nats-url", None, metavar="URL")
    sink_option: list[str] | None = option("an option of the --sink, over the URL's query: KEY=VALUE (repeat the "
                                           "flag, or separate with commas)", None, metavar="KEY=VALUE")
    ensure_sink: bool = option("declare what the --sink publishes into when it is missing (the RabbitMQ exchange, "
                               "...); NATS: --ensure-stream", False)
    webhook_secret_file: str | None = option("file holding the secret that signs each webhook request (http:// and "
                                             "https:// sinks), or the secret itself in $OUTBOXPG_WEBHOOK_SECRET; "
                                             "never in the URL", None, metavar="PATH")
    publisher: str | None = option("publish with your own callable (fn(event), sync or async) or object with "
                                   "publish_batch(); default: NATS JetStream", None, metavar="MODULE:CALLABLE")
    cloudevents: bool = option("publish in CloudEvents 1.0 binary content mode: ce-specversion, ce-id (msg_id), "
                               "ce-source, ce-type (event_type), ce-subject (aggregate_id), ce-time (created_at) "
                               "and content-type headers (NATS only: not with --publisher)", False)
    cloudevents_source: str | None = option("the ce-source of every event with --cloudevents, a URI reference; "
                                            "default: outboxpg/<database name>", None, metavar="URI")
    metrics_port: int = option("serve Prometheus metrics (/metrics) and health checks (/healthz, /readyz) on "
                               "this port (1-65535); 0: off", 0)
    metrics_addr: str = option("address the metrics server binds to", "127.0.0.1")
    metrics_event_types: int = option("distinct event_type label values the metrics keep, the first seen; every "
                                      "other event type counts as 'other'", 100, metavar="N")
    log_level: str = option("log level", "INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def build_parser() -> argparse.ArgumentParser:
    """Every option of WorkerConfig and CommandOptions, each also read from OUTBOXPG_<NAME>."""
    p = OneLineParser(
        prog="outboxpg-worker",
        description="Deliver outbox events to NATS JetStream, RabbitMQ, Redis Streams, MQTT or signed webhooks "
                    "(--sink), or to your own publisher. "
                    "Every flag also reads OUTBOXPG_<FLAG> from the environment.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, epilog=EXIT_CODES)
    add_options(p, WorkerConfig)
    add_options(p, CommandOptions)
    add_options(p, DatabaseOptions)   # --dsn-file, --max-in-flight (--dsn repeated: WorkerConfig.dsn)
    if "OUTBOXPG_DSN" not in os.environ:
        p.set_defaults(dsn=None)   # not given: main() asks for it (the worker writes)
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return p


async def _stream_setup(args: argparse.Namespace, publisher: Any, cfg: WorkerConfig, prefix: str,
                        backoff_cap: timedelta, allowed: list[str], subjects: list[Subject]) -> list[str]:
    """Check (and with --ensure-stream, create) the streams the worker will publish into: one
    capturing <prefix>.>, something under each allowed subject prefix, and the explicit subjects
    of the unfinished events under the allowed prefixes. Returns what stops delivery altogether
    (JetStream off, the prefix or an allowed prefix captured by no stream: the caller exits with
    code 5, or waits); what stops only some events (an explicit subject a producer wrote that no
    stream captures, a short duplicate window) is logged as a warning. The streams found are the
    ones whose acks the publisher counts at once."""
    from outboxpg.relay.nats.connection import supports_atomic_batch
    from outboxpg.relay.nats.readiness import NOT_CAPTURED_HINT, covers_under, jetstream_off, uncaptured_prefixes
    from outboxpg.relay.nats.streams import check_stream, ensure_stream, explicit_to_add, streams_for

    off = await jetstream_off(publisher.js, publisher.url)
    if off:
        return [off]
    window = timedelta(seconds=cfg.lease) + backoff_cap + timedelta(seconds=60)
    explicit = [s for s in subjects if s.explicit and not under_prefix(s.subject, prefix)]
    if args.ensure_stream:
        try:
            # The subjects the events use: the prefix's, and explicit ones under the allowed
            # prefixes that no stream has yet (a subject a producer wrote is no reason to widen it
            # beyond what is allowed); then '<p>.>' for an allowed prefix nothing would capture
            # anything under even so (a stream may not hold both 'p.>' and 'p.x').
            wanted = [f"{prefix}.>", *await explicit_to_add(publisher.js, prefix, explicit, allowed)]
            wanted += [f"{p}.>" for p in await uncaptured_prefixes(publisher.js, allowed)
                       if not any(covers_under(s, p) for s in wanted)]
            # allow_atomic where the server has atomic batch publish: long runs then go as batches.
            log.info("event=ensure_stream result=%r", await ensure_stream(publisher.js, args.ensure_stream,
                                                                           wanted, window,
                                                                           atomic=supports_atomic_batch(publisher.nc)))
        except Exception as exc:  # noqa: BLE001 - no permission, a conflicting stream...
            log.error("event=ensure_stream_failed stream=%s error=%r", args.ensure_stream, describe(exc))
    fatal: list[str] = []
    try:
        problems = await check_stream(publisher.js, f"{prefix}.check", timedelta(seconds=cfg.lease) + backoff_cap)
        if problems and problems[0].startswith("no JetStream stream"):
            fatal.append(f"no JetStream stream captures {prefix + '.>'!r} on {publisher.url}, where every event "
                         f"without a subject of its own goes: {NOT_CAPTURED_HINT}")
            problems = problems[1:]
        bare = await uncaptured_prefixes(publisher.js, allowed)
        if bare:
            fatal.append(f"no JetStream stream captures anything under the allowed subject prefix"
                         f"{'es' if len(bare) > 1 else ''} {', '.join(map(repr, bare))} "
                         f"(outbox_settings.allowed_subject_prefixes): {NOT_CAPTURED_HINT}")
        streams = await streams_for(publisher.js, [f"{prefix}.check", *(s.subject for s in explicit)])
        publisher.expect_streams(name for name in streams.values() if name is not None)
        missing = [s for s in explicit if streams[s.subject] is None and under_allowed(s.subject, allowed)]
        outside = [s for s in explicit if streams[s.subject] is None and not under_allowed(s.subject, allowed)]
        if missing:
            problems.append(f"{missing_text(missing, 'explicit subject')}: each publish of them fails "
                            "(no responders) until a stream captures them, and they die after max_attempts "
                            "(add them to a stream, e.g. with --ensure-stream NAME)")
        if outside:
            problems.append(f"{missing_text(outside, 'explicit subject')}, outside subject_prefix and "
                            "outbox_settings.allowed_subject_prefixes (written before they were refused at insert, "
                            "or since disallowed): --ensure-stream does not add them; they fail and die after "
                            "max_attempts unless an operator allows their prefix")
    except Exception as exc:  # noqa: BLE001 - a JetStream API request that failed
        return [f"cannot check the JetStream streams on {publisher.url}: {describe(exc)}"]
    for problem in problems:
        log.warning("event=stream_check problem=%r", problem)
    return fatal


async def _broker_ready(args: argparse.Namespace, publisher: Any, cfg: WorkerConfig,
                        settings: tuple[str, timedelta, list[str], list[Subject]], stopping: asyncio.Event,
                        health: Health | None) -> bool:
    """The stream checks at start: fine, or exit 5 with the first problem in one line; with
    --wait-for-stream, say so once and check again every STREAM_RECHECK_SECONDS (/readyz says
    why meanwhile). False: stopped (SIGTERM) while waiting."""
    said = False
    while not stopping.is_set():
        fatal = await _stream_setup(args, publisher, cfg, *settings)
        if health is not None:
            health.checked_stream(fatal)
        if not fatal:
            if said:
                log.info("event=stream_found")
            return True
        if not args.wait_for_stream:
            raise CliError(f"{fatal[0]}{f' (and {len(fatal) - 1} more)' if len(fatal) > 1 else ''}", EXIT_BROKER)
        if not said:
            log.warning("event=waiting_for_stream problem=%r note='--wait-for-stream: checking again every %gs'",
                        "; ".join(fatal), STREAM_RECHECK_SECONDS)
            said = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stopping.wait(), STREAM_RECHECK_SECONDS)
    return False


async def _check_database(cfg: WorkerConfig) -> tuple[tuple[str, timedelta, list[str], list[Subject]], str]:
    """Fail fast, in one line, on what no retry can fix: a malformed DSN (exit 2), an unreachable
    server or a refused login (3), a database without the schema or with an older one (4), a
    login that may not run the worker's functions (1). Returns ((subject_prefix, backoff_cap, allowed_subject_prefixes,
    the subjects of the unfinished events) for the stream check, the database's name)."""
    parse_dsn(cfg.dsn)
    try:
        conn = await psycopg.AsyncConnection.connect(cfg.dsn, autocommit=True, connect_timeout=10,
                                                     fallback_application_name=application_name(cfg.name))
    except psycopg.Error as exc:
        raise CliError(describe_connection_error(exc), EXIT_CONNECT) from None
    async with conn:
        functions = (sql_api.WORKER_CALLS + (() if cfg.poll_only else sql_api.IDLE_CALLS)
                     + (sql_api.XMIN_CALLS if cfg.xmin_check_interval > 0 else ()))
        rows = await (await conn.execute(statements.CHECK_FUNCTIONS, ([f.signature for f in functions],))).fetchall()
        if not rows[0][1]:
            info = conn.info
            raise CliError(not_installed({"dbname": info.dbname, "host": info.host, "port": info.port}), EXIT_SCHEMA)
        missing = [f for f, exists, _ in rows if not exists]
        if missing:
            raise CliError(f"the outbox schema is not up to date ({missing[0]} is missing): "
                           "run outboxpg migrate --dsn ...", EXIT_SCHEMA)
        not_executable = [f.split("(")[0] for f, _, may in rows if not may]
        row = await (await conn.execute(statements.CHECK_SETTINGS)).fetchone()
        assert row is not None
        may_read, user, database = row
        denied = [f"execute {', '.join(not_executable)}"] if not_executable else []
        if not may_read:
            denied.append("read outbox_settings")
        if denied:
            raise CliError(f"role {user!r} may not {' nor '.join(denied)}: make it a member of outbox_worker "
                           f"(GRANT outbox_worker TO \"{user}\"; see docs/privileges.md)", EXIT_FAILED)
        # An install that others may plant objects in runs their code as its owner: no worker
        # calls its functions until that is closed (migrate refuses such an install too).
        row = await (await conn.execute(statements.INSTALL_UNTRUSTED_CREATORS)).fetchone()
        if row is not None and row[0] is not None:
            raise CliError(f"refusing to start: {untrusted_creators_text(row[0], row[1])}", EXIT_FAILED)
        if cfg.standby_flushed:
            # flush_lsn in pg_stat_replication is NULL to other roles: the worker would wait forever.
            row = await (await conn.execute(statements.MAY_READ_ALL_STATS)).fetchone()
            if not (row and row[0]):
                raise CliError(f"--standby-flushed: role {user!r} may not read pg_stat_replication.flush_lsn: "
                               f"GRANT pg_read_all_stats TO \"{user}\"", EXIT_FAILED)
        if (cfg.shard and shard_range(cfg.shard) != (0, 1)) or cfg.shard_group:
            row = await (await conn.execute(statements.SHARDS_ENABLED)).fetchone()
            if not (row and row[0]):
                flag = f"--shard {cfg.shard}" if cfg.shard else f"--shard-group {cfg.shard_group}"
                raise CliError(f"{flag}: shards are not enabled in database {database!r}: the schema "
                               "owner runs SELECT outbox_shards_enable() (docs/how-to/shards.md)", EXIT_FAILED)
        settings = await (await conn.execute(statements.WORKER_SETTINGS)).fetchone()
        assert settings is not None
        # The LISTEN and the wakeup lock need sessions of their own (see outboxpg/relay/pooler.py).
        if not cfg.poll_only and await behind_transaction_pooler(cfg.dsn):
            raise CliError(POOLER_HINT, EXIT_USAGE)   # the flags do not fit the target: --poll-only
        rows = await (await conn.execute(statements.UNFINISHED_SUBJECTS, (MAX_SUBJECTS,))).fetchall()
        return (settings[0], settings[1], list(settings[2]), [Subject(*row) for row in rows]), database


def _load_publisher(spec: str, cfg: WorkerConfig) -> Any:
    """--publisher module:callable, the module looked up in the current directory first (as
    ``python -m`` does; a console script's sys.path starts with its bin/ directory instead).
    Any failure is one line, exit 2."""
    from outboxpg.relay.publishers import FunctionPublisher, PublisherNotFound, load_publisher

    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        publisher = load_publisher(spec)
    except PublisherNotFound as exc:
        raise CliError(f"{exc} (looked in the current directory {cwd} and the Python path)", EXIT_USAGE) from None
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if isinstance(publisher, FunctionPublisher):
        publisher.timeout = cfg.publish_timeout
    return publisher


def _check_cloudevents(args: argparse.Namespace) -> None:
    """--cloudevents puts the attributes in NATS headers, which a --publisher of your own never
    sees (it gets the event and can call outboxpg.cloudevents.CloudEvents(source).headers(event)
    itself); --cloudevents-source alone would do nothing. Both: one line, exit 2."""
    if args.cloudevents and args.publisher:
        raise CliError("--cloudevents applies to the NATS publisher only, not with --publisher: a publisher of your "
                       "own can call outboxpg.cloudevents.CloudEvents(source).headers(event)", EXIT_USAGE)
    if args.cloudevents and args.sink and not is_nats(args.sink):
        raise CliError(f"--cloudevents applies to NATS only, not to a {scheme_of(args.sink)}:// --sink", EXIT_USAGE)
    if args.cloudevents_source is not None and not args.cloudevents:
        raise CliError("--cloudevents-source needs --cloudevents", EXIT_USAGE)
    if args.cloudevents_source is not None:
        check_source(args.cloudevents_source)   # ValueError: exit 2 with its one line


def _new_metrics(args: argparse.Namespace) -> Any:
    """A database's metrics (its WorkerMetrics), made as it starts."""
    from outboxpg.relay.metrics import WorkerMetrics

    def new(cfg: WorkerConfig) -> WorkerMetrics:
        return WorkerMetrics(cfg.dsn, application_name=f"{application_name(cfg.name)} (metrics)",
                             max_event_types=args.metrics_event_types)
    return new


def _serve_metrics(args: argparse.Namespace, cfg: WorkerConfig) -> Any:
    """Bind the --metrics-port server now: a port in use or an address this host does not have
    is one line, exit 2, before the worker waits for NATS or claims anything. It serves the
    metrics of every database (outboxpg.relay.fleet_metrics), with a database label when there
    are several."""
    from outboxpg.relay.fleet_metrics import FleetMetrics

    metrics = FleetMetrics(labelled=several(args))
    try:
        metrics.serve(args.metrics_port, args.metrics_addr)
    except OSError as exc:   # EADDRINUSE, EADDRNOTAVAIL, EACCES, an unresolvable name (gaierror)
        reason = (exc.strerror or first_line(exc)).lower() if exc.strerror or str(exc) else type(exc).__name__
        raise CliError(f"cannot serve metrics on {args.metrics_addr}:{args.metrics_port}: {reason}",
                       EXIT_USAGE) from None
    log.info("event=metrics_serving addr=%s port=%d", args.metrics_addr, args.metrics_port)
    return metrics


async def _serve(args: argparse.Namespace, cfg: WorkerConfig, publisher: Any, targets: list[Any],
                 checked: dict[Any, Any], failed: dict[Any, Any], metrics: Any, stopping: asyncio.Event,
                 reload: asyncio.Event, set_databases: Any) -> int:
    """Run a Worker per database, sharing ``publisher``, until a signal (outboxpg.cli.databases)."""
    from outboxpg.relay.fleet import Fleet

    many = several(args)
    fleet = Fleet(publisher, args.max_in_flight or 2 * cfg.concurrency * cfg.batch_size, label_logs=many)
    await fleet.open()
    stream_problems = None
    if not args.publisher:
        async def stream_problems(settings: Any) -> list[str]:
            return await _stream_setup(args, publisher, cfg, *settings)
    databases = Databases(cfg, fleet, _check_database, fixed=[t for t in targets if t.where == "--dsn"],
                          dsn_file=args.dsn_file, metrics=metrics,
                          new_metrics=_new_metrics(args) if metrics is not None else None,
                          stream_problems=stream_problems, add_secrets=_add_secrets, reload=reload)
    set_databases(databases)
    if stopping.is_set():
        databases.stop()
    await databases.run(checked, failed)
    return 0


def _add_secrets(secrets: list[str]) -> None:
    """The passwords of DSNs read from --dsn-file (at start, and on each reload) join those the
    log lines never show."""
    for handler in logging.getLogger().handlers:
        redacting = next((f for f in handler.filters if isinstance(f, _Redact)), None)
        if redacting is None:
            redacting = _Redact([])
            handler.addFilter(redacting)
        redacting.secrets = sorted({*redacting.secrets, *secrets} - {""}, key=len, reverse=True)


def _log_databases(args: argparse.Namespace) -> None:
    """Over several databases each line names the one it is about (database=, from the tasks'
    context); the passwords of --dsn-file's DSNs are never shown either."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(DatabaseLabelFilter())
    _add_secrets(_file_secrets(args.dsn_file))


async def _wait_for_nats(servers: list[str], stopping: asyncio.Event) -> bool:
    """Wait until the NATS server answers, logging each failed try and pausing 0.2 s, 0.4 s, ...
    up to 5 s in between; a server that answers but not as NATS is a CliError (exit 3).
    nats-py's own connect retries a refused server forever and silently
    (every 0.5 s, logged at DEBUG only); this probe connection makes no retries of its own.
    False: stopped (SIGTERM) while waiting."""
    import nats

    from outboxpg.relay.nats.readiness import not_nats

    delay = 0.2
    while not stopping.is_set():
        seen: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            seen.append(exc)  # noqa: B023 - this try's list: the probe connection is this try's too

        try:
            nc = await nats.connect(servers, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=1,
                                    reconnect_time_wait=0, error_cb=on_error, name="outboxpg-worker-probe")
        except Exception as exc:  # noqa: BLE001 - refused, unresolvable, TLS, authorization...
            reason = seen[-1] if seen else exc
            for server in servers:   # a port that answers, but not as NATS: no wait makes it one
                why = await not_nats(server)
                if why:
                    raise CliError(f"--nats-url {server}: not a NATS server: {why}", EXIT_CONNECT) from None
            log.warning("event=nats_connect_failed url=%s error=%r retry_in=%.1fs", ",".join(servers),
                        describe(reason), delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay)
            delay = next_delay(delay)
            continue
        with contextlib.suppress(Exception):
            await nc.close()
        return True
    return False


async def _main(args: argparse.Namespace, finished: list[int]) -> int:
    """_start(); its exit code is also put in ``finished``, so that main() can tell a late
    signal after a clean stop from an interruption."""
    try:
        code = await _start(args)
        finished.append(code)
        return code
    finally:
        _ignore_late_signals(asyncio.get_running_loop())


def _ignore_late_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Once the worker has stopped, SIGTERM and SIGINT are ignored until the process exits. A
    second one can come at once: GNU timeout sends its signal to the worker and to its process
    group. Left to asyncio, one arriving after the loop closed its self-pipe and before it
    removed its handlers printed "Exception ignored ... OSError: [Errno 9] Bad file descriptor".
    (Removing asyncio's SIGINT handler restores Python's for an instant: a KeyboardInterrupt
    that slips through after a clean stop is read as the clean stop it follows, in main().)"""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


async def _start(args: argparse.Namespace) -> int:
    """Check, connect and run the worker until it stops (a signal while starting: exit 0)."""
    cfg: WorkerConfig = from_args(WorkerConfig, args, dsn="")
    cfg.validate()
    targets = targets_from(args)   # every DSN parsed and labelled, before anything connects
    many = several(args)
    if args.max_in_flight is not None and args.max_in_flight < 1:
        raise CliError(f"--max-in-flight must be at least 1, got {args.max_in_flight}", EXIT_USAGE)
    if many and args.cloudevents and args.cloudevents_source is None:
        raise CliError("--cloudevents over several databases needs --cloudevents-source (its default names one "
                       "database)", EXIT_USAGE)
    # SIGTERM/SIGINT while starting: stop waiting and exit 0; once running: databases.stop().
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    databases: list[Databases] = []

    def on_signal() -> None:
        stopping.set()
        for running in databases:
            running.stop()

    set_databases = databases.append

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    reload = asyncio.Event()   # SIGHUP with --dsn-file: re-read it (one that comes while starting, once running)
    if args.dsn_file is not None:
        loop.add_signal_handler(signal.SIGHUP, reload.set)
    if not 0 <= args.metrics_port <= 65535:
        raise CliError(f"--metrics-port must be 0 (off) or a port from 1 to 65535, got {args.metrics_port}", EXIT_USAGE)
    if args.metrics_event_types < 0:
        raise CliError(f"--metrics-event-types must be 0 or more, got {args.metrics_event_types}", EXIT_USAGE)
    check_sink_flags(args)
    _check_cloudevents(args)
    sink = None
    if args.sink and is_nats(args.sink):
        if args.nats_url != DEFAULT_NATS_URL:
            raise CliError("--sink and --nats-url both name the NATS server: keep one", EXIT_USAGE)
        args.nats_url = args.sink   # the NATS path, exactly as --nats-url
    elif args.sink:
        # Checked (URL, options, client library) before anything else is set up; connected later.
        sink = open_configured(sink_settings(args, cfg.publish_timeout, args.webhook_secret))
    # Your own publisher first: a misspelt one is reported before anything else is set up.
    custom = _load_publisher(args.publisher, cfg) if args.publisher else None
    if custom is None and sink is None:
        from outboxpg.relay.nats.connection import parse_servers

        servers = parse_servers(args.nats_url)   # ValueError: exit 2 with its one line
    checked, failed, database = await check_all(targets, cfg, _check_database, many)
    metrics = _serve_metrics(args, cfg) if args.metrics_port else None
    if metrics is not None:
        metrics.health.checked_schema()   # /readyz: the start-up checks above passed
    if custom is not None:
        publisher = custom
    elif sink is not None:
        log.info("event=sink_target url=%s sink=%r", without_credentials(args.sink), sink.describe())
        started = await start_sink(sink, stopping)
        if started is None:
            return 0   # stopped while starting
        publisher = started
    else:
        from outboxpg.relay.nats.publisher import NatsPublisher

        log.info("event=nats_target url=%s%s", ",".join(servers),
                 " (the default: --sink or --nats-url names another)"
                 if args.nats_url == DEFAULT_NATS_URL and not args.sink else "")
        if not await _wait_for_nats(servers, stopping):
            return 0
        cloudevents = None
        if args.cloudevents:
            cloudevents = CloudEvents(args.cloudevents_source or default_source(database))
            log.info("event=cloudevents mode=binary specversion=%s source=%s", SPEC_VERSION, cloudevents.source)
        publisher = NatsPublisher(servers, ack_timeout=cfg.publish_timeout, cloudevents=cloudevents)
        await publisher.start()
        try:
            ready = True
            for settings in merged_settings(list(checked.values())):
                ready = ready and await _broker_ready(args, publisher, cfg, settings, stopping,
                                                      metrics.health if metrics is not None else None)
        except BaseException:
            await publisher.close()
            raise
        if not ready:
            await publisher.close()
            return 0
    return await _serve(args, cfg, publisher, targets, checked, failed, metrics, stopping, reload, set_databases)


class _OneLine(logging.Filter):
    """One log line per record: libpq's errors for a multi-host DSN run over several lines (one
    per host tried), which psycopg_pool logs as they are while it reconnects: joined. Any other
    control character (a bare CR, an escape sequence) is escaped: a value a producer wrote must
    not forge a line or drive the terminal that shows the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        clean = printable(join_lines(text) if "\n" in text else text)
        if clean != text:
            record.msg, record.args = clean, None
        return True


class _Redact(logging.Filter):
    """Replaces every form of the given secrets in log lines with ***."""

    def __init__(self, secrets: Sequence[str]) -> None:
        super().__init__()
        self.secrets = list(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        clean = redact(text, self.secrets)
        if clean != text:
            record.msg, record.args = clean, None
        return True


def _file_secrets(path: str | None) -> list[str]:
    """The passwords of --dsn-file's DSNs (a file that cannot be read fails the start later)."""
    if path is None:
        return []
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return [s for line in Path(path).read_text().splitlines() for s in secrets_of(line)]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except CliError as exc:   # an OUTBOXPG_* variable that does not parse
        print(f"outboxpg-worker: {exc}", file=sys.stderr)
        return exc.code
    args = parser.parse_args(argv)
    if args.dsn is None and args.dsn_file is None:
        # libpq would pick a database by itself (the local socket, one named after the OS user).
        print("outboxpg-worker: the worker writes to a database: name it with --dsn or OUTBOXPG_DSN "
              "(--dsn '' takes libpq's PG* variables)", file=sys.stderr)
        return EXIT_USAGE
    restore_double_dash(args, ("dsn", "nats_url", "ensure_stream", "publisher", "name", "metrics_addr",
                               "cloudevents_source", "sink", "webhook_secret_file"))
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s")
    try:
        # Read before any line is logged: the secret is redacted from them all.
        args.webhook_secret = webhook_secret(args)
    except CliError as exc:
        print(f"outboxpg-worker: {exc}", file=sys.stderr)
        return exc.code
    secrets = sorted({*secrets_of(args.dsn), *url_secrets(args.nats_url, token=True), *sink_secrets(args)} - {""},
                     key=len, reverse=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_OneLine())
        if secrets:
            handler.addFilter(_Redact(secrets))
    _log_databases(args)

    def fail(message: str, code: int) -> int:
        print(printable(redact(f"outboxpg-worker: {message}", secrets)), file=sys.stderr)
        return code

    finished: list[int] = []   # _main's exit code, once the worker has stopped
    try:
        # The relay allocates a few dozen container objects per event (rows, events, header
        # dicts, nats-py messages), nearly all freed at once by reference counting; the cyclic
        # collector's default gen-0 threshold (700) still ran it every ~30 events, about 1 us of
        # CPU per event (4% of the worker's). A process of our own: tuned here, not in Worker.
        gc.set_threshold(50_000, 20, 100)
        return asyncio.run(_main(args, finished))
    except CliError as exc:
        return fail(str(exc), exc.code)
    except ValueError as exc:   # a flag out of range (WorkerConfig.validate)
        return fail(str(exc), EXIT_USAGE)
    except psycopg.OperationalError as exc:
        if exc.sqlstate is None:   # from libpq: connecting failed, or the connection broke
            return fail(describe_connection_error(exc), EXIT_CONNECT)
        return fail(f"database error at start: {first_line(exc)}", EXIT_FAILED)
    except psycopg.Error as exc:
        return fail(f"database error at start: {first_line(exc)}", EXIT_FAILED)
    except KeyboardInterrupt:
        return finished[0] if finished else EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
