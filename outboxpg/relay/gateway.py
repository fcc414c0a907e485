"""The worker's SQL gateway: every statement the relay sends while it runs, on pools of its own.
The decisions are the SQL functions' (order, retries, dead letters, fencing by lease token);
this module only calls them and hands back what they return.

The claims go on a connection of their own (a pool of one), with the look at the next wakeup
that the worker makes between them: the worker claims one batch at a time, and a connection's
first outbox_claim compiles the function and plans its statements (15 to 20 ms of the server's
CPU), which every connection of a shared pool would pay once, and again whenever the pool
replaces it. That connection calls outbox_warm_up() as it opens, before its first claim: the
planning is paid when the worker starts (or reconnects), not in the middle of the first burst of
events, where a fleet of workers would pay it all at once. The reports and the rest share the
other pool, which keeps --report-connections (2) open while the worker is idle, each warmed up
the same way as it opens: a burst's first reports then open no server session and plan nothing
(eight workers' first burst of 20,000 events opened 11-16 sessions without them: BENCHMARKS.md,
Shards). At the start the claims' connection is handed out once those have warmed up too: a
warm-up holds the heads its claim took, which the worker's own claims would skip.
The pool grows up to --concurrency + 2 for a burst and closes what it grew by after max_idle,
10 minutes; with --report-connections 0 an idle worker holds only the claims', the LISTEN and
the wakeup lock's connections.

The start-up checks of ``outboxpg-worker`` (outboxpg.cli.outboxpg_worker), the wakeup lock and
the LISTEN connection (wakeup.py) send their own few statements on connections of their own;
those, like every other statement of the package, are in outboxpg/statements.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.adapt import Buffer, Loader
from psycopg_pool import AsyncConnectionPool
from psycopg_pool.pool_async import AddConnection

from outboxpg.events import CLAIM_COLUMNS
from outboxpg.relay.backoff import DB_MAX_DELAY, next_delay
from outboxpg.relay.config import WorkerConfig
from outboxpg.relay.wakeup import CONNECT_OPTIONS
from outboxpg.text import first_line

__all__ = ["Gateway", "RawJsonLoader", "Reported", "lsn_value"]

log = logging.getLogger("outboxpg.worker")

# The fourth argument: the claim's byte budget (--claim-bytes; NULL: outbox_settings.max_claim_bytes);
# the fifth, the shard (--shard 'I/N'; NULL: every aggregate).
_CLAIM = f"SELECT {CLAIM_COLUMNS} FROM outbox_claim(%s, %s, %s, %s::bigint, %s::text, %s)"
# With --standby-flushed: also where the WAL ends once the claim has run (evaluated after the
# function, which returns its rows all at once). Every claimed event's commit record is before
# it (the claim saw those commits), and so is the claim's own work: its commit record, flushed at
# commit (synchronous_commit = local on these connections), comes after. So the primary flushes
# up to this point as the claim commits, and a standby that flushed it holds every claimed event.
_CLAIM_WITH_LSN = (f"SELECT {CLAIM_COLUMNS}, pg_current_wal_insert_lsn()::text "
                   "FROM outbox_claim(%s, %s, %s, %s::bigint, %s::text, %s)")
# How far the standbys (all, or the one named) have flushed: (how many are connected, the
# furthest flush_lsn). flush_lsn is NULL to a role without pg_read_all_stats.
_STANDBY_FLUSH = """
SELECT count(*)::int, count(flush_lsn)::int, max(flush_lsn)::text
  FROM pg_stat_replication
 WHERE %(standby)s = 'any' OR application_name = %(standby)s
"""
# The completed events' created_at range: the update reads only their partitions.
_COMPLETE = "SELECT outbox_complete(%s::bigint[], %s, %s, %s)"
_FAIL = "SELECT outbox_fail(%s, %s, %s, %s, %s)"
_RELEASE = "SELECT outbox_release(%s::bigint[], %s)"
_EXTEND = "SELECT outbox_extend(%s::bigint[], %s, %s)"
_SLEEP_FOR = "SELECT extract(epoch FROM outbox_next_wakeup(%s) - clock_timestamp())::float8"
_PING = "SELECT 1"
# A new claims connection plans the claim and the report ahead of its first claim (then undone).
_WARM_UP = "SELECT outbox_warm_up(%s::text)"
_MAINTAIN = "SELECT action, partition, detail FROM outbox_maintain()"
# Keys of finished events forgotten (0022), a batch a run.
_FORGET_KEYS = "SELECT outbox_idempotency_forget()"
# The oldest holder of the xmin horizon past outbox_settings.xmin_warn_after, if any.
_XMIN_HOLDER = ("SELECT kind, pid, name, since, extract(epoch FROM age)::float8, xmin_age, state, role, "
                "application_name FROM outbox_xmin_holders() WHERE past_threshold "
                "ORDER BY xmin_age DESC NULLS LAST LIMIT 1")

_REPORT_ATTEMPTS = 5

# What a report changed: (events completed, the state outbox_fail returned for each failure in
# order ('pending', 'dead', or None for a lease lost), events released).
Reported = tuple[int, list[str | None], int]


class RawJsonLoader(Loader):
    """Load json/jsonb as the bytes PostgreSQL sent: the worker forwards payloads, it never
    needs to parse them."""

    def load(self, data: Buffer) -> bytes:
        return bytes(data)


def id_array(ids: Sequence[int]) -> str:
    """The ids as one bigint[] literal, joined in C: psycopg's list dumper would visit each
    element in Python, for the same text on the wire."""
    return "{" + ",".join(map(str, ids)) + "}"


class _Pool(AsyncConnectionPool):
    """psycopg_pool's pool, with its reconnection attempts at most DB_MAX_DELAY apart.

    The pool replaces a broken connection (returned broken, or found broken by check()) with a
    new one, trying again after 1, 2, 4, 8 ... seconds while the server is away: after a long
    outage (a failover, a restart) its next try could come half a minute after the server was
    back, and every claim waits for it. Capped here, the pool has a connection within about a
    second of a standby's promotion or a server's return, whatever the outage's length.
    """

    async def schedule_task(self, task: Any, delay: float) -> None:
        if isinstance(task, AddConnection):
            delay = min(delay, DB_MAX_DELAY)
        await super().schedule_task(task, delay)


def lsn_value(text: str) -> int:
    """A pg_lsn's text ('16/B374D848') as a number, to compare in Python."""
    high, _, low = text.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection (not the statement) failed: libpq's errors have no
    SQLSTATE (server gone, connection refused, read-only host under target_session_attrs), nor
    does the pool's timeout; an admin shutdown or a crash recovery in progress have theirs."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    return exc.sqlstate is None or exc.sqlstate.startswith("57P")


class Gateway:
    def __init__(self, cfg: WorkerConfig, application_name: str) -> None:
        self.cfg = cfg
        self.application_name = application_name
        self._pool: AsyncConnectionPool | None = None
        self._warm_up_failed = False
        # Set once the claims' connection has warmed up: the reports' warm-ups wait for it, since
        # warm-ups side by side take the intake row from one another and plan less.
        self._claims_warmed = asyncio.Event()
        # Set at the start once the reports' pool has configured as many connections as it keeps
        # and none is warming up: the claims' connection is handed out then (_configure_claims).
        self._reports_to_open = cfg.report_connections
        self._reports_warming = 0
        self._reports_warmed = asyncio.Event()
        self._note_reports()
        self._claims: AsyncConnectionPool | None = None

    @property
    def pool(self) -> AsyncConnectionPool:
        assert self._pool is not None, "Gateway.open() first"
        return self._pool

    @property
    def claims(self) -> AsyncConnectionPool:
        assert self._claims is not None, "Gateway.open() first"
        return self._claims

    async def open(self) -> None:
        """Create the pools (in the running event loop) and start connecting, without waiting."""
        cfg = self.cfg
        kwargs = {"autocommit": True, "fallback_application_name": self.application_name, **CONNECT_OPTIONS,
                  **_poll_only_options(cfg)}
        self._claims = _Pool(cfg.dsn, min_size=1, max_size=1, open=False, timeout=10, kwargs=kwargs,
                             configure=self._configure_claims, name="outboxpg-worker-claims")
        kept = cfg.report_connections
        self._pool = _Pool(cfg.dsn, min_size=kept, max_size=max(kept, cfg.concurrency + 2), open=False, timeout=10,
                           kwargs=kwargs, configure=self._configure_pooled, name="outboxpg-worker")
        await self._claims.open(wait=False)
        await self._pool.open(wait=False)

    async def close(self) -> None:
        await self.claims.close()
        await self.pool.close()

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        conn.adapters.register_loader("jsonb", RawJsonLoader)
        conn.adapters.register_loader("json", RawJsonLoader)
        if self.cfg.standby_flushed and not self.cfg.poll_only:
            # The claim's commit is flushed locally before the claim returns (see _CLAIM_WITH_LSN),
            # without waiting for synchronous standbys: the worker waits for the standby itself.
            await conn.execute("SET synchronous_commit = local")
        elif not self.cfg.poll_only:
            # Claims and reports commit without waiting for the WAL flush (about 2 ms a commit on
            # this kind of disk, on every event's path). What a server crash can lose is a lease
            # or a "published" mark, never an event: the event is then published again with the
            # same msg_id, and JetStream drops the duplicate. Not done in --poll-only mode, where
            # a pooler in transaction mode would carry a session SET over to other clients.
            await conn.execute("SET synchronous_commit = off")

    async def _configure_claims(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await self._configure(conn)
        starting = not self._claims_warmed.is_set()
        try:
            await self._warm_up(conn)
        finally:
            self._claims_warmed.set()
        if starting:
            # The reports' kept connections warm up now, after this one. A warm-up claims as a
            # worker does, and other claims skip the heads it holds until it undoes its work: the
            # worker's first claim waits for them, so that it never meets its own warm-ups (a
            # claim that came back short beside one made run_until_idle stop with events left).
            # Only at the start, and 5 s at most: a connection replaced later serves at once.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reports_warmed.wait(), 5)

    async def _configure_pooled(self, conn: psycopg.AsyncConnection[Any]) -> None:
        try:
            await self._configure(conn)
            pool = self._pool
            if pool is not None and pool.get_stats().get("pool_size", 0) <= pool.min_size:
                # One of the connections kept while idle (--report-connections), opened with the
                # pool or in place of one it closed: planned now, off any burst's path. One the pool
                # adds because reports are waiting serves as it opens (a warm-up would cost them more).
                self._reports_warming += 1
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._claims_warmed.wait(), 10)
                    await self._warm_up(conn)
                finally:
                    self._reports_warming -= 1
        finally:
            self._reports_to_open -= 1
            self._note_reports()

    def _note_reports(self) -> None:
        if self._reports_to_open <= 0 and self._reports_warming == 0:
            self._reports_warmed.set()

    async def _warm_up(self, conn: psycopg.AsyncConnection[Any]) -> None:
        try:
            await conn.execute(_WARM_UP, (self.cfg.shard or None,))
        except psycopg.Error as exc:
            # Only the first claim's (or report's) speed depends on it: the connection serves as it
            # is. Said once: the other connections would fail for the same reason.
            if not self._warm_up_failed:
                self._warm_up_failed = True
                log.warning("event=warm_up_failed worker=%s error=%r", self.cfg.name, first_line(exc))

    async def claim(self, batch_size: int, lease: timedelta, name: str, shard: str | None = None,
                    quiet_only: bool = False) -> list[tuple[Any, ...]]:
        """outbox_claim's rows (CLAIM_COLUMNS, jsonb as raw bytes); psycopg.Error passes through.
        ``shard``: 'I/N' (--shard, or a shard group's current one); None: every aggregate.
        ``quiet_only``: the quiet aggregates at the front of the queue only (the worker's lane)."""
        statement = _CLAIM_WITH_LSN if self.cfg.standby_flushed else _CLAIM
        async with self.claims.connection() as conn:
            cur = await conn.execute(statement, (batch_size, lease, name, self.cfg.claim_bytes, shard, quiet_only),
                                     prepare=True)
            return await cur.fetchall()

    async def replaced_broken_connections(self) -> None:
        """Have the pool test its idle connections now and replace the broken ones (after a
        failover every one of them is): the next claim then does not pick up another dead one."""
        with contextlib.suppress(Exception):
            await self.claims.check()
        with contextlib.suppress(Exception):
            await self.pool.check()

    async def release(self, ids: Sequence[int], token: Any) -> int:
        """outbox_release: hand ``ids`` back unpublished (not an attempt)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_RELEASE, (id_array(ids), token))
            row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    async def standby_flush(self, standby: str) -> tuple[int, int, int | None]:
        """(standbys connected, of which flush_lsn can be read, the furthest flush_lsn) among
        all standbys (``standby`` 'any') or the one with that application_name."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_STANDBY_FLUSH, {"standby": standby}, prepare=True)
            row = await cur.fetchone()
        assert row is not None
        return row[0], row[1], lsn_value(row[2]) if row[2] is not None else None

    async def extend(self, ids: str, token: Any, lease: timedelta) -> int:
        """outbox_extend: how many of ``ids`` (an id_array literal) are still held under ``token``."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(_EXTEND, (ids, token, lease))   # rare: not prepared
            row = await cur.fetchone()
        assert row is not None
        return int(row[0])

    async def report(self, ok: Sequence[int], token: Any, failed: Sequence[tuple[int, str, bool, timedelta | None]],
                     released: Sequence[int], ok_created: tuple[datetime, datetime] | None = None) -> Reported | None:
        """Complete ``ok`` (whose created_at lie within ``ok_created``, the least and the greatest,
        when given), fail each (id, error text, permanent, retry after) of ``failed``, release
        ``released``, all under ``token``; tried up to five times on database errors, then None
        (logged: the leases will expire and the events be retried)."""
        ok_ids = id_array(ok)
        complete = (ok_ids, token, *(ok_created or (None, None)))
        delay = 0.0
        for attempt in range(_REPORT_ATTEMPTS):
            try:
                async with self.pool.connection() as conn:
                    if not failed:
                        # The usual case: one statement, no pipeline to set up.
                        cur = await conn.execute(_COMPLETE, complete, prepare=True)
                        return (await cur.fetchone())[0], [], 0  # type: ignore[index]
                    # Any order is fine for the SQL: each call touches only its own ids.
                    async with conn.pipeline():
                        done_cur = await conn.execute(_COMPLETE, complete, prepare=True) if ok else None
                        fail_curs = [await conn.execute(_FAIL, (event_id, token, text, permanent, wait), prepare=True)
                                     for event_id, text, permanent, wait in failed]
                        release_cur = (await conn.execute(_RELEASE, (id_array(released), token), prepare=True)
                                       if released else None)
                    completed = (await done_cur.fetchone())[0] if done_cur else 0  # type: ignore[index]
                    states = [(await c.fetchone())[0] for c in fail_curs]  # type: ignore[index]
                    handed_back = (await release_cur.fetchone())[0] if release_cur else 0  # type: ignore[index]
                    return completed, states, handed_back
            except psycopg.Error as exc:
                log.warning("event=db_error during=report attempt=%d error=%r", attempt + 1, first_line(exc))
                if attempt == _REPORT_ATTEMPTS - 1:
                    break
                # Other pooled connections may be dead too (a server restart, killed backends):
                # have the pool check its idle ones before the next try. 0.1 + 0.2 + 0.4 + 0.8 s
                # stays well inside the lease, which is at least twice the publish timeout.
                await self.replaced_broken_connections()
                delay = next_delay(delay)
                await asyncio.sleep(delay)
        return None

    async def ping(self, timeout: float) -> None:
        """SELECT 1 on a connection of the pool, waiting at most ``timeout`` for one (the
        /readyz probe); psycopg.Error or psycopg_pool.PoolTimeout when PostgreSQL is not usable."""
        async with self.pool.connection(timeout=timeout) as conn:
            await conn.execute(_PING)

    async def seconds_to_next_wakeup(self, shard: str | None = None) -> float | None:
        """Until the next retry or lease expiry (outbox_next_wakeup) of ``shard``'s aggregates
        ('I/N'; None: every aggregate), None: nothing scheduled."""
        async with self.claims.connection() as conn:
            row = await (await conn.execute(_SLEEP_FOR, (shard,))).fetchone()
        return row[0] if row else None

    async def maintain(self) -> list[tuple[str, str | None, str | None]]:
        """outbox_maintain()'s (action, partition, detail) rows."""
        async with self.pool.connection() as conn:
            return await (await conn.execute(_MAINTAIN)).fetchall()

    async def forget_keys(self) -> int:
        """outbox_idempotency_forget(): how many idempotency keys of finished events it forgot."""
        async with self.pool.connection() as conn:
            row = await (await conn.execute(_FORGET_KEYS)).fetchone()
        return int(row[0]) if row else 0

    async def oldest_xmin_holder(self) -> tuple[Any, ...] | None:
        """outbox_xmin_holders()'s oldest holder past the threshold: (kind, pid, name, since,
        age in seconds, xmin_age, state, role, application_name), or None."""
        async with self.pool.connection() as conn:
            return await (await conn.execute(_XMIN_HOLDER)).fetchone()


def _poll_only_options(cfg: WorkerConfig) -> dict[str, Any]:
    """Connection options for the pool. --poll-only is for transaction poolers (PgBouncer
    pool_mode=transaction), which run each transaction on whatever server connection is free: a
    statement prepared on one is missing on the next ("prepared statement "_pg3_0" does not
    exist") or already there under another client's name ("already exists"). prepare_threshold
    None prepares nothing, whatever a call's prepare=True says: each call is parsed again."""
    return {"prepare_threshold": None} if cfg.poll_only else {}
