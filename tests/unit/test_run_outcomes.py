"""How a claimed batch falls into runs (runs_of), how the worker reads a batch's outcomes run by
run (split_runs), the short runs set apart from the long ones (split_short_runs), and the NotSent
outcome of what follows a run's failure (not_sent_after)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from workers import event

from outboxpg.events import OutboxEvent, runs_of
from outboxpg.relay.publishers import NotSent, PermanentError, not_sent_after
from outboxpg.relay.worker import split_runs, split_short_runs


def batch(aggregates: list[str]) -> list[OutboxEvent]:
    """Events with ids 1, 2, ... in batch order, of the aggregates named (order/<name>)."""
    return [event(i, "x", aggregate_id=a) for i, a in enumerate(aggregates, start=1)]


def test_runs_are_grouped_by_aggregate_in_order_of_first_appearance() -> None:
    events = batch(["a", "b", "a", "c", "b", "a"])
    assert runs_of(events) == [[0, 2, 5], [1, 4], [3]]
    assert runs_of([]) == []


def test_the_aggregate_type_is_part_of_the_key() -> None:
    events = [event(1, "x", aggregate_type="order", aggregate_id="7"),
              event(2, "x", aggregate_type="invoice", aggregate_id="7")]
    assert runs_of(events) == [[0], [1]]


@given(st.lists(st.sampled_from("abcde"), max_size=40))
def test_runs_partition_the_batch_and_keep_its_order(aggregates: list[str]) -> None:
    events = batch(aggregates)
    runs = runs_of(events)
    assert sorted(i for run in runs for i in run) == list(range(len(events)))
    for run in runs:
        assert run == sorted(run)
        assert len({(events[i].aggregate_type, events[i].aggregate_id) for i in run}) == 1
    assert [run[0] for run in runs] == sorted(run[0] for run in runs)
    assert len(runs) == len(set(aggregates))


def test_split_runs_releases_what_follows_a_failure_whatever_its_outcome() -> None:
    events = batch(["a", "b", "a", "a", "b"])
    boom = RuntimeError("boom")
    # a: delivered, failed, "delivered" (released: its predecessor failed); b: delivered twice.
    delivered, failed, released = split_runs(events, [None, None, boom, None, None])
    assert [e.id for e in delivered] == [1, 2, 5]
    assert failed == [(events[2], boom)]
    assert released == [4]


def test_split_runs_counts_only_a_runs_first_failure() -> None:
    events = batch(["a", "a", "a"])
    first, second = PermanentError("too large"), RuntimeError("later")
    delivered, failed, released = split_runs(events, [first, second, None])
    assert delivered == [] and failed == [(events[0], first)] and released == [2, 3]


@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), max_size=30))
def test_split_runs_gives_each_run_a_delivered_prefix_then_at_most_one_failure(cases: list[tuple[str, bool]]) -> None:
    events = batch([a for a, _ in cases])
    outcomes = [RuntimeError(str(i)) if fails else None for i, (_, fails) in enumerate(cases)]
    delivered, failed, released = split_runs(events, outcomes)
    ids = [e.id for e in delivered] + [e.id for e, _ in failed] + released
    assert sorted(ids) == [e.id for e in events], "every event once"
    for run in runs_of(events):
        run_ids = [events[i].id for i in run]
        first_failure = next((n for n, i in enumerate(run) if outcomes[i] is not None), len(run))
        assert [e.id for e in delivered if e.id in run_ids] == run_ids[:first_failure]
        assert [e.id for e, _ in failed if e.id in run_ids] == run_ids[first_failure:first_failure + 1]
        assert [i for i in released if i in run_ids] == run_ids[first_failure + 1:]


def test_not_sent_after_names_the_failed_event_and_leaves_the_rest_alone() -> None:
    events = batch(["a", "a", "a", "b"])
    outcomes: list[BaseException | None] = [None] * 4
    not_sent_after(events, [1, 2], 1, outcomes)
    assert outcomes[0] is None and outcomes[3] is None
    assert isinstance(outcomes[1], NotSent) and outcomes[1] is outcomes[2]
    assert str(outcomes[1]) == "not sent: event 1 of its aggregate failed before it"
    not_sent_after(events, [], 3, outcomes)   # nothing after the failure: nothing changes
    assert outcomes[3] is None


@given(st.lists(st.sampled_from("abcd"), max_size=40), st.integers(min_value=1, max_value=6))
def test_short_runs_are_set_apart_whole_and_in_order(aggregates: list[str], most: int) -> None:
    events = batch(aggregates)
    short, long = split_short_runs(events, most)
    assert sorted(e.id for e in short + long) == [e.id for e in events]          # each event once
    assert [e.id for e in short] == sorted(e.id for e in short)
    assert [e.id for e in long] == sorted(e.id for e in long)
    for part, fits in ((short, True), (long, False)):
        for run in runs_of(part):                # whole runs: every event of an aggregate on one side
            assert (len(run) <= most) is fits
            assert len(run) == aggregates.count(part[run[0]].aggregate_id)
