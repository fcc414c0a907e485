"""A pytest plugin for an application's tests (docs/how-to/testing.md): "this request published
these events, in this order", against the application's real PostgreSQL, without a broker.

Registered by entry point (pytest11), so installing outboxpg is enough. Its fixtures:

- ``outbox_dsn``: the test database's connection string. The plugin cannot know it: override it
  in the application's conftest.py (``return`` the DSN of the database the test writes to).
- ``outbox_published``: an ``InMemoryPublisher``, one per test, that records what is published.
- ``outbox_drain``: ``outbox_drain()`` delivers every event due now to ``outbox_published``
  and returns the events it delivered; ``outbox_drain_async`` is the same for async tests
  (``await outbox_drain_async()``).

``drain`` / ``drain_async`` run the worker's own claim / publish / report path
(``Worker.run_until_idle``): events are claimed, published run by run in order, and completed
(or failed, retried, dead-lettered) by the same SQL functions as in production, until nothing is
claimable. A scheduled event that is not due, or a failed event waiting for its retry, is left.
Imports of the relay are deferred to the first drain: the plugin costs nothing in test runs
that do not use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from outboxpg.events import OutboxEvent

__all__ = ["InMemoryPublisher", "drain", "drain_async"]


class InMemoryPublisher:
    """A publisher that records the events it is given, in the order it is given them (the order
    of each aggregate's events is their id order; events of different aggregates come in the
    order they were claimed). Every event counts as delivered unless ``fail`` says otherwise."""

    def __init__(self) -> None:
        self.events: list[OutboxEvent] = []
        # Called with each event before it is recorded: an exception it returns is the event's
        # outcome (retried; a PermanentError dead-letters it), None delivers it.
        self.fail: Callable[[OutboxEvent], BaseException | None] | None = None

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        from outboxpg.relay.publishers import NotSent

        outcomes: list[BaseException | None] = []
        stopped: set[tuple[str, str]] = set()      # aggregates whose run failed: nothing after it
        for event in events:
            aggregate = (event.aggregate_type, event.aggregate_id)
            if aggregate in stopped:
                outcomes.append(NotSent(f"an earlier event of {aggregate} failed"))
                continue
            outcome = self.fail(event) if self.fail is not None else None
            if outcome is None:
                self.events.append(event)
            else:
                stopped.add(aggregate)
            outcomes.append(outcome)
        return outcomes

    @property
    def subjects(self) -> list[str]:
        return [e.subject for e in self.events]

    @property
    def event_types(self) -> list[str]:
        return [e.event_type for e in self.events]

    @property
    def payloads(self) -> list[Any]:
        """Each payload parsed from JSON."""
        return [e.json() for e in self.events]

    def clear(self) -> None:
        self.events.clear()


async def drain_async(dsn: str, publisher: Any, batch_size: int = 100) -> list[OutboxEvent]:
    """Deliver every event claimable now to ``publisher`` (an InMemoryPublisher, or any
    publisher or function a worker takes) through the worker's claim and report path, until
    nothing is claimable. Returns the events an InMemoryPublisher recorded in this drain (for
    another publisher: an empty list)."""
    from outboxpg.relay.worker import Worker, WorkerConfig

    before = len(publisher.events) if isinstance(publisher, InMemoryPublisher) else 0
    # No report connection kept warm: the pools last one drain (about 80 ms a drain, against
    # 120-140 ms with the worker's two, each planned by a warm-up before the first claim).
    config = WorkerConfig(dsn=dsn, batch_size=batch_size, concurrency=1, poll_only=True, name="outboxpg.testing",
                          maintenance_interval=0, xmin_check_interval=0, summary_interval=3600,
                          report_connections=0)
    await Worker(config, publisher).run_until_idle()
    return publisher.events[before:] if isinstance(publisher, InMemoryPublisher) else []


def drain(dsn: str, publisher: Any, batch_size: int = 100) -> list[OutboxEvent]:
    """drain_async() for code outside an event loop (a sync test)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(drain_async(dsn, publisher, batch_size))
    raise RuntimeError("drain() called inside a running event loop: await drain_async() "
                       "(the outbox_drain_async fixture) instead")


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture
def outbox_dsn() -> str:
    """The connection string of the database the test writes events to: override this fixture
    in your conftest.py."""
    raise pytest.UsageError("outboxpg.testing: define an `outbox_dsn` fixture in your conftest.py that returns "
                            "the connection string of your test database (docs/how-to/testing.md)")


@pytest.fixture
def outbox_published() -> InMemoryPublisher:
    """What outbox_drain published in this test, in order."""
    return InMemoryPublisher()


@pytest.fixture
def outbox_drain(outbox_dsn: str, outbox_published: InMemoryPublisher) -> Callable[[], list[OutboxEvent]]:
    """``outbox_drain()``: deliver every event due now to outbox_published; returns those events."""
    return lambda: drain(outbox_dsn, outbox_published)


@pytest.fixture
def outbox_drain_async(outbox_dsn: str,
                       outbox_published: InMemoryPublisher) -> Callable[[], Awaitable[list[OutboxEvent]]]:
    """``await outbox_drain_async()``: outbox_drain for async tests."""
    return lambda: drain_async(outbox_dsn, outbox_published)
