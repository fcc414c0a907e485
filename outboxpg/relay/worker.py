"""The relay: claim events, publish them, report back. Thin on purpose: every decision about
an event (order, retries, dead letters, fencing) is made by the SQL functions it calls.

    worker = Worker(WorkerConfig(dsn="..."), publisher=NatsPublisher("nats://127.0.0.1:4222"))
    await worker.run()          # until worker.stop()

Loop: drain (claim after claim until one comes back short; each batch is published and
completed/failed by a task of its own, up to ``concurrency`` batches in flight). After a short
claim with batches in flight, wait for the first of them to be reported (its report makes the
next runs of its aggregates claimable) and drain again; with none in flight, go idle (take the
wakeup lock, claim once more, sleep) until a notification, the next retry or lease expiry
(outbox_next_wakeup), or the fallback poll.

A claimed batch holds runs: up to ``outbox_settings.max_run`` consecutive events of one aggregate,
in id order, under one lease. A batch still being published a third of the lease after it
started has its lease extended (outbox_extend), every third of the lease until it is reported:
a slow but working publisher never loses its leases to another worker (which would publish the
same events again); a lease ends only when its worker stops extending it (died, hung, or cut off
from the database for the rest of the lease). The publisher keeps each run in order (see publishers.py); the
report reads the outcomes run by run (``split_runs``): the events before a run's first failure
are completed, the failure is failed, the rest are released (not an attempt). Nothing failed:
one outbox_complete statement, as before runs existed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from psycopg.adapt import Buffer, Loader
from psycopg_pool import AsyncConnectionPool

from outboxpg.errors import PermanentError, describe, first_line
from outboxpg.events import CLAIM_COLUMNS, OutboxEvent, event_from_row, runs_of
from outboxpg.relay.backoff import next_delay
from outboxpg.relay.config import WorkerConfig
from outboxpg.relay.metrics import WorkerMetrics
from outboxpg.relay.publishers import as_publisher
from outboxpg.relay.wakeup import CONNECT_OPTIONS, IdleLock, Listener

__all__ = ["Worker", "WorkerConfig", "WorkerStats", "application_name", "split_runs"]

log = logging.getLogger("outboxpg.worker")

_CLAIM = f"SELECT {CLAIM_COLUMNS} FROM outbox_claim(%s, %s, %s)"
_COMPLETE = "SELECT outbox_complete(%s::bigint[], %s)"
_FAIL = "SELECT outbox_fail(%s, %s, %s, %s)"
_RELEASE = "SELECT outbox_release(%s::bigint[], %s)"
_EXTEND = "SELECT outbox_extend(%s::bigint[], %s, %s)"
_NO_TIME = timedelta(0)
_DIGITS = re.compile(r"[0-9]+")   # "no ack for event 17" and "... 18" are one reason
_MAX_REASONS = 1000
_SUMMARY_REASONS = 10
_SLEEP_FOR = "SELECT extract(epoch FROM outbox_next_wakeup() - clock_timestamp())::float8"


class RawJsonLoader(Loader):
    """Load json/jsonb as the bytes PostgreSQL sent: the worker forwards payloads, it never
    needs to parse them."""

    def load(self, data: Buffer) -> bytes:
        return bytes(data)


@dataclass
class WorkerStats:
    delivered: int = 0
    failed: int = 0
    dead: int = 0
    lost_leases: int = 0
    released: int = 0
    claims: int = 0
    extensions: int = 0     # outbox_extend calls for batches still being published
    lag_sum: float = 0.0
    lag_max: float = 0.0
    lag_count: int = 0
    last_claim_at: float | None = None


class Worker:
    def __init__(self, config: WorkerConfig, publisher: Any, metrics: WorkerMetrics | None = None) -> None:
        config.validate()
        self.cfg = config
        self.metrics = metrics
        self.publisher = as_publisher(publisher)
        # Optional: an asyncio.Event the publisher sets while it can publish (NatsPublisher.ready).
        self._publisher_ready: asyncio.Event | None = getattr(self.publisher, "ready", None)
        self.stats = WorkerStats()
        self._wake = asyncio.Event()
        self._stopping = False
        self._stop = asyncio.Event()
        self._lease = timedelta(seconds=config.lease)
        # A batch still being published after this long gets its leases extended, and again
        # every this long: two tries fit into a lease before it can end.
        self._extend_every = config.lease / 3
        self._db_delay = 0.0
        self._inflight: set[asyncio.Task[None]] = set()
        # Batches reported so far, and as the last claim started: a report that lands while a
        # claim runs may free runs that claim did not see.
        self._reported = 0
        self._reported_at_claim = 0
        self._releasing: asyncio.Future[None] | None = None
        # Failed publishes by reason (the error's first line, digits masked): the first of each
        # reason is logged at WARNING, the others are counted and summarised every
        # summary_interval, so that an outage does not write a line per event and attempt.
        self._reasons_seen: set[str] = set()
        self._failures: dict[str, list[Any]] = {}   # reason -> [failures since the last summary, example]
        self.pool: AsyncConnectionPool | None = None
        # What a DBA sees in pg_stat_activity.application_name for each connection (unless the
        # DSN or $PGAPPNAME names one: libpq's fallback_application_name gives way to those).
        self.application_name = application_name(config.name)
        self.listener = Listener(config.dsn, self._wake, application_name=f"{self.application_name} (listen)")
        self.idle_lock = IdleLock(config.dsn, application_name=f"{self.application_name} (wakeup lock)")

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; in-flight batches are finished and reported, then run() returns."""
        if not self._stopping:
            log.info("event=shutdown_requested worker=%s", self.cfg.name)
        self._stopping = True
        self._stop.set()
        self._wake.set()

    async def run(self) -> None:
        cfg = self.cfg
        self.pool = AsyncConnectionPool(
            cfg.dsn, min_size=1, max_size=cfg.concurrency + 2, open=False, timeout=10,
            kwargs={"autocommit": True, "fallback_application_name": self.application_name, **CONNECT_OPTIONS,
                    **_poll_only_options(cfg)},
            configure=self._configure,
            name="outboxpg-worker")
        await self.pool.open(wait=False)
        background: list[asyncio.Task[None]] = []
        if not cfg.poll_only:
            background.append(asyncio.create_task(self.listener.run(), name="outboxpg-listener"))
        background.append(asyncio.create_task(self._summaries(), name="outboxpg-summary"))
        if cfg.maintenance_interval > 0:
            background.append(asyncio.create_task(self._maintenance(), name="outboxpg-maintenance"))
        if self.metrics is not None:
            self.metrics.listener_up.set_function(lambda: 1.0 if self.listener.up else 0.0)
        try:
            if hasattr(self.publisher, "start"):
                await self.publisher.start()
            log.info("event=start worker=%s batch_size=%d concurrency=%d lease=%gs poll_interval=%gs "
                     "poll_only=%s publish_timeout=%gs run_publishing=%s", cfg.name, cfg.batch_size, cfg.concurrency,
                     cfg.lease, cfg.poll_interval, cfg.poll_only, cfg.publish_timeout,
                     getattr(self.publisher, "run_publishing", "publisher-defined"))
            await self._loop()
        finally:
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self.idle_lock.close()
            if hasattr(self.publisher, "close"):
                with contextlib.suppress(Exception):
                    await self.publisher.close()
            await self.pool.close()
            self._log_summary(final=True)
            log.info("event=stopped worker=%s", cfg.name)

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        conn.adapters.register_loader("jsonb", RawJsonLoader)
        conn.adapters.register_loader("json", RawJsonLoader)
        if not self.cfg.poll_only:
            # Claims and reports commit without waiting for the WAL flush (about 2 ms a commit on
            # this kind of disk, on every event's path). What a server crash can lose is a lease
            # or a "published" mark, never an event: the event is then published again with the
            # same msg_id, and JetStream drops the duplicate. Not done in --poll-only mode, where
            # a pooler in transaction mode would carry a session SET over to other clients.
            await conn.execute("SET synchronous_commit = off")

    # -- the loop ------------------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while not self._stopping:
                claimed = await self._drain()
                if self._stopping:
                    break
                if claimed and self.idle_lock.held:
                    self._release_lock_soon()   # busy: producers need not notify
                if self._reported != self._reported_at_claim:
                    continue    # a batch was reported while the last claim ran: look again
                if self._inflight:
                    # The last claim came back short: everything claimable now is claimed. Never
                    # sleep with batches in flight: each report makes the next run of its
                    # aggregates claimable, and no NOTIFY announces that. Claim again as soon
                    # as the first of them is reported (not the last: one slow batch must not
                    # hold back the aggregates the others free), not before (nothing new would
                    # be claimable: claiming in a loop would only walk the backlog for nothing).
                    await self._first_reported()
                    continue
                if claimed:
                    continue    # its batch is reported already: claim what that made claimable
                await self._lock_released()
                if self.cfg.poll_only:
                    await self._sleep(await self._sleep_seconds())
                    continue
                if not self.idle_lock.held:
                    try:
                        await self.idle_lock.acquire(self._wake)
                    except psycopg.Error as exc:
                        log.warning("event=idle_lock_failed error=%r", first_line(exc))
                        await self.idle_lock.close()
                        await self._db_backoff()
                    # Granted: producers that skipped NOTIFY have all committed; the next drain
                    # sees their events. Not granted: a notification came first. Either way: drain.
                    continue
                why = await self._sleep(await self._sleep_seconds())
                if why == "wake" and not self._stopping:
                    self._release_lock_soon()       # in parallel with the claim that follows
        finally:
            # Finish and report every batch already claimed before returning.
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)
            await self._lock_released()

    async def _first_reported(self) -> None:
        """Until one in-flight batch is reported, or a wake-up (a notification, stop())."""
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({*self._inflight, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()

    def _release_lock_soon(self) -> None:
        if self._releasing is None or self._releasing.done():
            self._releasing = asyncio.ensure_future(self.idle_lock.release())

    async def _lock_released(self) -> None:
        if self._releasing is not None:
            with contextlib.suppress(Exception):
                await self._releasing
            self._releasing = None

    async def _sleep(self, seconds: float) -> str:
        """Sleep until a notification, the lock's connection dying, or ``seconds``."""
        if self._wake.is_set():
            return "wake"
        # The lock can be lost at any moment, also just before this sleep (the lost event stays
        # set until the lock is taken again): always watch it, never only "if still held".
        if self.idle_lock.lost.is_set() and not self.cfg.poll_only:
            log.warning("event=idle_lock_lost worker=%s", self.cfg.name)
            return "lost"
        waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self.idle_lock.lost.wait())]
        try:
            done, _ = await asyncio.wait(waits, timeout=max(seconds, 0.0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not done:
            return "timer"
        if self._wake.is_set():
            return "wake"
        log.warning("event=idle_lock_lost worker=%s", self.cfg.name)
        return "lost"

    async def _sleep_seconds(self) -> float:
        """Until the next retry or lease expiry, at most the poll interval."""
        assert self.pool is not None
        try:
            async with self.pool.connection() as conn:
                row = await (await conn.execute(_SLEEP_FOR)).fetchone()
        except psycopg.Error as exc:
            log.warning("event=db_error during=next_wakeup error=%r", first_line(exc))
            return min(self.cfg.poll_interval, 5.0)
        seconds = row[0] if row else None
        if seconds is None:
            return self.cfg.poll_interval
        return min(self.cfg.poll_interval, max(seconds, 0.0) + 0.005)

    async def _drain(self) -> int:
        """Claim until a claim comes back short; returns how many events were claimed.

        Claims follow each other at once: each batch is published and reported by a task of its
        own, so the next claim overlaps the previous batch's publishing. At most ``concurrency``
        batches are in flight.
        """
        self._wake.clear()
        total = 0
        while not self._stopping:
            while len(self._inflight) >= self.cfg.concurrency:
                await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
            if self._publisher_ready is not None and not self._publisher_ready.is_set():
                # The publisher cannot publish right now (NatsPublisher: its client was closed
                # for good and is being replaced): claiming would only spend attempts.
                if not await self._until_publisher_ready():
                    break
            self._reported_at_claim = self._reported
            rows = await self._claim()
            total += len(rows)
            if rows:
                task = asyncio.create_task(self._deliver(rows))
                self._inflight.add(task)
                task.add_done_callback(self._inflight.discard)
            if len(rows) < self.cfg.batch_size:
                break
        return total

    async def _until_publisher_ready(self) -> bool:
        """Wait until the publisher is ready again (True) or stop() (False)."""
        ready = self._publisher_ready
        assert ready is not None
        log.warning("event=publisher_not_ready worker=%s note=%r", self.cfg.name, "not claiming until it is")
        waits = [asyncio.ensure_future(ready.wait()), asyncio.ensure_future(self._stop.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if ready.is_set():
            log.info("event=publisher_ready worker=%s", self.cfg.name)
        return ready.is_set() and not self._stopping

    async def _claim(self) -> list[tuple[Any, ...]]:
        assert self.pool is not None
        try:
            async with self.pool.connection() as conn:
                cur = await conn.execute(_CLAIM, (self.cfg.batch_size, self._lease, self.cfg.name), prepare=True)
                rows = await cur.fetchall()
        except psycopg.Error as exc:
            log.warning("event=db_error during=claim error=%r", first_line(exc))
            await self._db_backoff()
            return []
        self._db_delay = 0.0
        self.stats.claims += 1
        if rows:
            self.stats.last_claim_at = time.time()
            if self.metrics is not None:
                self.metrics.claim_size.observe(len(rows))
                self.metrics.last_claim.set(self.stats.last_claim_at)
        return rows

    async def _deliver(self, rows: list[tuple[Any, ...]]) -> None:
        token = rows[0][10]
        events = [event_from_row(row) for row in rows]
        started = time.monotonic()
        # Most batches are reported long before this fires: then it costs a timer, nothing more.
        keeper: list[asyncio.Task[None]] = []
        published = asyncio.Event()
        timer = asyncio.get_running_loop().call_later(
            self._extend_every, lambda: keeper.append(asyncio.ensure_future(self._keep_leases(events, token,
                                                                                               published))))
        try:
            outcomes: Sequence[BaseException | None] = await self.publisher.publish_batch(events)
        except Exception as exc:  # noqa: BLE001 - a publisher that raises fails the whole batch
            outcomes = [exc] * len(events)
        finally:
            timer.cancel()
            if keeper:
                # Let an extension in progress finish (a statement cancelled half way would cost
                # the pool its connection), then report: the lease has at least two thirds left.
                published.set()
                with contextlib.suppress(Exception):
                    await keeper[0]
        if self.metrics is not None:
            self.metrics.publish_seconds.observe(time.monotonic() - started)
        try:
            await self._report(events, outcomes, token)
        except Exception as exc:  # noqa: BLE001 - never lose the worker over one batch
            log.error("event=report_crashed error=%r", exc)
        finally:
            self._reported += 1

    async def _keep_leases(self, events: Sequence[OutboxEvent], token: Any, published: asyncio.Event) -> None:
        """Extend the batch's leases now and every third of the lease, until ``published`` is set.

        Fenced by the token like every report: events whose run another worker took back (this
        worker was cut off, or frozen, past a lease) are not extended; that is logged, and the
        report later counts them as lost leases."""
        assert self.pool is not None
        ids = "{" + ",".join(str(e.id) for e in events) + "}"
        held = len(events)
        while not published.is_set():
            wait = self._extend_every
            try:
                async with self.pool.connection() as conn:
                    cur = await conn.execute(_EXTEND, (ids, token, self._lease))   # rare: not prepared
                    extended = (await cur.fetchone())[0]  # type: ignore[index]
            except Exception as exc:  # noqa: BLE001 - psycopg or pool errors: try again sooner
                log.warning("event=db_error during=extend error=%r", first_line(exc))
                wait = min(wait / 2, 1.0)
            else:
                self.stats.extensions += 1
                log.debug("event=lease_extended worker=%s events=%d", self.cfg.name, extended)
                if extended < held:
                    log.warning("event=lease_lost worker=%s events=%d note=%r", self.cfg.name, held - extended,
                                "taken over while still being published (this worker was cut off or frozen "
                                "past the lease); the new holder publishes them again (same msg_id)")
                    held = extended
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(published.wait(), wait)

    async def _report(self, events: Sequence[OutboxEvent], outcomes: Sequence[BaseException | None],
                      token: Any) -> None:
        assert self.pool is not None
        acked_at = datetime.now(timezone.utc)
        released: list[int] = []
        delivered: Sequence[OutboxEvent]
        if any(o is not None for o in outcomes):
            delivered, failed, released = split_runs(events, outcomes)
            ok = [e.id for e in delivered]
        else:
            delivered, failed = events, []
            ok = [e.id for e in events]
        # The ids as one bigint[] literal, joined in C: psycopg's list dumper would visit each
        # element in Python, for the same text on the wire.
        ok_ids = "{" + ",".join(map(str, ok)) + "}"
        states: list[str] = []
        handed_back = 0
        attempts = 5
        delay = 0.0
        for attempt in range(attempts):
            try:
                async with self.pool.connection() as conn:
                    if not failed:
                        # The usual case: one statement, no pipeline to set up.
                        cur = await conn.execute(_COMPLETE, (ok_ids, token), prepare=True)
                        completed = (await cur.fetchone())[0]  # type: ignore[index]
                        break
                    # Any order is fine for the SQL: each call touches only its own ids.
                    async with conn.pipeline():
                        done_cur = await conn.execute(_COMPLETE, (ok_ids, token), prepare=True) if ok else None
                        fail_curs = [await conn.execute(_FAIL, (e.id, token, describe(o, whole=True),
                                                                isinstance(o, PermanentError)), prepare=True)
                                     for e, o in failed]
                        release_cur = (await conn.execute(_RELEASE, ("{" + ",".join(map(str, released)) + "}", token),
                                                          prepare=True) if released else None)
                    completed = (await done_cur.fetchone())[0] if done_cur else 0  # type: ignore[index]
                    states = [(await c.fetchone())[0] for c in fail_curs]  # type: ignore[index]
                    handed_back = (await release_cur.fetchone())[0] if release_cur else 0  # type: ignore[index]
                break
            except psycopg.Error as exc:
                log.warning("event=db_error during=report attempt=%d error=%r", attempt + 1, first_line(exc))
                if attempt == attempts - 1:
                    log.error("event=report_failed events=%d note=%r", len(events),
                              "leases will expire and the events be retried (deduplicated by msg_id)")
                    return
                # Other pooled connections may be dead too (a server restart, killed backends):
                # have the pool check its idle ones before the next try. 0.1 + 0.2 + 0.4 + 0.8 s
                # stays well inside the lease, which is at least twice the publish timeout.
                with contextlib.suppress(Exception):
                    await self.pool.check()
                delay = next_delay(delay)
                await asyncio.sleep(delay)
        st = self.stats
        st.delivered += completed
        st.released += handed_back
        if handed_back < len(released):
            st.lost_leases += len(released) - handed_back
            log.warning("event=lease_lost worker=%s events=%d note=%r", self.cfg.name, len(released) - handed_back,
                        "not released: the lease had expired and was taken over")
        if completed < len(ok):
            st.lost_leases += len(ok) - completed
            log.warning("event=lease_lost worker=%s events=%d note=%r", self.cfg.name, len(ok) - completed,
                        "published after the lease expired and was taken over; the new holder republishes "
                        "(same msg_id)")
        m = self.metrics
        if events:
            created = [e.created_at for e in events]
            # Summed as timedeltas by map()/sum() in C, not one Python step per event.
            st.lag_sum += sum(map(acked_at.__sub__, created), _NO_TIME).total_seconds()
            st.lag_count += len(created)
            st.lag_max = max(st.lag_max, (acked_at - min(created)).total_seconds())
            if m is not None:
                for c in created:
                    m.lag_seconds.observe((acked_at - c).total_seconds())
        if m is not None:
            # Which reports were refused for a lost lease is not known one by one: count the
            # first `completed` delivered events by type (exact whenever no lease was lost).
            for e in delivered[:completed]:
                m.delivered.labels(e.event_type).inc()
            if completed < len(ok):
                m.lost_leases.inc(len(ok) - completed)
        for (event, outcome), state in zip(failed, states):
            if m is not None and state in ("dead", "pending"):
                (m.dead if state == "dead" else m.failed).labels(event.event_type).inc()
            if state == "dead":
                st.dead += 1
                log.warning("event=dead_letter id=%d aggregate=%s/%s event_type=%s attempt=%d error=%r",
                            event.id, event.aggregate_type, event.aggregate_id, event.event_type, event.attempt,
                            describe(outcome, whole=True))
            elif state == "pending":
                st.failed += 1
                self._note_failure(event, outcome)
            else:
                st.lost_leases += 1
                log.warning("event=lease_lost worker=%s id=%d note=%r", self.cfg.name, event.id,
                            "failure not recorded: the lease had expired and was taken over")

    def _note_failure(self, event: OutboxEvent, outcome: BaseException) -> None:
        text = describe(outcome, whole=True).strip()
        text = (text.splitlines()[0] if text else "")[:300]
        reason = _DIGITS.sub("N", text)
        entry = self._failures.setdefault(reason, [0, text])
        entry[0] += 1
        if reason in self._reasons_seen:
            log.debug("event=publish_failed id=%d attempt=%d error=%r", event.id, event.attempt, text)
            return
        if len(self._reasons_seen) >= _MAX_REASONS:   # bounded: reasons with ever new words in them
            self._reasons_seen.clear()
        self._reasons_seen.add(reason)
        log.warning("event=publish_failed id=%d aggregate=%s/%s event_type=%s attempt=%d error=%r note=%r",
                    event.id, event.aggregate_type, event.aggregate_id, event.event_type, event.attempt, text,
                    f"first failure with this reason: it is retried; further ones are counted and logged as "
                    f"publish_failures every {self.cfg.summary_interval:g}s")

    def _log_failures(self) -> None:
        """One WARNING per reason that failed publishes since the last summary (the most
        frequent first), and one for the rest."""
        if not self._failures:
            return
        ranked = sorted(self._failures.values(), key=lambda e: -e[0])
        for count, example in ranked[:_SUMMARY_REASONS]:
            log.warning("event=publish_failures failures=%d interval=%gs error=%r", count,
                        self.cfg.summary_interval, example)
        rest = ranked[_SUMMARY_REASONS:]
        if rest:
            log.warning("event=publish_failures failures=%d interval=%gs other_reasons=%d", sum(e[0] for e in rest),
                        self.cfg.summary_interval, len(rest))
        self._failures = {}

    async def _db_backoff(self) -> None:
        self._db_delay = next_delay(self._db_delay)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self._db_delay)   # cut short by stop()

    # -- maintenance ---------------------------------------------------------------------

    async def _maintenance(self) -> None:
        """outbox_maintain() now and every maintenance_interval. A failure is logged and the
        next run tries again; delivery never depends on it (inserts fall back to the default
        partition)."""
        assert self.pool is not None
        while True:
            try:
                async with self.pool.connection() as conn:
                    rows = await (await conn.execute(
                        "SELECT action, partition, detail FROM outbox_maintain()")).fetchall()
                for action, partition, detail in rows:
                    if action == "skip" and partition is None:
                        log.debug("event=maintenance_skipped reason=%r", detail)
                    else:
                        log.info("event=maintenance action=%s partition=%s detail=%r", action, partition, detail)
            except psycopg.Error as exc:
                log.warning("event=maintenance_failed error=%r retry_in=%gs", first_line(exc),
                            self.cfg.maintenance_interval)
                if self.metrics is not None:
                    self.metrics.maintenance_failures.inc()
            await asyncio.sleep(self.cfg.maintenance_interval)

    # -- reporting -----------------------------------------------------------------------

    async def _summaries(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.summary_interval)
            self._log_summary()

    def _log_summary(self, final: bool = False) -> None:
        self._log_failures()
        st = self.stats
        avg = st.lag_sum / st.lag_count if st.lag_count else 0.0
        log.info("event=%s worker=%s delivered=%d failed=%d dead=%d released=%d lost_leases=%d lag_avg_ms=%.1f "
                 "lag_max_ms=%.1f listener_up=%s", "final_summary" if final else "summary", self.cfg.name, st.delivered,
                 st.failed, st.dead, st.released, st.lost_leases, avg * 1000, st.lag_max * 1000, self.listener.up)
        st.lag_sum, st.lag_count, st.lag_max = 0.0, 0, 0.0


def application_name(worker_name: str) -> str:
    """'outboxpg-worker <name>' (PostgreSQL keeps the first 63 bytes of an application_name)."""
    return f"outboxpg-worker {worker_name}"


def split_runs(events: Sequence[OutboxEvent], outcomes: Sequence[BaseException | None]
               ) -> tuple[list[OutboxEvent], list[tuple[OutboxEvent, BaseException]], list[int]]:
    """Read a batch's outcomes run by run: (delivered, failed, released ids).

    In each run (one aggregate's events, in id order) the events before the first failure are
    delivered, the first failure is failed, and every event after it is released, whatever its
    outcome says: it may not count as published while an earlier event of its aggregate is not
    (the stream would hold them out of order), so it is handed out again after the failed one.
    """
    delivered: list[OutboxEvent] = []
    failed: list[tuple[OutboxEvent, BaseException]] = []
    released: list[int] = []
    for run in runs_of(events):
        for n, i in enumerate(run):
            outcome = outcomes[i]
            if outcome is None:
                delivered.append(events[i])
                continue
            failed.append((events[i], outcome))
            released.extend(events[j].id for j in run[n + 1:])
            break
    return delivered, failed, released


def _poll_only_options(cfg: WorkerConfig) -> dict[str, Any]:
    """Connection options for the pool. --poll-only is for transaction poolers (PgBouncer
    pool_mode=transaction), which run each transaction on whatever server connection is free: a
    statement prepared on one is missing on the next ("prepared statement "_pg3_0" does not
    exist") or already there under another client's name ("already exists"). prepare_threshold
    None prepares nothing, whatever a call's prepare=True says: each call is parsed again."""
    return {"prepare_threshold": None} if cfg.poll_only else {}
