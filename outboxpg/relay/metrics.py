"""Prometheus metrics of a worker (``outboxpg-worker --metrics-port N``), served with its
/healthz and /readyz (outboxpg.relay.health).

Counters and histograms are updated by the worker as it goes. The gauges that come from the
database (backlog, scheduled and retrying events, dead letters, oldest pending age) are read only
when Prometheus scrapes, at most once per ``sample_every`` seconds: a worker that nobody scrapes
sends no extra queries.

Producers choose event types, and each value of a label is a time series the worker keeps and
every scrape carries: the ``event_type`` label takes the first ``max_event_types`` values seen
(100 by default), and counts every other event type as ``other`` (OTHER_EVENT_TYPES). 100,000
distinct types made /metrics 54 MB and the worker 330 MB before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from outboxpg import statements
from outboxpg.relay.health import Health

__all__ = ["DEFAULT_EVENT_TYPES", "OTHER_EVENT_TYPES", "WorkerMetrics"]

DEFAULT_EVENT_TYPES = 100
OTHER_EVENT_TYPES = "other"   # the event_type label of the event types past the cap

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_BATCH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class _DatabaseGauges(Collector):
    """Backlog, scheduled and retrying events, dead letters and oldest pending age, read from the
    database on scrape (cached)."""

    def __init__(self, dsn: str, sample_every: float, application_name: str) -> None:
        self.dsn = dsn
        self.application_name = application_name
        self.sample_every = sample_every
        self._lock = threading.Lock()
        self._at = 0.0
        self._values: tuple[float, ...] | None = None

    def _sample(self) -> tuple[float, ...] | None:
        with self._lock:
            if self._values is not None and time.monotonic() - self._at < self.sample_every:
                return self._values
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5,
                                     fallback_application_name=self.application_name) as conn:
                    # outbox_health: cheap, and readable by the outbox_worker role (the table is not).
                    row = conn.execute(statements.HEALTH_GAUGES).fetchone()
            except psycopg.Error:
                return self._values
            assert row is not None
            self._values = tuple(float(v) for v in row)
            self._at = time.monotonic()
            return self._values

    def collect(self) -> Iterator[GaugeMetricFamily]:
        values = self._sample()
        if values is None:
            return
        backlog, dead, age, scheduled, waiting_retry = values
        yield GaugeMetricFamily("outboxpg_backlog_events", "Events pending or leased (sampled from the database).",
                                value=backlog)
        yield GaugeMetricFamily("outboxpg_scheduled_events",
                                "Pending events never tried whose deliver_at is ahead (sampled).", value=scheduled)
        yield GaugeMetricFamily("outboxpg_waiting_retry_events",
                                "Pending events that failed and wait for their next attempt (sampled).",
                                value=waiting_retry)
        yield GaugeMetricFamily("outboxpg_dead_events", "Dead events waiting for an operator (sampled).", value=dead)
        yield GaugeMetricFamily("outboxpg_oldest_pending_age_seconds",
                                "Age of the oldest event not yet delivered (sampled).", value=age)


class WorkerMetrics:
    """The worker's metrics, in a registry of their own, and its ``health`` (served beside them
    as /healthz and /readyz, see outboxpg.relay.health)."""

    def __init__(self, dsn: str, sample_every: float = 5.0,
                 application_name: str = "outboxpg-worker (metrics)",
                 max_event_types: int = DEFAULT_EVENT_TYPES) -> None:
        if max_event_types < 0:
            raise ValueError(f"the metrics' event types must be 0 or more, got {max_event_types}")
        self.max_event_types = max_event_types
        self.health = Health()
        self._event_types: set[str] = set()
        self.registry = CollectorRegistry()
        r = self.registry
        self.delivered = Counter("outboxpg_events_delivered_total", "Events published and marked published.",
                                 ["event_type"], registry=r)
        self.failed = Counter("outboxpg_events_failed_total", "Failed attempts scheduled for a retry.",
                              ["event_type"], registry=r)
        self.dead = Counter("outboxpg_events_dead_lettered_total", "Events dead-lettered by this worker.",
                            ["event_type"], registry=r)
        self.lost_leases = Counter("outboxpg_lost_leases_total",
                                   "Reports refused because the lease had been taken over.", registry=r)
        self.publish_seconds = Histogram("outboxpg_publish_batch_seconds",
                                         "Time to publish one batch and receive its acks.",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.lag_seconds = Histogram("outboxpg_event_lag_seconds",
                                     "From when the event was due (its created_at, its transaction's start, "
                                     "or a later deliver_at) to the broker's ack.",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.claim_size = Histogram("outboxpg_claim_batch_size", "Events returned by each non-empty claim.",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.listener_up = Gauge("outboxpg_listener_up", "1 while the LISTEN connection is up.", registry=r)
        self.last_claim = Gauge("outboxpg_last_claim_timestamp_seconds",
                                "Unix time of the last claim that returned events.", registry=r)
        self.maintenance_failures = Counter("outboxpg_maintenance_failures_total",
                                            "outbox_maintain() runs that failed.", registry=r)
        r.register(_DatabaseGauges(dsn, sample_every, application_name))

    def event_type(self, event_type: str) -> str:
        """The event_type label for an event type: itself while it is one of the first
        ``max_event_types`` seen, else OTHER_EVENT_TYPES."""
        types = self._event_types
        if event_type in types:
            return event_type
        if len(types) < self.max_event_types:
            types.add(event_type)
            return event_type
        return OTHER_EVENT_TYPES

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        """Serve /metrics, /healthz and /readyz on addr:port from a background thread:
        prometheus-client's server, its metrics app wrapped by the health checks. Returns
        what start_http_server does (the server and its thread)."""
        served = start_http_server(port, addr=addr, registry=self.registry)
        server = served[0]
        app = server.get_app()
        assert app is not None
        server.set_app(self.health.wsgi(app))
        return served
