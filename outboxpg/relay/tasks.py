"""Stopping background tasks for good.

``task.cancel()`` asks once, and a task can miss the request: on Python 3.11,
``asyncio.wait_for`` (which psycopg_pool's getconn waits in) drops a cancellation that arrives
as the awaited future completes, and the task goes on, here into its next sleep. A worker that
awaited such a task after one cancel() never stopped (seen with SIGTERM a few milliseconds after
start, while the xmin watch took its first connection). ``cancel_all`` asks again until every
task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

__all__ = ["cancel_all", "say_where_after", "where_tasks_wait"]

log = logging.getLogger("outboxpg.worker")


async def cancel_all(tasks: Sequence[asyncio.Task[None]], every: float = 0.2) -> None:
    """Cancel ``tasks`` and wait for all to end, cancelling again every ``every`` seconds any
    that is still running; what they raise on the way out is dropped."""
    pending = [t for t in tasks if not t.done()]
    while pending:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=every)
        pending = [t for t in pending if not t.done()]
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            task.result()


def where_tasks_wait() -> list[str]:
    """'name: function (file:line)' of every other task of the running loop, where its innermost
    coroutine waits."""
    here = asyncio.current_task()
    found = []
    for task in asyncio.all_tasks():
        if task is here or task.done():
            continue
        frames = task.get_stack()
        where = (f"{frames[-1].f_code.co_name} ({frames[-1].f_code.co_filename.rsplit('/', 1)[-1]}:"
                 f"{frames[-1].f_lineno})") if frames else "?"
        found.append(f"{task.get_name()}: {where}")
    return sorted(found)


async def say_where_after(seconds: float, worker: str) -> None:
    """Once, if still running after ``seconds``: a WARNING naming where every task waits. Started
    when a worker is asked to stop: a shutdown that takes long says what it waits for."""
    await asyncio.sleep(seconds)
    log.warning("event=shutdown_slow worker=%s after_s=%g waiting=%r", worker, seconds, "; ".join(where_tasks_wait()))
