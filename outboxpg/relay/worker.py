"""The relay: claim events, publish them, report back. Thin on purpose: every decision about
an event (order, retries, dead letters, fencing) is made by the SQL functions it calls.

    worker = Worker(WorkerConfig(dsn="..."), publisher=NatsPublisher("nats://127.0.0.1:4222"))
    await worker.run()          # until worker.stop()

Loop: drain (claim after claim until one comes back short; each batch is published and
completed/failed by a task of its own, up to ``concurrency`` batches in flight). With all of them
out, every 10 to 50 ms claim the quiet aggregates' events beside them (the lane: LANE_BATCH).
After a short claim with batches in flight, wait for the first of them to be reported (its
report makes the next runs of its aggregates claimable), or 10 to 50 ms for new events, and
drain again; with none in flight, go idle (take the wakeup lock, claim once more, sleep) until a
notification, the next retry or lease expiry (outbox_next_wakeup), or the fallback poll.

A claimed batch holds runs: up to ``outbox_settings.max_run`` consecutive events of one aggregate,
in id order, under one lease. A batch still being published a third of the lease after it
started has its lease extended (outbox_extend), every third of the lease until it is reported:
a slow but working publisher never loses its leases to another worker (which would publish the
same events again); a lease ends only when its worker stops extending it (died, hung, or cut off
from the database for the rest of the lease). The publisher keeps each run in order (see
publishers.py); the report reads the outcomes run by run (``split_runs``): the events before a
run's first failure are completed, the failure is failed, the rest are released (not an
attempt). Nothing failed: one outbox_complete statement, as before runs existed.

Around it: gateway.py sends the SQL, stats.py counts and logs what happened (and feeds the
metrics), maintenance.py runs outbox_maintain() on a schedule, horizon.py names what holds back
the xmin horizon (VACUUM), wakeup.py holds the LISTEN connection and the wakeup lock, standby.py
holds each batch back until a standby has flushed it (--standby-flushed). Every reconnect to
PostgreSQL is at most backoff.DB_MAX_DELAY after the last (claims, LISTEN, the pool's
replacements): after a failover to a standby (a multi-host DSN with
target_session_attrs=read-write) delivery resumes within about that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from outboxpg.events import LEASE_TOKEN, OutboxEvent, event_from_row, runs_of
from outboxpg.relay.backoff import DB_MAX_DELAY, next_delay
from outboxpg.relay.config import WorkerConfig
from outboxpg.relay.gateway import Gateway, connection_lost, id_array, lsn_value
from outboxpg.relay.health import PROBE_TIMEOUT
from outboxpg.relay.horizon import watch_xmin_every
from outboxpg.relay.maintenance import maintain_every
from outboxpg.relay.metrics import WorkerMetrics
from outboxpg.relay.publishers import PermanentError, as_publisher, retry_after
from outboxpg.relay.shard_group import ShardGroup
from outboxpg.relay.slots import FairSlots
from outboxpg.relay.standby import StandbyFlush
from outboxpg.relay.stats import Recorder
from outboxpg.relay.tasks import cancel_all, say_where_after
from outboxpg.relay.wakeup import IdleLock, Listener
from outboxpg.text import describe, first_line

# WorkerConfig is declared in relay/config.py (gateway.py reads it too); its import path is this module.
__all__ = ["Worker", "WorkerConfig", "application_name", "split_runs"]

log = logging.getLogger("outboxpg.worker")

# With batches in flight and a slot free after a short claim, the worker claims again this soon
# even if none of them is reported: no NOTIFY comes while it is busy, and a quiet aggregate's new
# event is handed out by the next claim whatever backlog the others have (outbox_take_in). The
# wait doubles after each such claim that found nothing, up to the most; one that found
# something brings it back to the least. A claim that finds nothing costs the database an index
# look and the intake's chunk: at most 100 of them a second, 20 once nothing new comes.
LOOK_AGAIN_LEAST = 0.010
LOOK_AGAIN_MOST = 0.050

# The lane. With every one of the ``concurrency`` batches out (a backlog of busy aggregates fills
# them, each with a long run), the next claim waits for one of them to come back: a whole
# publish of a batch. So meanwhile the worker claims, on the same schedule as _look_again,
# the quiet aggregates at the front of the queue only (outbox_claim's quiet_only), at most
# LANE_BATCH events, one such batch out at a time: a quiet aggregate's event is published
# beside the backlog, not behind it. A lane claim that finds nothing costs an index look at the
# front and the intake's chunk, which the next full claim would otherwise read.
LANE_BATCH = 100

# A batch that holds both short runs (at most this many events: a quiet aggregate's share of a
# claim, outbox_claim) and long ones (a busy aggregate's) is published and reported in two
# parts side by side: the short runs' report does not wait for the long runs' publish. Until a
# run is reported its aggregate's head stays leased, so a quiet aggregate's next event would
# otherwise wait for a busy aggregate's thousand.
SHORT_RUN = 10

# The first summary comes this long after the first delivery, when that is sooner than
# summary_interval: a newcomer sees the counts move within seconds, not a minute.
EARLY_SUMMARY = 5.0
# A shutdown still under way after this long logs where every task waits (event=shutdown_slow):
# in-flight batches take up to a lease to finish; anything longer is worth a line.
SAY_SLOW_STOP_AFTER = 10.0


class Worker:
    """``slots``: the events being published at once across the databases of one process
    (outboxpg.relay.fleet), handed out in turn. ``owns_publisher``: run() starts and
    closes the publisher; False where several workers share it (the fleet does that)."""

    def __init__(self, config: WorkerConfig, publisher: Any, metrics: WorkerMetrics | None = None, *,
                 slots: FairSlots | None = None, owns_publisher: bool = True) -> None:
        config.validate()
        self.cfg = config
        self.slots = slots
        self.owns_publisher = owns_publisher
        self.metrics = metrics
        # /healthz and /readyz (served with the metrics): the loop's heartbeat, PostgreSQL, the publisher.
        self.health = metrics.health if metrics is not None else None
        self.publisher = as_publisher(publisher)
        # Optional: an asyncio.Event the publisher sets while it can publish (NatsPublisher.ready).
        self._publisher_ready: asyncio.Event | None = getattr(self.publisher, "ready", None)
        self.recorder = Recorder(config.name, config.summary_interval, metrics)
        self.stats = self.recorder.stats
        self._wake = asyncio.Event()
        self._stopping = False
        self._slow_stop: asyncio.Task[None] | None = None
        self._until_idle = False
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
        self._look_again = LOOK_AGAIN_LEAST
        self._looked_again = False    # the last drain started because _look_again ran out
        self._handing_back = 0        # batches in their pause after _hand_back: no looking again
        self._lane: asyncio.Task[None] | None = None     # the lane's batch out, if any
        self._lane_wait = LOOK_AGAIN_LEAST
        # What a DBA sees in pg_stat_activity.application_name for each connection (unless the
        # DSN or $PGAPPNAME names one: libpq's fallback_application_name gives way to those).
        self.application_name = application_name(config.name)
        self.gateway = Gateway(config, self.application_name)
        self.listener = Listener(config.dsn, self._wake, application_name=f"{self.application_name} (listen)")
        self.idle_lock = IdleLock(config.dsn, application_name=f"{self.application_name} (wakeup lock)")
        self.standby = StandbyFlush(self.gateway, config.standby_flushed) if config.standby_flushed else None
        self.shard_group = (ShardGroup(config.dsn, config.shard_group, config.name,
                                       application_name=f"{self.application_name} (shard group)",
                                       changed=self._wake.set)
                            if config.shard_group else None)

    # -- lifecycle -----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; in-flight batches are finished and reported, then run() returns."""
        if not self._stopping:
            log.info("event=shutdown_requested worker=%s", self.cfg.name)
            with contextlib.suppress(RuntimeError):   # no running loop: nothing to watch
                self._slow_stop = asyncio.get_running_loop().create_task(
                    say_where_after(SAY_SLOW_STOP_AFTER, self.cfg.name), name="outboxpg-shutdown-watch")
        self._stopping = True
        if self.health is not None:
            self.health.stop()
        self._stop.set()
        self._wake.set()

    async def run_until_idle(self) -> None:
        """Like run(), but return once nothing is claimable and nothing is in flight (every event
        due now is reported), instead of waiting for more: ``outboxpg.testing.drain``. A database
        error on a claim is raised, not retried."""
        self._until_idle = True
        await self.run()

    async def run(self) -> None:
        cfg = self.cfg
        await self.gateway.open()
        background: list[asyncio.Task[None]] = []
        if self.shard_group is not None:
            await self.shard_group.join()
            background.append(asyncio.create_task(self.shard_group.run(self._stop), name="outboxpg-shard-group"))
        if self.health is not None:
            background.append(asyncio.create_task(self.health.beat_every(), name="outboxpg-heartbeat"))
        if not cfg.poll_only:
            background.append(asyncio.create_task(self.listener.run(), name="outboxpg-listener"))
        background.append(asyncio.create_task(self._summaries(), name="outboxpg-summary"))
        if cfg.maintenance_interval > 0:
            background.append(asyncio.create_task(maintain_every(self.gateway, cfg.maintenance_interval, self.recorder),
                                                  name="outboxpg-maintenance"))
        if cfg.xmin_check_interval > 0:
            background.append(asyncio.create_task(watch_xmin_every(self.gateway, cfg.xmin_check_interval),
                                                  name="outboxpg-xmin-watch"))
        self.recorder.watch_listener(lambda: self.listener.up)
        try:
            if self.owns_publisher and hasattr(self.publisher, "start"):
                await self.publisher.start()
            log.info("event=start worker=%s batch_size=%d concurrency=%d lease=%gs poll_interval=%gs "
                     "poll_only=%s publish_timeout=%gs standby_flushed=%s run_publishing=%s%s", cfg.name,
                     cfg.batch_size, cfg.concurrency, cfg.lease, cfg.poll_interval, cfg.poll_only, cfg.publish_timeout,
                     cfg.standby_flushed or "off", getattr(self.publisher, "run_publishing", "publisher-defined"),
                     f" shard={cfg.shard.replace(' ', '')}" if cfg.shard
                     else f" shard_group={cfg.shard_group}" if cfg.shard_group else "")
            if self.health is not None:
                self.health.running(self.publisher, self._ping)
            await self._loop()
        finally:
            await cancel_all(background)
            await self.idle_lock.close()
            if self.shard_group is not None:
                await self.shard_group.leave()
            if self.standby is not None:
                await self.standby.close()
            if self.owns_publisher and hasattr(self.publisher, "close"):
                with contextlib.suppress(Exception):
                    await self.publisher.close()
            await self.gateway.close()
            self.recorder.log_summary(self.listener.up, final=True)
            if self._slow_stop is not None:
                self._slow_stop.cancel()
            log.info("event=stopped worker=%s", cfg.name)

    # -- the loop ------------------------------------------------------------------------

    async def _loop(self) -> None:
        try:
            while not self._stopping:
                claimed = await self._drain()
                if self._stopping:
                    break
                if self._looked_again:
                    self._looked_again = False
                    self._look_again = LOOK_AGAIN_LEAST if claimed else min(2 * self._look_again, LOOK_AGAIN_MOST)
                if claimed and self.idle_lock.held:
                    self._release_lock_soon()   # busy: producers need not notify
                if self._reported != self._reported_at_claim:
                    continue    # a batch was reported while the last claim ran: look again
                if self._out():
                    # The last claim came back short: everything claimable now is claimed. Never
                    # sleep with batches in flight, the lane's included: each report makes the
                    # next run of its aggregates claimable, and no NOTIFY announces that (nor new
                    # events while busy). Claim again as soon as the first of them is reported
                    # (not the last: one slow batch must not hold back the aggregates the others
                    # free), or when _look_again runs out (LOOK_AGAIN_LEAST).
                    self._looked_again = await self._first_reported()
                    continue
                if claimed:
                    continue    # its batch is reported already: claim what that made claimable
                await self._lock_released()
                if self._until_idle:
                    break
                if self.cfg.poll_only:
                    await self._sleep(await self._sleep_seconds())
                    continue
                if not self.idle_lock.held:
                    try:
                        await self.idle_lock.acquire(self._wake, await self._queued_for())
                    except psycopg.Error as exc:
                        log.warning("event=idle_lock_failed error=%r", first_line(exc))
                        await self.idle_lock.close()
                        await self._db_backoff()
                    # Granted: producers that skipped NOTIFY have all committed; the next drain
                    # sees their events. Not granted: a notification came first, or the request
                    # ran out (a second: a producer that skipped NOTIFY may have committed since,
                    # while another stays open), or a shard's worker queued behind another looks
                    # for itself (_queued_for). Either way: drain, then queue again.
                    continue
                why = await self._sleep(await self._sleep_seconds())
                if why == "wake" and not self._stopping:
                    self._release_lock_soon()       # in parallel with the claim that follows
        finally:
            # Finish and report every batch already claimed before returning.
            if self._inflight or self._lane is not None:
                await asyncio.gather(*self._inflight, *([self._lane] if self._lane else []), return_exceptions=True)
            await self._lock_released()

    async def _first_reported(self) -> bool:
        """Until one batch in flight (the lane's too) is reported, a wake-up (a notification,
        stop()), or ``_look_again`` ran out (True)."""
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            while True:
                done, _ = await asyncio.wait({*self._out(), woken}, timeout=self._look_again,
                                             return_when=asyncio.FIRST_COMPLETED)
                # Not while a batch handed back pauses: the claim would take it straight back.
                if done or not self._handing_back:
                    return not done
        finally:
            woken.cancel()

    def _out(self) -> set[asyncio.Task[None]]:
        """The batches in flight, the lane's among them."""
        if self._lane is not None and not self._lane.done():
            return {*self._inflight, self._lane}
        return set(self._inflight)

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

    async def _queued_for(self) -> float | None:
        """How long a worker of a shard waits in the queue for the wakeup lock (at most a request,
        a second) before it claims by itself: the holder's claims and its sleep until the next
        wakeup cover the holder's own shard only, so a queued worker claims its own at its
        shard's next wakeup. None for a worker of every aggregate: whichever worker holds the
        lock claims for all."""
        if self._shard() is None:
            return None
        return await self._sleep_seconds()

    async def _sleep_seconds(self) -> float:
        """Until the next retry or lease expiry of this worker's aggregates, at most the poll interval."""
        try:
            seconds = await self.gateway.seconds_to_next_wakeup(self._shard())
        except psycopg.Error as exc:
            log.warning("event=db_error during=next_wakeup error=%r", first_line(exc))
            self._database_failed(exc)
            return min(self.cfg.poll_interval, 5.0)
        if self.health is not None:
            self.health.database_ok()
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
            while len(self._inflight) >= self.cfg.concurrency and not self._stopping:
                await self._lane_while_full()
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

    async def _lane_while_full(self) -> None:
        """Every batch is out: until the first of them is reported, claim the quiet aggregates'
        events beside them every _lane_wait (see LANE_BATCH)."""
        done, _ = await asyncio.wait(self._inflight, timeout=self._lane_wait, return_when=asyncio.FIRST_COMPLETED)
        if done or self._stopping or self._until_idle or self._handing_back:
            return
        if self._lane is not None and not self._lane.done():
            return
        if self._publisher_ready is not None and not self._publisher_ready.is_set():
            return
        rows = await self._claim(min(self.cfg.batch_size, LANE_BATCH), quiet_only=True)
        # Found something: look again soon; nothing: less often, down to LOOK_AGAIN_MOST.
        self._lane_wait = LOOK_AGAIN_LEAST if rows else min(2 * self._lane_wait, LOOK_AGAIN_MOST)
        if rows:
            self._lane = asyncio.create_task(self._deliver(rows))

    async def _publish(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        """The publisher's outcomes for ``events``; with ``slots``, in this database's turn for
        its share of the process's events in flight, held while publishing only: a database
        whose claims or reports hang (down, locked) holds none of it."""
        outcomes: Sequence[BaseException | None]
        if self.slots is None:
            outcomes = await self.publisher.publish_batch(events)
            return outcomes
        units = await self.slots.acquire(self, len(events))
        try:
            outcomes = await self.publisher.publish_batch(events)
            return outcomes
        finally:
            self.slots.release(units)

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

    def _shard(self) -> str | None:
        """The shard to claim: --shard, the shard group's current one, or None (every aggregate)."""
        if self.shard_group is not None:
            return self.shard_group.shard or None
        return self.cfg.shard or None

    async def _claim(self, batch_size: int | None = None, *, quiet_only: bool = False) -> list[tuple[Any, ...]]:
        try:
            rows = await self.gateway.claim(batch_size or self.cfg.batch_size, self._lease, self.cfg.name,
                                            self._shard(), quiet_only)
        except psycopg.Error as exc:
            if self._until_idle:
                raise
            log.warning("event=db_error during=claim error=%r", first_line(exc))
            self._database_failed(exc)
            if connection_lost(exc):
                # The server went away (a restart, a failover): the pool's other connections
                # went with it. Replaced now, not one failed claim (and backoff) at a time.
                await self.gateway.replaced_broken_connections()
            await self._db_backoff()
            return []
        self._db_delay = 0.0
        if self.health is not None:
            self.health.database_ok()
        self.recorder.claimed(len(rows))
        return rows

    async def _deliver(self, rows: list[tuple[Any, ...]]) -> None:
        token = rows[0][LEASE_TOKEN]
        events = [event_from_row(row) for row in rows]
        if self.standby is None:
            short, long = split_short_runs(events, SHORT_RUN)
            if short and long:
                await asyncio.gather(self._deliver_events(short, token), self._deliver_events(long, token))
                return
        await self._deliver_events(events, token, rows)

    async def _deliver_events(self, events: list[OutboxEvent], token: Any,
                              rows: list[tuple[Any, ...]] | None = None) -> None:
        """Publish ``events`` (runs of one claim) and report them. ``rows``: their claim rows,
        for --standby-flushed."""
        started = time.monotonic()
        # Most batches are reported long before this fires: then it costs a timer, nothing more.
        keeper: list[asyncio.Task[None]] = []
        published = asyncio.Event()
        timer = asyncio.get_running_loop().call_later(
            self._extend_every, lambda: keeper.append(asyncio.ensure_future(self._keep_leases(events, token,
                                                                                               published))))
        try:
            if self.standby is not None and rows is not None and not await self._standby_flushed(rows):
                outcomes: Sequence[BaseException | None] | None = None
            else:
                outcomes = await self._publish(events)
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
        try:
            if outcomes is None:
                await self._hand_back(events, token, time.monotonic() - started)
                return
            self.recorder.published(time.monotonic() - started)
            await self._report(events, outcomes, token)
        except Exception as exc:  # noqa: BLE001 - never lose the worker over one batch
            log.error("event=report_crashed error=%r", exc)
        finally:
            self._reported += 1

    async def _standby_flushed(self, rows: list[tuple[Any, ...]]) -> bool:
        """--standby-flushed: whether the standby flushed the batch's events within the publish
        timeout (the claim rows end with the WAL position to wait for, see gateway.py)."""
        assert self.standby is not None
        lsn = max(lsn_value(row[-1]) for row in rows)
        return await self.standby.wait(lsn, self.cfg.publish_timeout)

    async def _hand_back(self, events: Sequence[OutboxEvent], token: Any, waited: float) -> None:
        """Release a batch no standby flushed in time: nothing of it was published, nothing is
        an attempt; it is claimed again (and waits again) on the next claim."""
        log.warning("event=standby_flush_timeout standby=%s events=%d waited=%.1fs note=%r", self.cfg.standby_flushed,
                    len(events), waited, "released unpublished: a standby has not flushed them")
        # Not straight back to a claim that would wait just as long: a short pause, cut by stop().
        self._handing_back += 1
        try:
            try:
                await self.gateway.release([e.id for e in events], token)
            except psycopg.Error as exc:
                log.warning("event=db_error during=release error=%r note=%r", first_line(exc),
                            "the leases will expire and the events be claimed again")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), min(1.0, self.cfg.publish_timeout))
        finally:
            self._handing_back -= 1

    async def _keep_leases(self, events: Sequence[OutboxEvent], token: Any, published: asyncio.Event) -> None:
        """Extend the batch's leases now and every third of the lease, until ``published`` is set.

        Fenced by the token like every report: events whose run another worker took back (this
        worker was cut off, or frozen, past a lease) are not extended; that is logged, and the
        report later counts them as lost leases."""
        ids = id_array([e.id for e in events])
        held = len(events)
        while not published.is_set():
            wait = self._extend_every
            try:
                extended = await self.gateway.extend(ids, token, self._lease)
            except Exception as exc:  # noqa: BLE001 - psycopg or pool errors: try again sooner
                log.warning("event=db_error during=extend error=%r", first_line(exc))
                wait = min(wait / 2, 1.0)
            else:
                self.recorder.extended(held, extended)
                held = min(held, extended)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(published.wait(), wait)

    async def _report(self, events: Sequence[OutboxEvent], outcomes: Sequence[BaseException | None],
                      token: Any) -> None:
        acked_at = datetime.now(UTC)
        failed: list[tuple[OutboxEvent, BaseException]] = []
        released: list[int] = []
        delivered: Sequence[OutboxEvent]
        if any(o is not None for o in outcomes):
            delivered, failed, released = split_runs(events, outcomes)
        else:
            delivered = events
        reported = await self.gateway.report(
            [e.id for e in delivered], token,
            [(e.id, describe(o, whole=True), isinstance(o, PermanentError), retry_after(o)) for e, o in failed],
            released, created_range(delivered))
        if reported is None:
            log.error("event=report_failed events=%d note=%r", len(events),
                      "leases will expire and the events be retried (deduplicated by msg_id)")
            return
        completed, states, handed_back = reported
        self.recorder.reported(events, acked_at, delivered, completed, failed, states, len(released), handed_back)

    def _database_failed(self, exc: BaseException) -> None:
        if self.health is not None:
            self.health.database_failed(first_line(exc))

    async def _ping(self) -> None:
        """The /readyz probe of PostgreSQL, when no statement of the worker's answered lately."""
        await self.gateway.ping(PROBE_TIMEOUT)

    async def _db_backoff(self) -> None:
        self._db_delay = next_delay(self._db_delay, DB_MAX_DELAY)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stop.wait(), self._db_delay)   # cut short by stop()

    # -- reporting -----------------------------------------------------------------------

    async def _summaries(self) -> None:
        """A summary every summary_interval; the first one EARLY_SUMMARY after the first
        delivery when that comes sooner."""
        loop = asyncio.get_running_loop()
        interval = self.cfg.summary_interval
        due = loop.time() + interval
        first = asyncio.ensure_future(self.recorder.first_delivered.wait())
        try:
            while True:
                if first.done():
                    await asyncio.sleep(max(due - loop.time(), 0.0))
                else:
                    done, _ = await asyncio.wait({first}, timeout=max(due - loop.time(), 0.0))
                    if done:
                        due = min(due, loop.time() + EARLY_SUMMARY)
                        continue
                self.recorder.log_summary(self.listener.up)
                due = loop.time() + interval
        finally:
            first.cancel()


def application_name(worker_name: str) -> str:
    """'outboxpg-worker <name>' (PostgreSQL keeps the first 63 bytes of an application_name)."""
    return f"outboxpg-worker {worker_name}"


def split_short_runs(events: Sequence[OutboxEvent], most: int) -> tuple[list[OutboxEvent], list[OutboxEvent]]:
    """(the events of runs of at most ``most`` events, the others), each in batch order."""
    short: list[OutboxEvent] = []
    long: list[OutboxEvent] = []
    for run in runs_of(events):
        (short if len(run) <= most else long).extend(events[i] for i in run)
    return sorted(short, key=lambda e: e.id), sorted(long, key=lambda e: e.id)


def created_range(events: Sequence[OutboxEvent]) -> tuple[datetime, datetime] | None:
    """The least and the greatest created_at of ``events`` (None for none): outbox_complete then
    reads only the partitions that can hold them."""
    if not events:
        return None
    created = [e.created_at for e in events]
    return min(created), max(created)


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
