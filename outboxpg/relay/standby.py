"""--standby-flushed: publish an event only once a standby has flushed its commit.

With asynchronous replication a primary acknowledges commits its standbys have not received
yet. If it is lost and a standby promoted, those commits never happened; a worker that had
published their events already leaves consumers holding events of transactions that do not
exist (and, the sequence being behind, the new primary hands their ids out again). With this
option each claimed batch waits, before anything of it is published, until a standby's
``pg_stat_replication.flush_lsn`` reaches the point where the WAL ended as the claim ran (see
gateway._CLAIM_WITH_LSN): then every event of the batch is on that standby's disk and survives
its promotion. What it costs: the standby's round trip and flush, on every batch (bench/standby_flush.py).

One poller serves every batch waiting: while any waits, it reads pg_stat_replication every
``POLL_INTERVAL`` and wakes the batches whose point the standby has passed. A batch that waits
longer than its bound (the publish timeout) is handed back unpublished and claimed again later:
nothing is published while no standby keeps up, and the log says why, once per episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from outboxpg.relay.backoff import DB_MAX_DELAY, next_delay
from outboxpg.relay.gateway import Gateway
from outboxpg.text import first_line

__all__ = ["POLL_INTERVAL", "StandbyFlush"]

log = logging.getLogger("outboxpg.worker")

POLL_INTERVAL = 0.002   # seconds between two reads of pg_stat_replication while a batch waits


class StandbyFlush:
    """Waits until the standby (``standby``: 'any' or an application_name) has flushed an LSN."""

    def __init__(self, gateway: Gateway, standby: str) -> None:
        self.gateway = gateway
        self.standby = standby
        self.flushed = 0                  # the furthest flush_lsn seen (as a number)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._poller: asyncio.Task[None] | None = None
        self._stalled_since: float | None = None   # when a wait started finding no standby ahead

    async def wait(self, lsn: int, timeout: float) -> bool:
        """True once the standby has flushed ``lsn``; False after ``timeout`` seconds."""
        if self.flushed >= lsn:
            return True
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (lsn, waiter)
        self._waiters.append(entry)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(), name="outboxpg-standby-flush")
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller

    async def _poll(self) -> None:
        delay = 0.0
        while self._waiters:
            try:
                connected, readable, flushed = await self.gateway.standby_flush(self.standby)
            except Exception as exc:  # noqa: BLE001 - psycopg or pool errors: back off as the claims do
                delay = next_delay(delay, DB_MAX_DELAY)
                log.warning("event=db_error during=standby_flush error=%r retry_in=%.1fs", first_line(exc), delay)
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            if flushed is not None and flushed > self.flushed:
                self.flushed = flushed
            waiting = released = 0
            for lsn, waiter in self._waiters:
                if lsn > self.flushed:
                    waiting += 1
                elif not waiter.done():
                    waiter.set_result(None)
                    released += 1
            self._note(waiting, released, connected, readable)
            await asyncio.sleep(POLL_INTERVAL)

    def _note(self, waiting: int, released: int, connected: int, readable: int) -> None:
        """Log once when batches start waiting on no standby (or on none that can be read), and
        once when a standby's flush releases batches again."""
        now = time.monotonic()
        if waiting and (connected == 0 or readable == 0):
            if self._stalled_since is None:
                self._stalled_since = now
                which = "no standby" if self.standby == "any" else f"standby {self.standby!r} not"
                if connected == 0:
                    note = (f"{which} connected (pg_stat_replication): publishing nothing until one has "
                            "flushed the claimed events")
                else:
                    note = ("cannot read pg_stat_replication.flush_lsn: GRANT pg_read_all_stats to the "
                            "worker's role; publishing nothing meanwhile")
                log.warning("event=standby_flush_waiting standby=%s connected=%d note=%r", self.standby,
                            connected, note)
        elif self._stalled_since is not None and released:
            log.info("event=standby_flush_resumed standby=%s waited=%.1fs", self.standby, now - self._stalled_since)
            self._stalled_since = None
