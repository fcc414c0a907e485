"""Publishers: where a worker sends events.

A publisher is any object with

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]

returning one outcome per event, in order: ``None`` for delivered, an exception for failed
(retried with backoff; an exception with a ``retry_after`` attribute, seconds, waits that long
if it is longer than the backoff, up to outbox_settings.backoff_cap: what a destination said,
such as HTTP's Retry-After), a ``PermanentError`` for never-publishable (dead-lettered at once).
It may also have ``async start()`` and ``async close()``.

Order. A batch holds runs: up to ``outbox_settings.max_run`` consecutive events of one
aggregate (aggregate_type, aggregate_id), under one lease. Events of one aggregate come in id
order in a batch (they may be interleaved with other aggregates' events); events of different
aggregates are independent. The worker reads the outcomes run by run: the events before a run's
first failure are completed, the first failure is failed (``outbox_fail``), and every event
after it is treated as NOT published, whatever its outcome says: it is released
(``outbox_release``, no attempt counted) and handed out again after the failed one. So a batch
publisher must itself publish an aggregate's events one after another, each only once the one
before it is delivered, and stop at the first failure: sending them concurrently could deliver
event k+1 without event k, and the destination would then hold them out of order. Events of
different aggregates may be sent concurrently. ``outboxpg.events.runs_of(events)`` groups a batch
into runs; ``NotSent`` is the outcome to give the events a publisher did not try.

Plain functions are wrapped by ``FunctionPublisher``: ``fn(event)``, sync or async; returning
means delivered, raising means failed. It keeps that order for you.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

from outboxpg.events import OutboxEvent, runs_of
from outboxpg.text import describe

__all__ = ["Publisher", "FunctionPublisher", "NotSent", "PermanentError", "PublisherNotFound", "as_publisher",
           "load_publisher", "not_sent_after", "print_event", "retry_after"]

Outcome = BaseException | None


class PermanentError(Exception):
    """Raise (or return) this from a publisher for an event that can never be published:
    the event is dead-lettered at once with the message as its reason, instead of retried."""


def retry_after(outcome: BaseException) -> timedelta | None:
    """How long the destination asked to wait before the next attempt: the failure's
    ``retry_after`` attribute (seconds, a finite number not below 0), else None."""
    wait = getattr(outcome, "retry_after", None)
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 <= wait < 10 ** 9:
        return timedelta(seconds=wait)
    return None


class NotSent(Exception):
    """The outcome a publisher gives an event it did not try to publish because an earlier event
    of its run failed (or the batch ran out of time first). The worker hands such events back
    with outbox_release (no attempt counted); the first failure of a run is what outbox_fail
    records."""


class PublisherNotFound(ValueError):
    """``load_publisher``: the module named in the spec does not exist on ``sys.path``."""


@runtime_checkable
class Publisher(Protocol):
    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]: ...


class FunctionPublisher:
    """Adapts ``fn(event)`` (sync or async) to a batch publisher, in order per aggregate.

    Async functions: the runs of a batch run concurrently, the events of one run one after
    another, each call only once the previous one returned; a run stops at its first failure
    (its remaining events get ``NotSent``). The whole batch is bounded by ``timeout`` seconds: a
    call still running then fails with a TimeoutError, the calls not started get ``NotSent``.
    Sync functions run one after another in a thread of the batch's own, so a blocking call (an
    HTTP request, say) never stalls the event loop, where the worker keeps extending the batch's
    leases meanwhile; a run's events after its first failure are skipped (``NotSent``). Each call
    is bounded by ``timeout`` seconds: one still running then fails with a TimeoutError and the
    batch stops there (the calls not started get ``NotSent``). A call cannot be interrupted, so
    the overdue one goes on in its thread, but nothing is called after it.
    """

    run_publishing = "sequential-calls"   # the worker logs it at start

    def __init__(self, fn: Callable[[OutboxEvent], Any], timeout: float = 10.0) -> None:
        self.fn = fn
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004 - an object whose __call__ is async

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]:
        if self.is_async:
            return await self._publish_async(events)
        return await self._publish_sync(events)

    async def _publish_async(self, events: Sequence[OutboxEvent]) -> list[Outcome]:
        # Every outcome starts as not sent and becomes None when its call returned. One timer for
        # the batch, not one per call (an asyncio timeout per event cost as much of the worker's
        # time as the rest of the adapter): at the deadline the calls still running are
        # cancelled and fail with a TimeoutError, and the runs' events not started stay not sent.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        outcomes: list[Outcome] = [NotSent("not sent: the batch ran out of time first")] * len(events)
        running: set[int] = set()
        batch = asyncio.gather(*(self._run_async(events, run, outcomes, running, deadline)
                                 for run in runs_of(events)))
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            for i in running:
                outcomes[i] = TimeoutError(f"publish took longer than {self.timeout:g}s")
            batch.cancel()

        timer = loop.call_at(deadline, expire)
        try:
            await batch
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not expired or (task is not None and task.cancelling()):
                raise                   # cancelled from outside (a shutdown): so are the calls
        finally:
            timer.cancel()
        return outcomes

    async def _run_async(self, events: Sequence[OutboxEvent], run: list[int], outcomes: list[Outcome],
                         running: set[int], deadline: float) -> None:
        loop = asyncio.get_running_loop()
        for n, i in enumerate(run):
            if loop.time() >= deadline:
                return                  # a function that swallowed the batch's cancel: not sent
            running.add(i)
            try:
                await self.fn(events[i])
            except asyncio.CancelledError:
                raise                   # the batch's deadline (expire), or a shutdown
            except BaseException as exc:  # noqa: BLE001 - any failure of user code is an outcome
                outcomes[i] = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
            else:
                outcomes[i] = None
            running.discard(i)
            if outcomes[i] is not None:
                not_sent_after(events, run[n + 1:], events[i].id, outcomes)
                return

    async def _publish_sync(self, events: Sequence[OutboxEvent]) -> list[Outcome]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        batch = _SyncBatch(self.fn, events, loop, done)
        # A thread per batch, not the loop's default executor: a call that never returns keeps
        # its thread, and must not take one from the other batches (nor keep the process from
        # exiting: daemon).
        threading.Thread(target=batch.run, name="outboxpg-publisher", daemon=True).start()
        try:
            while not done.done():
                started = batch.started
                wait = self.timeout if started is None else started + self.timeout - time.monotonic()
                if wait <= 0:
                    return batch.give_up(TimeoutError(f"publish took longer than {self.timeout:g}s"))
                await asyncio.wait((done,), timeout=wait)
        finally:
            if not done.done() and not batch.stopped:
                batch.give_up(NotSent("not sent: the batch was cancelled"))   # cancelled: call nothing more
        return batch.outcomes


class _SyncBatch:
    """One batch of a sync function, called in a thread of its own, one event after another."""

    def __init__(self, fn: Callable[[OutboxEvent], Any], events: Sequence[OutboxEvent],
                 loop: asyncio.AbstractEventLoop, done: asyncio.Future[None]) -> None:
        self.fn, self.events, self.loop, self.done = fn, events, loop, done
        self.outcomes: list[Outcome] = [None] * len(events)
        self.lock = threading.Lock()
        self.current = -1                  # the event being published, or the last one
        self.started: float | None = None  # when its call started (time.monotonic); None between calls
        self.stopped = False               # given up on: call nothing more, record nothing more

    def run(self) -> None:
        failed: set[tuple[str, str]] = set()   # aggregates whose run has failed in this batch
        try:
            for i, event in enumerate(self.events):
                key = (event.aggregate_type, event.aggregate_id)
                with self.lock:
                    if self.stopped:
                        return
                    if failed and key in failed:
                        self.outcomes[i] = NotSent("not sent: an earlier event of its aggregate failed")
                        continue
                    self.current, self.started = i, time.monotonic()
                outcome: Outcome = None
                try:
                    self.fn(event)
                except BaseException as exc:  # noqa: BLE001 - any failure of user code is an outcome
                    outcome = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
                with self.lock:
                    if self.stopped:
                        return   # too late: the batch was reported without this call
                    self.started = None
                    if outcome is not None:
                        self.outcomes[i] = outcome
                        failed.add(key)
        finally:
            with contextlib.suppress(RuntimeError):   # the loop is closed: nobody waits any more
                self.loop.call_soon_threadsafe(_set_done, self.done)

    def give_up(self, outcome: BaseException) -> list[Outcome]:
        """Stop: the call in progress gets ``outcome``, the events not called yet ``NotSent``."""
        with self.lock:
            self.stopped = True
            first = self.current + 1
            if self.started is not None:
                self.outcomes[self.current] = outcome
            elif self.current < 0:
                first = 0
            not_sent = NotSent("not sent: an event before it in the batch ran out of time")
            for i in range(first, len(self.outcomes)):
                if self.outcomes[i] is None:
                    self.outcomes[i] = not_sent
            return list(self.outcomes)


def not_sent_after(events: Sequence[OutboxEvent], positions: Sequence[int], failed_id: int,
                   outcomes: list[Any]) -> None:
    """The outcome of the events at ``positions`` (the rest of a run after its failed event
    ``failed_id``): NotSent, one instance for them all."""
    if positions:
        skipped = NotSent(f"not sent: event {failed_id} of its aggregate failed before it")
        for i in positions:
            outcomes[i] = skipped


def _set_done(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def as_publisher(obj: Any) -> Any:
    """An object with ``publish_batch`` is used as it is; a callable is wrapped."""
    if hasattr(obj, "publish_batch"):
        return obj
    if callable(obj):
        return FunctionPublisher(obj)
    raise TypeError(f"not a publisher: {obj!r} (need publish_batch() or a callable taking one event)")


def load_publisher(spec: str) -> Any:
    """Load ``module:attribute``; a class or factory taking no arguments is called once.

    Every way this can fail is a ValueError with a one-line message naming ``spec`` (a module
    that is not found, an attribute that is not there, a module that fails while importing).
    The module is looked up on ``sys.path`` as it is: a command line puts the current directory
    on it first (as ``python -m`` does)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--publisher must look like module:callable, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise PublisherNotFound(f"cannot load --publisher {spec}: no module named {exc.name!r}") from None
        raise ValueError(f"cannot load --publisher {spec}: importing {module_name} failed: "
                         f"{describe(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises while importing
        raise ValueError(f"cannot load --publisher {spec}: importing {module_name} failed: {describe(exc)}") from None
    path = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"cannot load --publisher {spec}: {'module' if path == module_name else 'object'} "
                             f"{path!r} has no attribute {part!r}")
        obj = getattr(obj, part)
        path = f"{path}.{part}"
    try:
        if inspect.isclass(obj):
            obj = obj()
        return as_publisher(obj)
    except Exception as exc:  # noqa: BLE001 - a constructor of the user's, or not a publisher at all
        raise ValueError(f"cannot load --publisher {spec}: {describe(exc)}") from None


def print_event(event: OutboxEvent) -> None:
    """A publisher for trying things out: prints each event on one line
    (``outboxpg-worker --publisher outboxpg.relay.publishers:print_event``)."""
    print(f"{event.id} {event.subject} msg_id={event.msg_id} attempt={event.attempt} "
          f"{event.payload.decode('utf-8', 'replace')}", flush=True)

