"""The databases ``outboxpg-worker`` serves: repeated --dsn, --dsn-file (re-read on SIGHUP), their
labels, their start-up checks, and keeping the running set in step with them.

Labels. Each database is named in log lines (``database=``) and metrics (the ``database`` label)
by ``dbname@host:port`` read from its DSN (libpq's PG* variables and defaults filling the gaps;
never the password), or by the ``name=LABEL`` that starts its line in the file.

The file: one DSN (key=value string or URI) per line; blank lines and lines starting with ``#``
are skipped; ``name=LABEL`` (no spaces) before the DSN names it. Every DSN is parsed at start and
on each reload: a line that does not parse, a label used twice, or an unreadable file is a usage
error at start (exit 2) and, on reload, a logged error that keeps the running set as it is.

At start. One database (one --dsn): every check fails the start as before (exit 2, 3, 4, 1).
Several: a DSN that does not parse fails the start (exit 2: a typo there is nobody's outage);
a database that fails its checks (down, no schema yet, a refused login, untrusted creators) is
logged (``event=database_unavailable``) and checked again, 1 s, 2 s, ... up to a minute apart,
while the others run: a relay over 50 tenant databases does not refuse to start, nor stop
delivering, because one of them is down. If none passes, the start fails with the first
failure's exit code: there is nothing to serve.

On SIGHUP (with --dsn-file): a database added starts (after its checks); one removed finishes
and reports its in-flight batches, then stops; one whose DSN changed under the same label is
stopped and started again; the others keep running untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg

from outboxpg.cli.common import describe_connection_error, parse_dsn, secrets_of
from outboxpg.cli.errors import EXIT_CONNECT, EXIT_FAILED, EXIT_USAGE, CliError
from outboxpg.option import option
from outboxpg.relay.backoff import next_delay
from outboxpg.relay.fleet import DATABASE, Fleet
from outboxpg.relay.fleet_metrics import FleetMetrics
from outboxpg.relay.metrics import WorkerMetrics
from outboxpg.relay.worker import WorkerConfig
from outboxpg.text import first_line, printable

__all__ = ["DatabaseOptions", "Databases", "Target", "check_all", "targets_from"]

log = logging.getLogger("outboxpg.worker")

# A database that failed its checks is checked again after 1 s, 2 s, 4 s, ... at most this long.
RETRY_MOST = 60.0
# Start-up checks run at once, at most this many together.
CHECKS_AT_ONCE = 8


@dataclass
class DatabaseOptions:
    """outboxpg-worker's options for serving several databases (beside --dsn repeated, which is
    WorkerConfig.dsn's flag), and the limit shared by them."""

    dsn_file: str | None = option("serve the databases of this file too: one connection string per line, '#' "
                                  "comments, 'name=LABEL ' before one to label it; re-read on SIGHUP "
                                  "(docs/how-to/many-databases.md)", None, metavar="PATH")
    max_in_flight: int | None = option("events being published at once across all databases, handed to the "
                                       "databases waiting in turn (fairness over the shared publisher); default: "
                                       "2 x --concurrency x --batch-size", None, metavar="N")


@dataclass(frozen=True)
class Target:
    label: str
    dsn: str
    where: str    # where it was given: '--dsn', 'PATH:LINE'


def label_of(dsn: str) -> str:
    """'dbname@host:port' of a DSN, libpq's PG* variables and defaults filling in (no password)."""
    params = parse_dsn(dsn)
    user = params.get("user") or os.environ.get("PGUSER") or getpass.getuser()
    dbname = params.get("dbname") or os.environ.get("PGDATABASE") or user
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "local"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    return printable(f"{dbname}@{host}:{port}")


def read_dsn_file(path: str) -> list[Target]:
    """The databases of --dsn-file; a CliError (exit 2) naming the file and line otherwise."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--dsn-file {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}",
                       EXIT_USAGE) from None
    targets = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{n}"
        label = None
        if line.startswith("name="):
            first, _, line = line.partition(" ")
            label = first.removeprefix("name=")
            line = line.strip()
            if not label or not label.isprintable():
                raise CliError(f"--dsn-file {where}: name= needs a label without spaces", EXIT_USAGE)
            if not line:
                raise CliError(f"--dsn-file {where}: name={label} without a connection string after it", EXIT_USAGE)
        try:
            found = label_of(line)
        except CliError as exc:
            raise CliError(f"--dsn-file {where}: {exc}", EXIT_USAGE) from None
        targets.append(Target(label or found, line, where))
    return targets


def _unique(targets: Sequence[Target]) -> list[Target]:
    seen: dict[str, Target] = {}
    for t in targets:
        if t.label in seen:
            raise CliError(f"two databases are labelled {t.label!r} ({seen[t.label].where} and {t.where}): "
                           "give one a name=LABEL in the --dsn-file", EXIT_USAGE)
        seen[t.label] = t
    return list(seen.values())


def targets_from(args: Any) -> list[Target]:
    """The databases named by --dsn (each) and --dsn-file, parsed and labelled: any problem is
    a CliError, exit 2, before anything connects."""
    # "--dsn=--" is taken as the string "--" (argparse makes it an empty list: restore_double_dash).
    dsns = ["--" if dsn == [] else dsn for dsn in args.dsn or ()]
    targets = [Target(label_of(dsn), dsn, "--dsn") for dsn in dsns]
    if args.dsn_file is not None:
        targets += read_dsn_file(args.dsn_file)
    if not targets:
        raise CliError("no database to serve: --dsn-file "
                       f"{args.dsn_file} names none" if args.dsn_file else "no database to serve", EXIT_USAGE)
    return _unique(targets)


def several(args: Any) -> bool:
    """Whether the process serves a set of databases (labelled in logs and metrics, checked one
    by one): --dsn more than once, or a file of them (which a reload may grow)."""
    return len(args.dsn or ()) > 1 or args.dsn_file is not None


Settings = Any   # what outboxpg_worker._check_database returns for the stream checks
Check = Callable[[WorkerConfig], Awaitable[tuple[Settings, str]]]


async def _check(check: Check, cfg: WorkerConfig, target: Target) -> tuple[Settings, str]:
    """``check`` of one database, every failure as a CliError (the exit code it would have)."""
    token = DATABASE.set(target.label)
    try:
        return await check(replace(cfg, dsn=target.dsn))
    except psycopg.OperationalError as exc:
        if exc.sqlstate is None:
            raise CliError(describe_connection_error(exc), EXIT_CONNECT) from None
        raise CliError(f"database error at start: {first_line(exc)}", EXIT_FAILED) from None
    except psycopg.Error as exc:
        raise CliError(f"database error at start: {first_line(exc)}", EXIT_FAILED) from None
    finally:
        DATABASE.reset(token)


async def check_all(targets: Sequence[Target], cfg: WorkerConfig, check: Check, many: bool
                    ) -> tuple[dict[Target, tuple[Settings, str]], dict[Target, CliError], str]:
    """Each database's start-up checks, a few at once: (passed, failed, the first passed one's
    database name). Over one database (not ``many``) its failure is raised as it is; over
    several, only when none passed."""
    if not many:
        (only,) = targets
        settings, name = await check(replace(cfg, dsn=only.dsn))
        return {only: (settings, name)}, {}, name
    gate = asyncio.Semaphore(CHECKS_AT_ONCE)

    async def one(target: Target) -> tuple[Settings, str] | CliError:
        async with gate:
            try:
                return await _check(check, cfg, target)
            except CliError as exc:
                return exc

    results = await asyncio.gather(*(one(t) for t in targets))
    passed = {t: r for t, r in zip(targets, results) if not isinstance(r, CliError)}
    failed = {t: r for t, r in zip(targets, results) if isinstance(r, CliError)}
    if not passed:
        first = next(iter(failed.items()))
        raise CliError(f"no database passed its start-up checks; {first[0].label}: {first[1]}"
                       + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""), first[1].code)
    for target, exc in failed.items():
        log.warning("event=database_unavailable database=%s code=%d error=%r note=%r", target.label, exc.code,
                    str(exc), "the others start; checked again every 1 s to 60 s")
    return passed, failed, next(iter(passed.values()))[1]


def merged_settings(checked: Sequence[tuple[Settings, str]]) -> list[Settings]:
    """The stream checks' settings: one per subject prefix, backoff cap and allowed prefixes
    (usually one for all the databases), each with the explicit subjects of all of them."""
    merged: dict[tuple[Any, ...], list[Any]] = {}
    for (prefix, cap, allowed, subjects), _ in checked:
        merged.setdefault((prefix, cap, tuple(allowed)), []).extend(subjects)
    return [(prefix, cap, list(allowed), subjects) for (prefix, cap, allowed), subjects in merged.items()]


StreamProblems = Callable[[Settings], Awaitable[list[str]]]


class Databases:
    """Keeps the fleet's Workers in step with the targets: starts the checked ones, checks the
    failed ones again, and on SIGHUP re-reads --dsn-file."""

    def __init__(self, cfg: WorkerConfig, fleet: Fleet, check: Check, *, fixed: Sequence[Target],
                 dsn_file: str | None, metrics: FleetMetrics | None,
                 new_metrics: Callable[[WorkerConfig], WorkerMetrics] | None,
                 stream_problems: StreamProblems | None, add_secrets: Callable[[list[str]], None],
                 reload: asyncio.Event | None = None) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.check = check
        self.fixed = list(fixed)
        self.dsn_file = dsn_file
        self.metrics = metrics
        self.new_metrics = new_metrics
        self.stream_problems = stream_problems
        self.add_secrets = add_secrets
        self.targets: dict[str, Target] = {}        # label -> what is served, or being checked again
        self._retrying: dict[str, asyncio.Task[None]] = {}
        self._stop = asyncio.Event()
        self._reload = reload if reload is not None else asyncio.Event()   # set: re-read --dsn-file

    def stop(self) -> None:
        self._stop.set()
        if self.metrics is not None:
            self.metrics.health.stop()
        self.fleet.stop()

    def reload(self) -> None:
        self._reload.set()

    def _start(self, target: Target) -> None:
        cfg = replace(self.cfg, dsn=target.dsn)
        metrics = self.new_metrics(cfg) if self.new_metrics is not None else None
        if metrics is not None:
            metrics.health.checked_schema()
            metrics.health.checked_stream([])
        self.fleet.start(target.label, cfg, metrics)
        if self.metrics is not None and metrics is not None:
            self.metrics.add(target.label, metrics)

    async def _stop_one(self, label: str) -> None:
        task = self._retrying.pop(label, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.fleet.remove(label)
        if self.metrics is not None:
            self.metrics.remove(label)
        self.targets.pop(label, None)

    def _retry(self, target: Target, why: CliError | str) -> None:
        if self.metrics is not None:
            self.metrics.health.waiting[target.label] = str(why)
        self._retrying[target.label] = asyncio.create_task(self._check_again(target), name=f"outboxpg-recheck "
                                                                                           f"{target.label}")

    async def _ready(self, target: Target) -> str | CliError | None:
        """The start-up checks (and the stream check, for a late comer): None when it may start."""
        try:
            settings, _ = await _check(self.check, self.cfg, target)
        except CliError as exc:
            return exc
        if self.stream_problems is not None:
            try:
                fatal = await self.stream_problems(settings)
            except Exception as exc:  # noqa: BLE001 - a JetStream request that failed
                return f"cannot check the JetStream streams: {first_line(exc)}"
            if fatal:
                return fatal[0]
        return None

    async def _check_again(self, target: Target) -> None:
        delay = 0.0
        while True:
            delay = next_delay(delay, RETRY_MOST) if delay else 1.0
            await asyncio.sleep(delay)
            problem = await self._ready(target)
            if problem is None:
                break
            if self.metrics is not None:
                self.metrics.health.waiting[target.label] = str(problem)
            log.warning("event=database_unavailable database=%s error=%r retry_in=%.0fs", target.label,
                        str(problem), next_delay(delay, RETRY_MOST))
        self._retrying.pop(target.label, None)
        log.info("event=database_available database=%s", target.label)
        self._start(target)

    async def _add(self, target: Target) -> None:
        self.targets[target.label] = target
        problem = await self._ready(target)
        if problem is None:
            log.info("event=database_added database=%s", target.label)
            self._start(target)
            return
        log.warning("event=database_unavailable database=%s error=%r note=%r", target.label, str(problem),
                    "checked again every 1 s to 60 s")
        self._retry(target, problem)

    async def _reread(self) -> None:
        assert self.dsn_file is not None
        try:
            wanted = _unique([*self.fixed, *read_dsn_file(self.dsn_file)])
        except CliError as exc:
            log.error("event=reload_failed error=%r note=%r", str(exc), "still serving the same databases")
            return
        self.add_secrets([s for t in wanted for s in secrets_of(t.dsn)])
        new = {t.label: t for t in wanted}
        gone = [label for label, t in self.targets.items() if new.get(label, None) is None
                or new[label].dsn != t.dsn]
        added = [t for label, t in new.items() if label not in self.targets or self.targets[label].dsn != t.dsn]
        log.info("event=reload databases=%d added=%d removed=%d unchanged=%d", len(new),
                 len([t for t in added if t.label not in self.targets]), len([g for g in gone if g not in new]),
                 len(new) - len(added))
        for label in gone:
            log.info("event=database_removed database=%s", label)
        await asyncio.gather(*(self._stop_one(label) for label in gone))
        await asyncio.gather(*(self._add(t) for t in added))

    async def run(self, checked: dict[Target, Any], failed: dict[Target, CliError]) -> None:
        """Serve until stop(): the checked databases at once, the failed ones once they pass."""
        for target in checked:
            self.targets[target.label] = target
            self._start(target)
        for target, exc in failed.items():
            self.targets[target.label] = target
            self._retry(target, exc)
        try:
            while not self._stop.is_set():
                stop = asyncio.ensure_future(self._stop.wait())
                reload = asyncio.ensure_future(self._reload.wait())
                try:
                    await asyncio.wait({stop, reload}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stop.cancel()
                    reload.cancel()
                if self._reload.is_set() and not self._stop.is_set():
                    self._reload.clear()
                    if self.dsn_file is None:
                        continue
                    log.info("event=reload_requested file=%s", self.dsn_file)
                    await self._reread()
        finally:
            for task in self._retrying.values():
                task.cancel()
            await asyncio.gather(*self._retrying.values(), return_exceptions=True)
            await self.fleet.close()
