"""Liveness and readiness of a worker: ``/healthz`` and ``/readyz`` beside ``/metrics`` on the
metrics port (``outboxpg-worker --metrics-port N``), for the probes of Kubernetes and the like.

``/healthz`` (liveness: restart me if this fails): 503 while the worker's event loop has not
ticked for ``stall_after`` seconds (a heartbeat the loop writes once a second, read by the HTTP
server's thread), or while its publisher is closed or failed (a publisher's ``closed``
attribute, when it has one); else 200.

``/readyz`` (readiness: delivering works): 503 unless all of these hold:

- the worker runs (started, not stopping);
- the start-up checks passed (``schema_checked``; set by outboxpg-worker);
- a stream captures the worker's subjects (``stream_found``; outboxpg-worker's start-up stream
  check, NATS only; rechecked only at the next start);
- PostgreSQL answers: the last claim (or another statement of the worker) succeeded, or, when
  that is older than ``fresh_for`` seconds, a probe (``SELECT 1`` on the worker's pool, sent by
  the HTTP request, at most one at a time) did;
- the broker is connected: the publisher's ``health_problem()``, when it has one, returns None
  (NatsPublisher: the nats-py client is connected, not reconnecting), and its ``ready`` event,
  when it has one, is set. A publisher of your own that has neither is taken as ready.

Each 503 has a one-line body naming what is wrong; a 200 says ``ok``. Every flag here is written
by the worker's event loop and read by the server's threads: plain attribute writes and reads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from outboxpg.text import first_line, join_lines, printable

__all__ = ["FRESH_FOR", "STALL_AFTER", "Health"]

# /healthz fails once the event loop has not ticked for this long (it ticks every second).
STALL_AFTER = 15.0
# /readyz probes PostgreSQL when the worker's last statement is older than this.
FRESH_FOR = 5.0
# How long a /readyz request waits for its probe; then it answers from what it knows
# (Kubernetes' default timeoutSeconds is 1).
PROBE_WAIT = 0.5
# A probe's own bound, in the event loop: a connection from the pool and SELECT 1.
PROBE_TIMEOUT = 3.0
# With no answer from PostgreSQL for this long (a probe still waiting), not ready.
SILENT_AFTER = 15.0
BEAT_EVERY = 1.0

_Probe = Callable[[], Awaitable[None]]
_StartResponse = Callable[..., Any]
_App = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]


class Health:
    """What /healthz and /readyz answer. outboxpg-worker sets ``schema_checked`` and
    ``stream_found`` (``checked_schema()``, ``checked_stream()``); a Worker given this object
    sets the rest as it runs. Flags that no one set do not hold readiness back, but the worker
    must have started."""

    def __init__(self, *, stall_after: float = STALL_AFTER, fresh_for: float = FRESH_FOR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_after = stall_after
        self.fresh_for = fresh_for
        self.clock = clock
        # None: not checked by this process (the check does not apply), else whether it passed.
        self.schema_checked: bool | None = None
        self.stream_found: bool | None = None
        self.stream_problem = ""
        self.started = False
        self.stopping = False
        self.publisher: Any = None
        self._last_beat: float | None = None
        # (when, None if PostgreSQL answered else why not); None: nothing sent yet.
        self._database: tuple[float, str | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._probe: _Probe | None = None
        self._probing: concurrent.futures.Future[None] | None = None

    # -- written by outboxpg-worker ---------------------------------------------------------

    def checked_schema(self, passed: bool = True) -> None:
        self.schema_checked = passed

    def checked_stream(self, problems: Sequence[str]) -> None:
        """The start-up stream check's problems (none: a stream captures the worker's subjects)."""
        self.stream_found = not problems
        self.stream_problem = problems[0] if problems else ""

    # -- written by the worker's event loop -------------------------------------------------

    def beat(self) -> None:
        self._last_beat = self.clock()

    async def beat_every(self, seconds: float = BEAT_EVERY) -> None:
        """The heartbeat: run as a task of the event loop it watches."""
        while True:
            self.beat()
            await asyncio.sleep(seconds)

    def running(self, publisher: Any, probe: _Probe) -> None:
        """The worker started delivering with ``publisher``; ``probe()`` raises unless
        PostgreSQL answers (called in the current event loop)."""
        self.publisher = publisher
        self._probe = probe
        self._loop = asyncio.get_running_loop()
        self.started = True
        self.beat()

    def stop(self) -> None:
        self.stopping = True

    def database_ok(self) -> None:
        self._database = (self.clock(), None)

    def database_failed(self, reason: str) -> None:
        self._database = (self.clock(), reason)

    async def _run_probe(self) -> None:
        assert self._probe is not None
        try:
            await asyncio.wait_for(self._probe(), PROBE_TIMEOUT)
        except TimeoutError:
            self.database_failed(f"no answer within {PROBE_TIMEOUT:g}s")
        except Exception as exc:  # noqa: BLE001 - any error: PostgreSQL is not usable
            self.database_failed(first_line(exc))
        else:
            self.database_ok()

    # -- read by the HTTP server's threads --------------------------------------------------

    def liveness(self) -> str | None:
        """Why the process is not alive, or None."""
        if self._last_beat is not None:
            silent = self.clock() - self._last_beat
            if silent > self.stall_after:
                return f"event loop stuck: no heartbeat for {silent:.0f}s"
        if self.started and not self.stopping and getattr(self.publisher, "closed", False) is True:
            return "publisher closed"
        return None

    def readiness(self) -> str | None:
        """Why the worker is not ready, or None: every problem, in one line."""
        if self.stopping:
            return "stopping"
        if not self.started:   # waiting for a stream (--wait-for-stream) says for what
            return f"stream: {self.stream_problem}" if self.stream_found is False else "starting"
        problems = []
        if self.schema_checked is False:
            problems.append("schema: the start-up checks did not pass")
        if self.stream_found is False:
            problems.append(f"stream: {self.stream_problem or 'no stream captures the subjects'}")
        if (db := self._database_problem()) is not None:
            problems.append(f"PostgreSQL: {db}")
        if (broker := _broker_problem(self.publisher)) is not None:
            problems.append(f"broker: {broker}")
        return "; ".join(problems) or None

    def _database_problem(self) -> str | None:
        state = self._database
        if state is None or self.clock() - state[0] > self.fresh_for:
            self._probe_now()
            state = self._database
        if state is None:
            return "not connected yet"
        at, reason = state
        if reason is not None:
            return reason
        if self.clock() - at > SILENT_AFTER:
            return f"no answer for {self.clock() - at:.0f}s"
        return None

    def _probe_now(self) -> None:
        """Send a probe from the event loop (unless one is under way) and wait PROBE_WAIT for it."""
        loop, probing = self._loop, self._probing
        if loop is None or self._probe is None:
            return
        if probing is None or probing.done():
            try:
                probing = self._probing = asyncio.run_coroutine_threadsafe(self._run_probe(), loop)
            except RuntimeError:   # the loop is closed
                return
        with contextlib.suppress(concurrent.futures.TimeoutError, Exception):
            probing.result(PROBE_WAIT)

    def wsgi(self, app: _App) -> _App:
        """``app`` (prometheus-client's metrics app) with /healthz and /readyz in front of it."""
        checks = {"/healthz": self.liveness, "/readyz": self.readiness}

        def health_app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
            check = checks.get(environ.get("PATH_INFO", ""))
            if check is None:
                return app(environ, start_response)
            try:
                problem = check()
            except Exception as exc:  # noqa: BLE001 - a check that fails is an answer too
                problem = f"health check failed: {exc!r}"
            status = "200 OK" if problem is None else "503 Service Unavailable"
            body = ("ok" if problem is None else printable(join_lines(problem))).encode() + b"\n"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                    ("Content-Length", str(len(body))), ("Cache-Control", "no-store")])
            return [body]

        return health_app


def _broker_problem(publisher: Any) -> str | None:
    """Why ``publisher`` cannot publish now (its ``health_problem()``, its ``ready`` event), or None."""
    problem = getattr(publisher, "health_problem", None)
    if callable(problem):
        found = problem()
        if found is not None:
            return str(found)
    ready = getattr(publisher, "ready", None)
    if isinstance(ready, asyncio.Event) and not ready.is_set():
        return "the publisher is not ready"
    return None
