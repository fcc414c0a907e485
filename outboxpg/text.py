"""Text for people, shared by the relay and the command lines: an exception as one line (for a
log line, a command line's message or an event's last_error), a duration, and the first line of
a long text cut to a width."""

from __future__ import annotations

import datetime as dt
import re

__all__ = ["age", "clip_first_line", "describe", "first_line", "join_lines", "printable"]

# What a terminal or a log reader may act on rather than show: the C0 controls (ESC starts an
# escape sequence, CR goes back to the start of the line, LF starts a new one), DEL, the C1
# controls (U+009B is a CSI on some terminals) and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def printable(text: str) -> str:
    """``text`` with every control character escaped as Python writes it (``\\r``, ``\\x1b``,
    ``\\u2028``): what the command lines print and the worker logs of producer-written values
    (aggregate ids, header values, errors quoting them) stays on its line and cannot drive the
    terminal. Everything else, backslashes included, is left as it is."""
    return _CONTROL.sub(_escape, text) if _CONTROL.search(text) else text


def describe(exc: BaseException, *, with_type: bool = True, whole: bool = False) -> str:
    """``exc`` as text: 'ValueError: its message' (``with_type``), only the message's first line
    unless ``whole`` (libpq's details follow on later lines); the class name alone when the
    exception has no message."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    if not whole:
        text = _every_host(text) or text.splitlines()[0].strip()
    return f"{type(exc).__name__}: {text}" if with_type else text


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its class name when it has no message."""
    return describe(exc, with_type=False)


_MULTI_HOST = "Multiple connection attempts failed. All failures were:"
_HOST_FAILED = "connection failed: "


def _every_host(text: str) -> str | None:
    """A multi-host DSN's connection error in one line: why each host failed (psycopg's first
    line names only the last one). None for any other text."""
    lines = text.splitlines()
    if _MULTI_HOST not in lines:
        return None
    reasons = [line.split(_HOST_FAILED, 1)[-1].strip() for line in lines[lines.index(_MULTI_HOST) + 1:]
               if line.startswith("- ")]
    return _HOST_FAILED + "; ".join(reasons) if reasons else None


def join_lines(text: str) -> str:
    """A message of several lines as one, nothing left out: a multi-host connection error as
    _every_host puts it (after what preceded it on its first line), any other text with its
    lines joined by blanks."""
    every_host = _every_host(text)
    first = text.splitlines()[0] if text else ""
    if every_host is not None:
        cut = first.find(_HOST_FAILED)
        return (first[:cut] if cut >= 0 else first + " ") + every_host
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def age(td: dt.timedelta | None) -> str:
    """A duration for people: '850 ms', '12.3 s', '4 min 05 s', '2 h 07 min', '3 d 04 h'."""
    if td is None:
        return ""
    s = td.total_seconds()
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 1:
        return f"{sign}{s * 1000:.0f} ms"
    if s < 60:
        return f"{sign}{s:.1f} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{sign}{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{sign}{h} h {m:02d} min"
    d, h = divmod(h, 24)
    return f"{sign}{d} d {h:02d} h"


def clip_first_line(text: str | None, width: int | None = None) -> str:
    """The first line of ``text`` only, for a table cell or a log field: cut to ``width``
    characters (ending in '...' when cut), else followed by ' ...' when more lines follow."""
    if text is None:
        return ""
    lines = text.strip().splitlines()
    first = lines[0] if lines else ""
    more = len(lines) > 1
    if width is not None and len(first) > width:
        return first[: max(width - 3, 1)] + "..."
    return first + (" ..." if more else "")
