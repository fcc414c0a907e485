"""The one backoff schedule of the relay's reconnects and retries."""

from __future__ import annotations

__all__ = ["FIRST_DELAY", "MAX_DELAY", "next_delay"]

FIRST_DELAY = 0.1   # seconds
MAX_DELAY = 5.0     # a server that comes back is noticed within this long


def next_delay(delay: float) -> float:
    """The pause after one of ``delay`` seconds: twice as long, at least FIRST_DELAY (so 0 starts
    the schedule: 0.1, 0.2, 0.4, ...), at most MAX_DELAY."""
    return min(max(delay * 2, FIRST_DELAY), MAX_DELAY)
