"""A publisher that does nothing (``--publisher null_publisher:publish`` with bench/ on the
path): what the worker and the database cost without a broker."""

from __future__ import annotations

from typing import Any


async def publish(event: Any) -> None:
    return None
