"""/metrics, /healthz and /readyz of one relay process over several databases.

Each database keeps a WorkerMetrics of its own (its counters, histograms, Health, and the gauges
sampled from its database). The process serves them merged: every sample gets a ``database``
label (the database's label: ``name@host:port`` or the name given in --dsn-file), so there are
as many series per metric as databases; a database removed on reload takes its series with it.
With ``labelled`` False (one database, given by --dsn) the one database's metrics are served as
they are, without the label, and its /readyz answers as a lone worker's.

Readiness over several databases: 200 while the broker is connected and at least one database is
ready; the body then says ``ok``, or ``ok: N of M databases not ready: <label>: <why>; ...``. 503
when none is (each one's reason in the body), while starting, and while stopping. One tenant
database down must not hold back a rollout of the process that serves the other 49; it shows in
the body, in the log (event=database_unavailable), in its metrics (``outboxpg_listener_up``,
``outboxpg_last_claim_timestamp_seconds``) and in ``outboxpg status``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from outboxpg.relay.health import Health
from outboxpg.relay.metrics import WorkerMetrics
from outboxpg.text import join_lines, printable

__all__ = ["FleetHealth", "FleetMetrics"]

# Databases sampled at once on a scrape.
SAMPLERS = 16


class _Merged(Collector):
    def __init__(self, fleet: FleetMetrics) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        databases = self.fleet.snapshot()
        if not self.fleet.labelled:
            for metrics in databases.values():
                yield from metrics.registry.collect()
            return
        # Each database's gauges are sampled from it on scrape (a connection each, cached 5 s):
        # side by side, so that 50 databases answer within a scrape's timeout, not one after another.
        with ThreadPoolExecutor(max_workers=min(SAMPLERS, max(1, len(databases)))) as pool:
            collected = list(pool.map(lambda m: list(m.registry.collect()), databases.values()))
        families: dict[str, Metric] = {}
        for label, found in zip(databases, collected):
            for family in found:
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                merged.samples.extend(Sample(s.name, {"database": label, **s.labels}, s.value, s.timestamp,
                                             s.exemplar) for s in family.samples)
        yield from families.values()


class FleetHealth:
    """/healthz and /readyz over the databases' Health objects and those still waiting to start."""

    def __init__(self, fleet: FleetMetrics) -> None:
        self.fleet = fleet
        self.stopping = False
        # Why a database is not served yet (its start-up check failed; retried): label -> reason.
        self.waiting: dict[str, str] = {}
        self.stream_problem = ""

    def stop(self) -> None:
        self.stopping = True

    def checked_schema(self) -> None:
        """outboxpg-worker's start-up checks passed: each database's Health records its own as
        it starts (a database checked again later starts only once it passes)."""

    def checked_stream(self, problems: list[str]) -> None:
        """The start-up stream check (outboxpg-worker), before any database is served."""
        self.stream_problem = problems[0] if problems else ""

    def liveness(self) -> str | None:
        for health in self._healths().values():
            problem = health.liveness()
            if problem is not None:
                return problem
        return None

    def readiness(self) -> tuple[bool, str]:
        healths = self._healths()
        if not self.fleet.labelled and len(healths) == 1 and not self.waiting:
            (only,) = healths.values()
            problem = only.readiness()
            return problem is None, problem or "ok"
        if self.stopping:
            return False, "stopping"
        if not healths:
            if self.stream_problem:
                return False, f"stream: {self.stream_problem}"
            return False, "starting" + (f": {self._list(self.waiting)}" if self.waiting else "")
        problems = {label: h.readiness() for label, h in healths.items()}
        not_ready: dict[str, str] = {label: why for label, why in problems.items() if why is not None}
        not_ready.update(dict(self.waiting))
        total = len(healths) + len(self.waiting)
        if len(not_ready) == total:
            return False, f"no database ready: {self._list(not_ready)}"
        if not_ready:
            return True, f"ok: {len(not_ready)} of {total} databases not ready: {self._list(not_ready)}"
        return True, "ok"

    @staticmethod
    def _list(problems: Mapping[str, str]) -> str:
        return "; ".join(f"{label}: {why}" for label, why in sorted(problems.items()))

    def _healths(self) -> dict[str, Health]:
        return {label: m.health for label, m in self.fleet.snapshot().items()}

    def wsgi(self, app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
        def health_app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path not in ("/healthz", "/readyz"):
                return app(environ, start_response)
            try:
                if path == "/healthz":
                    problem = self.liveness()
                    ok, text = problem is None, problem or "ok"
                else:
                    ok, text = self.readiness()
            except Exception as exc:  # noqa: BLE001 - a check that fails is an answer too
                ok, text = False, f"health check failed: {exc!r}"
            body = printable(join_lines(text)).encode() + b"\n"
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                            ("Cache-Control", "no-store")])
            return [body]

        return health_app


class FleetMetrics:
    """The databases' WorkerMetrics, added and removed as they start and stop, served together."""

    def __init__(self, labelled: bool = True) -> None:
        self.labelled = labelled
        self._lock = threading.Lock()
        self._databases: dict[str, WorkerMetrics] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_Merged(self))
        self.health = FleetHealth(self)

    def add(self, label: str, metrics: WorkerMetrics) -> None:
        with self._lock:
            self._databases[label] = metrics
        self.health.waiting.pop(label, None)

    def remove(self, label: str) -> None:
        with self._lock:
            self._databases.pop(label, None)
        self.health.waiting.pop(label, None)

    def snapshot(self) -> dict[str, WorkerMetrics]:
        """The databases now (read by the HTTP server's threads)."""
        with self._lock:
            return dict(self._databases)

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        served = start_http_server(port, addr=addr, registry=self.registry)
        server = served[0]
        app = server.get_app()
        assert app is not None
        server.set_app(self.health.wsgi(app))
        return served
