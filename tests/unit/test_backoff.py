"""The one pause schedule of the relay's reconnects and retries."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from outboxpg.relay.backoff import DB_MAX_DELAY, FIRST_DELAY, MAX_DELAY, next_delay


def schedule(cap: float, n: int) -> list[float]:
    delays, delay = [], 0.0
    for _ in range(n):
        delay = next_delay(delay, cap)
        delays.append(delay)
    return delays


def test_the_schedule_doubles_from_the_first_delay_up_to_its_cap() -> None:
    assert schedule(MAX_DELAY, 8) == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert schedule(DB_MAX_DELAY, 6) == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert next_delay(0.2) == 0.4, "the default cap is MAX_DELAY"


@given(st.floats(0, 100, allow_nan=False), st.floats(FIRST_DELAY, 60, allow_nan=False))
def test_a_pause_never_shrinks_and_stays_within_its_bounds(delay: float, cap: float) -> None:
    after = next_delay(delay, cap)
    assert FIRST_DELAY <= after <= cap
    assert after >= min(delay, cap)
