"""One relay process over several databases: a Worker per database (its own pool, LISTEN
connection, wakeup lock, claims, maintenance), all publishing through one publisher, with the
batches in flight across them bounded and handed out in turn (FairSlots).

    fleet = Fleet(publisher, max_in_flight=4000)   # events being published at once, in all
    await fleet.open()                       # starts the publisher
    fleet.start("shop@db:5432", WorkerConfig(dsn="host=db dbname=shop"))
    fleet.start("billing@db:5432", WorkerConfig(dsn="host=db dbname=billing"))
    ...
    await fleet.remove("billing@db:5432")    # finishes its in-flight batches, then stops it
    await fleet.close()                      # every worker, then the publisher

A database down or slow holds up only its own Worker: its claims and reports wait on its own
pool, and a slot is held only while a batch is being published (never while a claim or a report
waits on its database). Log records written by a database's tasks carry its label (``DATABASE``, a context
variable every task a Worker starts inherits; ``DatabaseLabelFilter`` writes it into the line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextvars import ContextVar
from typing import Any

from outboxpg.relay.config import WorkerConfig
from outboxpg.relay.metrics import WorkerMetrics
from outboxpg.relay.publishers import as_publisher
from outboxpg.relay.slots import FairSlots
from outboxpg.relay.worker import Worker
from outboxpg.text import describe

__all__ = ["DATABASE", "DatabaseLabelFilter", "Fleet"]

log = logging.getLogger("outboxpg.worker")

# The label of the database whose Worker (or start-up check) wrote a log record; None: the process's own.
DATABASE: ContextVar[str | None] = ContextVar("outboxpg_database", default=None)


class DatabaseLabelFilter(logging.Filter):
    """Adds ``database=<label>`` after a record's ``event=...`` (or at its start) when a
    database's task wrote it. Off (nothing added) for a process over one database given by
    --dsn, whose lines stay as they were."""

    def filter(self, record: logging.LogRecord) -> bool:
        label = DATABASE.get()
        if label is None:
            return True
        text = record.getMessage()
        if " database=" in text:
            return True
        first, sep, rest = text.partition(" ")
        if first.startswith("event="):
            text = f"{first} database={label}{sep}{rest}"
        else:
            text = f"database={label} {text}"
        record.msg, record.args = text, None
        return True


class Fleet:
    def __init__(self, publisher: Any, max_in_flight: int, *, label_logs: bool = True) -> None:
        self.publisher = as_publisher(publisher)
        self.slots = FairSlots(max_in_flight)
        self.label_logs = label_logs
        self.workers: dict[str, Worker] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def open(self) -> None:
        """Start the publisher (once, for every database): what a single Worker's run() does."""
        if hasattr(self.publisher, "start"):
            await self.publisher.start()

    def start(self, label: str, cfg: WorkerConfig, metrics: WorkerMetrics | None = None) -> Worker:
        """Start delivering from the database ``label`` (a Worker of its own, sharing the publisher)."""
        if label in self.workers:
            raise ValueError(f"database {label!r} is served already")
        worker = Worker(cfg, self.publisher, metrics, slots=self.slots, owns_publisher=False)
        token = DATABASE.set(label) if self.label_logs else None
        try:
            # The task copies the context now: the Worker and every task it starts log the label.
            task = asyncio.create_task(self._run(label, worker), name=f"outboxpg-database {label}")
        finally:
            if token is not None:
                DATABASE.reset(token)
        self.workers[label] = worker
        self._tasks[label] = task
        return worker

    async def _run(self, label: str, worker: Worker) -> None:
        try:
            await worker.run()
        except Exception as exc:  # noqa: BLE001 - one database's crash must not end the others
            log.error("event=database_worker_crashed database=%s error=%r", label, describe(exc))

    async def remove(self, label: str) -> None:
        """Stop delivering from ``label``: its in-flight batches are published and reported first."""
        worker = self.workers.pop(label, None)
        task = self._tasks.pop(label, None)
        if worker is None or task is None:
            return
        token = DATABASE.set(label) if self.label_logs else None
        try:
            worker.stop()
        finally:
            if token is not None:
                DATABASE.reset(token)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def running(self) -> bool:
        """Whether any database's Worker is still running."""
        return any(not t.done() for t in self._tasks.values())

    async def finished(self) -> None:
        """Until every Worker started so far has returned."""
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def stop(self) -> None:
        for label, worker in self.workers.items():
            token = DATABASE.set(label) if self.label_logs else None
            try:
                worker.stop()
            finally:
                if token is not None:
                    DATABASE.reset(token)

    async def close(self) -> None:
        """Stop every Worker (each finishes what it holds), then close the publisher."""
        self.stop()
        await self.finished()
        self.workers.clear()
        self._tasks.clear()
        if hasattr(self.publisher, "close"):
            with contextlib.suppress(Exception):
                await self.publisher.close()
