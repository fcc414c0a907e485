"""The CLI's plain-text rendering: aligned tables, label/value lists, JSON-ready rows."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from outboxpg.cli.render import Lines, cell, counts_by_type, id_list, jsonable, pairs, table


def test_cells_for_people() -> None:
    assert [cell(None), cell(True), cell(False), cell(3), cell(dt.timedelta(seconds=90))] == ["", "yes", "no", "3",
                                                                                                "1 min 30 s"]
    assert cell(dt.datetime(2026, 11, 23, 18, 55, 42, 123456)) == "2026-11-23 18:55:42"


def test_a_table_aligns_numbers_right_and_the_rest_left() -> None:
    assert table(["state", "events"], [["pending", 5], ["dead", 1200], ["published", None]]) == [
        "  state      events",
        "  ---------  ------",
        "  pending         5",
        "  dead         1200",
        "  published",
    ]
    assert table(["a"], []) == ["  a", "  -"]


def test_pairs_pad_labels_and_indent_continued_lines() -> None:
    assert pairs([("id", 7), ("payload", Lines('{\n  "a": 1\n}')), ("empty", "")]) == [
        "  id       7",
        "  payload  {",
        '             "a": 1',
        "           }",
        "  empty",
    ]


def test_control_characters_are_escaped_in_every_value_one_line_stays_one() -> None:
    """Issue 25 (10): what producers write (aggregate ids, header values, errors quoting them)
    is printed with its control characters escaped: no new line, no terminal escape sequence."""
    hostile = "o-1\x1b]0;x\x07\x1b[2J\rforged\nline\x9b\u2028"
    escaped = "o-1\\x1b]0;x\\x07\\x1b[2J\\rforged\\nline\\x9b\\u2028"
    assert cell(hostile) == escaped
    assert pairs([("last_error", "boom\nDETAIL: x"), ("aggregate_id", hostile)]) == [
        "  last_error    boom\\nDETAIL: x",
        f"  aggregate_id  {escaped}",
    ]
    assert table(["aggregate"], [[hostile]])[2] == f"  {escaped}"
    # Lines keep their own line breaks and escape the rest.
    assert cell(Lines("a\x1b[2J\nb\r")) == "a\\x1b[2J\nb\\r"


def test_jsonable_turns_intervals_into_seconds_and_decimals_into_floats() -> None:
    row = {"age": dt.timedelta(minutes=2), "rate": Decimal("1.5"), "id": 3}
    assert jsonable(row) == {"age_seconds": 120.0, "rate": 1.5, "id": 3}


def test_counts_by_type_most_frequent_first() -> None:
    rows = [{"aggregate_type": a, "event_type": e} for a, e in
            [("order", "paid"), ("order", "created"), ("order", "created"), ("invoice", "issued")]]
    assert counts_by_type(rows) == ["  aggregate_type  event_type  events",
                                    "  --------------  ----------  ------",
                                    "  order           created          2",
                                    "  invoice         issued           1",
                                    "  order           paid             1"]


def test_id_lists_are_cut_after_the_limit() -> None:
    assert id_list([1, 2, 3]) == "1, 2, 3"
    assert id_list(list(range(1, 41)), limit=2) == "1, 2, ... (38 more)"
