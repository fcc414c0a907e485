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
from collections.abc import Sequence

__all__ = ["cancel_all"]


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
