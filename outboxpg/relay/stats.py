"""What the worker counts and tells: its running totals (WorkerStats), the Prometheus metrics when
it serves them, and the log lines about outcomes (dead letters, lost leases, failure reasons,
summaries). The worker makes one call per thing that happened; whether metrics are on is this
module's business."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from outboxpg.events import OutboxEvent
from outboxpg.relay.metrics import WorkerMetrics
from outboxpg.text import describe, printable

__all__ = ["Recorder", "WorkerStats"]

log = logging.getLogger("outboxpg.worker")

_NO_TIME = timedelta(0)
_DIGITS = re.compile(r"[0-9]+")   # "no ack for event 17" and "... 18" are one reason
_MAX_REASONS = 1000
_SUMMARY_REASONS = 10


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


class Recorder:
    def __init__(self, worker_name: str, summary_interval: float, metrics: WorkerMetrics | None) -> None:
        self.name = worker_name
        self.summary_interval = summary_interval
        self.metrics = metrics
        self.stats = WorkerStats()
        # Failed publishes by reason (the error's first line, digits masked): the first of each
        # reason is logged at WARNING, the others are counted and summarised every
        # summary_interval, so that an outage does not write a line per event and attempt.
        self._reasons_seen: set[str] = set()
        self._failures: dict[str, list[Any]] = {}   # reason -> [failures since the last summary, example]
        # Set once this worker delivered its first event (logged at INFO, once: event=first_delivery).
        self.first_delivered = asyncio.Event()

    def watch_listener(self, up: Callable[[], bool]) -> None:
        """The listener_up gauge reads ``up()`` at each scrape."""
        if self.metrics is not None:
            self.metrics.listener_up.set_function(lambda: 1.0 if up() else 0.0)

    def claimed(self, events: int) -> None:
        """A claim returned (``events`` rows, maybe none)."""
        st = self.stats
        st.claims += 1
        if events:
            st.last_claim_at = time.time()
            if self.metrics is not None:
                self.metrics.claim_size.observe(events)
                self.metrics.last_claim.set(st.last_claim_at)

    def published(self, seconds: float) -> None:
        """A batch's publishes took ``seconds``."""
        if self.metrics is not None:
            self.metrics.publish_seconds.observe(seconds)

    def extended(self, held: int, extended: int) -> None:
        """outbox_extend kept ``extended`` of the ``held`` leases of a batch still being published."""
        self.stats.extensions += 1
        log.debug("event=lease_extended worker=%s events=%d", self.name, extended)
        if extended < held:
            log.warning("event=lease_lost worker=%s events=%d note=%r", self.name, held - extended,
                        "taken over while still being published (this worker was cut off or frozen "
                        "past the lease); the new holder publishes them again (same msg_id)")

    def reported(self, events: Sequence[OutboxEvent], acked_at: datetime, delivered: Sequence[OutboxEvent],
                 completed: int, failed: Sequence[tuple[OutboxEvent, BaseException]],
                 states: Sequence[str | None], released: int, handed_back: int) -> None:
        """A batch's report went through: of ``delivered``, ``completed`` were marked published
        (the rest had lost their lease); ``states`` is what outbox_fail said of each of
        ``failed``; ``handed_back`` of ``released`` were released."""
        st = self.stats
        m = self.metrics
        st.delivered += completed
        st.released += handed_back
        if completed and not self.first_delivered.is_set():
            self.first_delivered.set()
            first = delivered[0]
            log.info("event=first_delivery worker=%s id=%d subject=%s event_type=%s", self.name, first.id,
                     printable(first.subject), printable(first.event_type))
        if handed_back < released:
            st.lost_leases += released - handed_back
            log.warning("event=lease_lost worker=%s events=%d note=%r", self.name, released - handed_back,
                        "not released: the lease had expired and was taken over")
        if completed < len(delivered):
            st.lost_leases += len(delivered) - completed
            log.warning("event=lease_lost worker=%s events=%d note=%r", self.name, len(delivered) - completed,
                        "published after the lease expired and was taken over; the new holder republishes "
                        "(same msg_id)")
        if events:
            # From when each event was due (a scheduled event's deliver_at), not its creation: an
            # event due in 20 s and delivered on time is no lag.
            due = [e.due_at or e.created_at for e in events]
            # Summed as timedeltas by map()/sum() in C, not one Python step per event.
            st.lag_sum += sum(map(acked_at.__sub__, due), _NO_TIME).total_seconds()
            st.lag_count += len(due)
            st.lag_max = max(st.lag_max, (acked_at - min(due)).total_seconds())
            if m is not None:
                for d in due:
                    m.lag_seconds.observe((acked_at - d).total_seconds())
        if m is not None:
            # Which reports were refused for a lost lease is not known one by one: count the
            # first `completed` delivered events by type (exact whenever no lease was lost).
            # One labels() lookup (a lock and a dict) per event type, not per event.
            for event_type, n in Counter(e.event_type for e in delivered[:completed]).items():
                m.delivered.labels(m.event_type(event_type)).inc(n)
            if completed < len(delivered):
                m.lost_leases.inc(len(delivered) - completed)
        for (event, outcome), state in zip(failed, states):
            if m is not None and state in ("dead", "pending"):
                (m.dead if state == "dead" else m.failed).labels(m.event_type(event.event_type)).inc()
            if state == "dead":
                st.dead += 1
                # The producer's values with their control characters escaped: one line stays one.
                log.warning("event=dead_letter id=%d aggregate=%s/%s event_type=%s attempt=%d error=%r",
                            event.id, printable(event.aggregate_type), printable(event.aggregate_id),
                            printable(event.event_type), event.attempt, describe(outcome, whole=True))
            elif state == "pending":
                st.failed += 1
                self._note_failure(event, outcome)
            else:
                st.lost_leases += 1
                log.warning("event=lease_lost worker=%s id=%d note=%r", self.name, event.id,
                            "failure not recorded: the lease had expired and was taken over")

    def maintenance_failed(self) -> None:
        if self.metrics is not None:
            self.metrics.maintenance_failures.inc()

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
                    event.id, printable(event.aggregate_type), printable(event.aggregate_id),
                    printable(event.event_type), event.attempt, text,
                    f"first failure with this reason: it is retried; further ones are counted and logged as "
                    f"publish_failures every {self.summary_interval:g}s")

    def _log_failures(self) -> None:
        """One WARNING per reason that failed publishes since the last summary (the most
        frequent first), and one for the rest."""
        if not self._failures:
            return
        ranked = sorted(self._failures.values(), key=lambda e: -e[0])
        for count, example in ranked[:_SUMMARY_REASONS]:
            log.warning("event=publish_failures failures=%d interval=%gs error=%r", count,
                        self.summary_interval, example)
        rest = ranked[_SUMMARY_REASONS:]
        if rest:
            log.warning("event=publish_failures failures=%d interval=%gs other_reasons=%d", sum(e[0] for e in rest),
                        self.summary_interval, len(rest))
        self._failures = {}

    def log_summary(self, listener_up: bool, final: bool = False) -> None:
        """The failures by reason since the last summary, then the totals and the lag since then."""
        self._log_failures()
        st = self.stats
        avg = st.lag_sum / st.lag_count if st.lag_count else 0.0
        log.info("event=%s worker=%s delivered=%d failed=%d dead=%d released=%d lost_leases=%d lag_avg_ms=%.1f "
                 "lag_max_ms=%.1f listener_up=%s", "final_summary" if final else "summary", self.name, st.delivered,
                 st.failed, st.dead, st.released, st.lost_leases, avg * 1000, st.lag_max * 1000, listener_up)
        st.lag_sum, st.lag_count, st.lag_max = 0.0, 0, 0.0
