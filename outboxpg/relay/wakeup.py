"""How an idle worker is woken: a supervised LISTEN connection and the idle lock.

See migrations/0003_outbox_wakeup.sql for the protocol. In short: producers NOTIFY only while
some worker holds (or queues for) the wakeup lock, so an idle worker takes it, claims once more
(which sees everything committed by producers that skipped the NOTIFY), and then sleeps; when it
wakes it lets go, so that producers do not pay for NOTIFY while workers are draining anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg

from outboxpg import statements
from outboxpg.relay.backoff import DB_MAX_DELAY, next_delay
from outboxpg.text import first_line

__all__ = ["CONNECT_OPTIONS", "Listener", "IdleLock"]

log = logging.getLogger("outboxpg.worker")

# TCP keepalives: a connection whose peer vanished (network cut, host gone) is noticed within
# about 10 s even when no query is running on it.
CONNECT_OPTIONS: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 4, "keepalives_interval": 2,
                                   "keepalives_count": 3, "connect_timeout": 5}


class Listener:
    """LISTENs on channel 'outbox' (the one the insert trigger and the repair functions notify)
    and sets ``wake`` on every notification.

    Supervised: when the connection drops (server restart, killed backend, network cut) it
    reconnects with backoff, re-LISTENs, and sets ``wake`` so the worker claims at once: a
    notification sent while we were away is lost, the events are not.
    """

    def __init__(self, dsn: str, wake: asyncio.Event, application_name: str = "outboxpg-worker (listen)") -> None:
        self.dsn = dsn
        self.application_name = application_name
        self.wake = wake
        self.channel = statements.CHANNEL
        self.up = False
        self.reconnects = 0

    async def run(self) -> None:
        delay = 0.1
        first = True
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    self.dsn, autocommit=True, fallback_application_name=self.application_name, **CONNECT_OPTIONS)
            except psycopg.Error as exc:
                log.warning("event=listen_connect_failed error=%r retry_in=%.1fs", first_line(exc), delay)
                await asyncio.sleep(delay)
                delay = next_delay(delay, DB_MAX_DELAY)
                continue
            try:
                await conn.execute(statements.LISTEN)
                self.up = True
                delay = 0.1
                if not first:
                    self.reconnects += 1
                    log.info("event=listen_reconnected channel=%s", self.channel)
                first = False
                self.wake.set()
                async for _ in conn.notifies():
                    self.wake.set()
                raise psycopg.OperationalError("notification stream ended")
            except psycopg.Error as exc:
                self.up = False
                log.warning("event=listen_lost error=%r retry_in=%.1fs", first_line(exc), delay)
            finally:
                self.up = False
                with contextlib.suppress(Exception):
                    await conn.close()
            await asyncio.sleep(delay)
            delay = next_delay(delay, DB_MAX_DELAY)


class IdleLock:
    """The wakeup lock, held on a connection of its own while the worker sleeps."""

    def __init__(self, dsn: str, application_name: str = "outboxpg-worker (wakeup lock)") -> None:
        self.dsn = dsn
        self.application_name = application_name
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.held = False
        self.lost = asyncio.Event()
        self._watch_fd: int | None = None

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self.conn is None or self.conn.closed:
            conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, fallback_application_name=self.application_name, **CONNECT_OPTIONS)
            await conn.execute(statements.WAKEUP_LOCK_WAIT)
            self.conn = conn
        return self.conn

    async def acquire(self, wake: asyncio.Event, within: float | None = None) -> bool | None:
        """Queue for the lock; True once it is granted, False if ``wake`` was set first, None if
        it was not granted within a request (a second, the connection's lock_timeout) or within
        ``within`` seconds: claim once more, then queue again. From the moment we queue,
        producers NOTIFY.

        A request lasts a second: a statement that waits holds its snapshot, and a worker queued
        behind another idle one would hold the xmin horizon, VACUUM of the whole database, for as
        long as the fleet stays idle. And the worker claims after each one, granted or not:
        producers that wrote while no worker was idle skipped their NOTIFY, and the request waits
        for them; while one of them stays open (a long transaction) the lock is never granted,
        and what the others commit meanwhile is seen by the claim after the request that ran out,
        not by a claim after a grant that does not come."""
        conn = await self._connection()
        request = asyncio.ensure_future(conn.execute(statements.WORKER_IDLE))
        woken = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait({request, woken}, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        if not request.done():
            with contextlib.suppress(Exception):
                await conn.cancel_safe(timeout=5)
        try:
            await request
        except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable):
            return False if wake.is_set() else None
        # Granted (also just before a cancel arrived: we hold it after all).
        self.held = True
        self.lost.clear()
        self._watch_connection(conn)
        return True

    def _watch_connection(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """While the lock is held the connection runs no query and nothing should arrive on it:
        whatever makes its socket readable (the server's goodbye after pg_terminate_backend, a
        restart, EOF) means the lock may be gone. Watched on the socket itself, so that it does
        not depend on a notification loop noticing: then the worker takes the lock again."""
        loop = asyncio.get_running_loop()
        fd = conn.fileno()

        def readable() -> None:
            self._unwatch()
            self.held = False
            self.lost.set()

        loop.add_reader(fd, readable)
        self._watch_fd = fd

    def _unwatch(self) -> None:
        if self._watch_fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._watch_fd)
            self._watch_fd = None

    async def release(self) -> None:
        """Let go of the lock (producers stop notifying)."""
        was_held, self.held = self.held, False
        self._unwatch()
        if not was_held:
            return
        conn = self.conn
        try:
            if conn is not None and not conn.closed:
                await conn.execute(statements.WORKER_BUSY)
        except psycopg.Error:
            # The connection is gone, and the session lock with it.
            await self.close()

    async def close(self) -> None:
        self._unwatch()
        self.held = False
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()
            self.conn = None
