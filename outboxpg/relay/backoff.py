"""The backoff schedules of the relay's reconnects and retries."""

from __future__ import annotations

__all__ = ["DB_MAX_DELAY", "FIRST_DELAY", "MAX_DELAY", "next_delay"]

FIRST_DELAY = 0.1   # seconds
MAX_DELAY = 5.0     # a server that comes back is noticed within this long
# PostgreSQL: the worker's claims, its LISTEN connection and its pool's reconnects. A server that
# comes back, or a standby promoted in its place (a multi-host DSN with
# target_session_attrs=read-write), is delivering again within about this long, however long the
# outage was: a refused or read-only host answers at once, so trying every second costs little.
DB_MAX_DELAY = 1.0


def next_delay(delay: float, cap: float = MAX_DELAY) -> float:
    """The pause after one of ``delay`` seconds: twice as long, at least FIRST_DELAY (so 0 starts
    the schedule: 0.1, 0.2, 0.4, ...), at most ``cap``."""
    return min(max(delay * 2, FIRST_DELAY), cap)
