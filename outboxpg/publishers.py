"""Publishers: where a worker sends events.

A publisher is any object with

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]

returning one outcome per event, in order: ``None`` for delivered, an exception for failed
(retried with backoff), a ``PermanentError`` for never-publishable (dead-lettered at once).
It may also have ``async start()`` and ``async close()``.

The events of one batch belong to different aggregates (outbox_claim hands out one event per
aggregate at a time), so a publisher may send them all concurrently.

Plain functions are wrapped by ``FunctionPublisher``: ``fn(event)``, sync or async; returning
means delivered, raising means failed.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from outboxpg.events import OutboxEvent, PermanentError

__all__ = ["Publisher", "FunctionPublisher", "as_publisher", "load_publisher", "print_event"]

Outcome = BaseException | None


@runtime_checkable
class Publisher(Protocol):
    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]: ...


class FunctionPublisher:
    """Adapts ``fn(event)`` (sync or async) to a batch publisher.

    Async functions run concurrently for the whole batch; sync functions run one after another
    in a worker thread, so a blocking call (an HTTP request, say) never stalls the event loop.
    Each call is bounded by ``timeout`` seconds.
    """

    def __init__(self, fn: Callable[[OutboxEvent], Any], timeout: float = 10.0) -> None:
        self.fn = fn
        self.timeout = timeout
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[Outcome]:
        if self.is_async:
            return await asyncio.gather(*(self._one_async(e) for e in events))
        return await asyncio.wait_for(asyncio.to_thread(self._all_sync, events), self.timeout * max(1, len(events)))

    async def _one_async(self, event: OutboxEvent) -> Outcome:
        try:
            await asyncio.wait_for(self.fn(event), self.timeout)
            return None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - any failure of user code is an outcome
            return exc if isinstance(exc, Exception) else RuntimeError(repr(exc))

    def _all_sync(self, events: Sequence[OutboxEvent]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for event in events:
            try:
                self.fn(event)
                outcomes.append(None)
            except Exception as exc:  # noqa: BLE001 - any failure of user code is an outcome
                outcomes.append(exc)
        return outcomes


def as_publisher(obj: Any) -> Any:
    """An object with ``publish_batch`` is used as it is; a callable is wrapped."""
    if hasattr(obj, "publish_batch"):
        return obj
    if callable(obj):
        return FunctionPublisher(obj)
    raise TypeError(f"not a publisher: {obj!r} (need publish_batch() or a callable taking one event)")


def load_publisher(spec: str) -> Any:
    """Load ``module:attribute``; a class or factory taking no arguments is called once."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--publisher must look like module:callable, got {spec!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if inspect.isclass(obj):
        obj = obj()
    return as_publisher(obj)


def print_event(event: OutboxEvent) -> None:
    """A publisher for trying things out: prints each event on one line
    (``outboxpg-worker --publisher outboxpg.publishers:print_event``)."""
    print(f"{event.id} {event.subject} msg_id={event.msg_id} attempt={event.attempt} "
          f"{event.payload.decode('utf-8', 'replace')}", flush=True)

