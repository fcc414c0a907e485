"""outboxpg.text: an exception as one line, a multi-line message joined, a duration, a long text
clipped to its first line."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st

from outboxpg.text import age, clip_first_line, describe, first_line, join_lines, printable

# What psycopg says when no host of a multi-host DSN could be reached: only its first line names
# a host, and the last one tried at that.
MULTI_HOST = ('connection failed: connection to server at "10.0.0.2", port 5432 failed: Connection refused\n'
              'Multiple connection attempts failed. All failures were:\n'
              '- host: \'10.0.0.1\', port: \'5432\', hostaddr: \'10.0.0.1\': connection failed: connection to '
              'server at "10.0.0.1", port 5432 failed: Connection refused\n'
              '- host: \'10.0.0.2\', port: \'5432\', hostaddr: \'10.0.0.2\': connection failed: connection to '
              'server at "10.0.0.2", port 5432 failed: session is read-only')
EVERY_HOST = ('connection failed: connection to server at "10.0.0.1", port 5432 failed: Connection refused; '
              'connection to server at "10.0.0.2", port 5432 failed: session is read-only')


def test_describe_gives_the_type_and_the_first_line() -> None:
    exc = ValueError("  bad value\nDETAIL: more  ")
    assert describe(exc) == "ValueError: bad value"
    assert describe(exc, with_type=False) == first_line(exc) == "bad value"
    assert describe(exc, whole=True) == "ValueError: bad value\nDETAIL: more"
    assert describe(TimeoutError()) == first_line(TimeoutError()) == "TimeoutError"


def test_a_multi_host_connection_error_names_every_host() -> None:
    assert first_line(OSError(MULTI_HOST)) == EVERY_HOST
    assert describe(OSError(MULTI_HOST)) == f"OSError: {EVERY_HOST}"
    assert join_lines(MULTI_HOST) == EVERY_HOST
    assert join_lines("pool: " + MULTI_HOST) == "pool: " + EVERY_HOST


def test_join_lines_keeps_every_line_of_any_other_text() -> None:
    assert join_lines("error: x\n  DETAIL: y\n\nHINT: z") == "error: x DETAIL: y HINT: z"
    assert join_lines("") == ""


@given(st.text())
def test_what_is_meant_for_one_line_is_one_line(text: str) -> None:
    assert "\n" not in join_lines(text) and "\n" not in first_line(RuntimeError(text))
    assert "\n" not in clip_first_line(text, 20) and len(clip_first_line(text, 20)) <= 20 + len(" ...")


def test_clip_first_line_cuts_to_the_width_or_says_more_follows() -> None:
    assert clip_first_line(None) == ""
    assert clip_first_line("short") == "short"
    assert clip_first_line("first\nsecond") == "first ..."
    assert clip_first_line("x" * 30, 10) == "xxxxxxx..."
    assert clip_first_line("  padded  \n") == "padded"


def test_age_says_a_duration_for_people() -> None:
    cases = {0.85: "850 ms", 12.34: "12.3 s", 245: "4 min 05 s", 7620: "2 h 07 min", 3 * 86400 + 4 * 3600: "3 d 04 h",
             -12.34: "-12.3 s"}
    assert {s: age(timedelta(seconds=s)) for s in cases} == cases
    assert age(None) == ""


def test_printable_escapes_control_characters_and_nothing_else() -> None:
    assert printable("o-1\x1b]0;x\x07\x1b[2J\rforged\nline\tx\x00\x7f\x85\x9b\u2028\u2029") == \
        "o-1\\x1b]0;x\\x07\\x1b[2J\\rforged\\nline\\tx\\x00\\x7f\\x85\\x9b\\u2028\\u2029"
    plain = "é \\ 'quoted' \u202e \U0001f600"
    assert printable(plain) is plain


@given(st.text())
def test_printable_text_is_one_line(text: str) -> None:
    assert len(printable(text).splitlines()) <= 1
