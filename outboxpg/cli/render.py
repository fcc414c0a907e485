"""Plain-text rendering for the CLI: aligned tables, label/value lists, JSON-ready rows (ages and
clipped lines are outboxpg.text's, shared with the relay).

Every value goes through cell(), which escapes control characters (outboxpg.text.printable):
producers write aggregate ids, header values and subjects, and what they wrote must neither
start a new line nor drive the terminal. Text whose line breaks are the command's own (indented
JSON) is a Lines value: its lines are escaped one by one."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from decimal import Decimal
from typing import Any

from outboxpg.text import age, printable

__all__ = ["Lines", "cell", "table", "pairs", "jsonable", "counts_by_type", "id_list"]


class Lines(str):
    """Text of several lines whose line breaks (\\n) are the command's own, e.g. JSON it
    indented; any other control character in it is still escaped."""


def cell(value: Any) -> str:
    """One value as table text, on one line (control characters escaped), but a Lines value."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dt.datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, dt.timedelta):
        return age(value)
    if isinstance(value, Lines):
        return "\n".join(map(printable, value.split("\n")))
    return printable(str(value))


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float, Decimal)) and not isinstance(value, bool)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "  ") -> list[str]:
    """An aligned table: numbers right-aligned, everything else left-aligned."""
    rows = [list(r) for r in rows]
    texts = [[cell(v) for v in r] for r in rows]
    widths = [len(h) for h in headers]
    for t in texts:
        widths = [max(w, len(c)) for w, c in zip(widths, t)]
    right = [bool(rows) and all(_numeric(r[i]) or r[i] is None for r in rows) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return (indent + "  ".join(parts)).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(t) for t in texts)]


def pairs(items: Iterable[tuple[str, Any]], indent: str = "  ") -> list[str]:
    """Label/value lines, labels padded to one width. The lines of a Lines value continue indented."""
    items = [(k, cell(v)) for k, v in items]
    width = max((len(k) for k, _ in items), default=0)
    out = []
    for k, v in items:
        first, *rest = v.split("\n")
        out.append(f"{indent}{k.ljust(width)}  {first}".rstrip())
        out.extend(f"{indent}{' ' * width}  {line}".rstrip() for line in rest)
    return out


def jsonable(row: Mapping[str, Any]) -> dict[str, Any]:
    """A row for orjson: intervals become seconds (the key gets a _seconds suffix), Decimals floats;
    datetimes, UUIDs and JSON values are left to orjson."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if isinstance(v, dt.timedelta):
            out[f"{k}_seconds"] = v.total_seconds()
        elif isinstance(v, Decimal):
            out[k] = float(v)
        else:
            out[k] = v
    return out


def counts_by_type(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """How many of ``rows`` per (aggregate_type, event_type), the most frequent first, as a table."""
    counts = Counter((r["aggregate_type"], r["event_type"]) for r in rows)
    return table(["aggregate_type", "event_type", "events"],
                 [[a, e, n] for (a, e), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))])


def id_list(ids: Sequence[int], limit: int = 20) -> str:
    """'1, 2, 3' or, past ``limit``, '1, 2, ... (40 more)'."""
    text = ", ".join(map(str, ids[:limit]))
    return text + (f", ... ({len(ids) - limit} more)" if len(ids) > limit else "")
