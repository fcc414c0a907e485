"""``outboxpg replay``: re-send published events as new events (outbox_replay, migration 0018).

The filters are declared once, in ReplayFilters: each field is a flag (``ids``: --id) and the
argument of the same name of outbox_replay_candidates / outbox_replay (``ids => ...``). The
command asks outbox_replay_candidates how many events match and which, shows them (``--dry-run``
stops there, listing each event with the msg_id its copy will carry), asks for confirmation as
``dead requeue`` does (more than one event: on the terminal, or --yes), then replays exactly the
ids it showed: an event published meanwhile is not added. More matches than --max-events
(10,000): refused before anything is copied, as outbox_replay itself refuses them (all or
nothing), and the dry run says so. Copies made by earlier replays are not candidates unless
--include-replays: replaying an aggregate twice sends its events twice, not its events and the
first copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outboxpg import statements
from outboxpg.cli.common import add_dsn, add_yes, announce_target, confirm, open_outbox, point_in_time, require_target
from outboxpg.cli.errors import EXIT_USAGE, CliError
from outboxpg.cli.options import add_options, from_args
from outboxpg.cli.render import counts_by_type, id_list, table
from outboxpg.option import option
from outboxpg.replays import DEFAULT_MAX_EVENTS, FILTERS, PARAMETERS, arguments, replay
from outboxpg.text import first_line

__all__ = ["ReplayFilters", "register"]

_WHEN = "an interval ago ('1 hour', '2 days') or a timestamp ('2026-11-22 10:00', 'today'), read by PostgreSQL"


@dataclass
class ReplayFilters:
    """outbox_replay's parameters, in its order. None: not a filter. No environment variables:
    a filter left in the environment must not widen or narrow a replay unseen."""

    ids: list[int] | None = option("only these event ids (repeat the flag, or a comma-separated list)", None,
                                   metavar="ID[,ID...]", flag="--id", environment=False)
    aggregate_type: str | None = option("only this aggregate_type", None, metavar="A", environment=False)
    aggregate_id: str | None = option("only this aggregate_id", None, metavar="ID", environment=False)
    event_type: str | None = option("only this event_type", None, metavar="T", environment=False)
    since: str | None = option(f"only events created at or after this: {_WHEN}", None,
                               metavar="INTERVAL_OR_TIMESTAMP", environment=False)
    until: str | None = option(f"only events created before this: {_WHEN}", None,
                               metavar="INTERVAL_OR_TIMESTAMP", environment=False)
    new_msg_id: bool = option("give each copy a new msg_id, so that JetStream stores it even inside its duplicate "
                              "window (a forced redelivery); default: the original msg_id, which JetStream drops "
                              "while it remembers the original", False, environment=False)
    max_events: int = option("replay at most N events: when more match, nothing is replayed (narrow the filters, or "
                             "raise N)", DEFAULT_MAX_EVENTS, metavar="N", environment=False)
    include_replays: bool = option("also replay the copies made by earlier replays (by default only the events "
                                   "producers wrote are replayed, so that replaying twice does not compound)", False,
                                   environment=False)


assert tuple(f.name for f in dataclasses.fields(ReplayFilters)) == tuple(PARAMETERS), "one flag per SQL parameter"
_TIMES = ("since", "until")
NO_FILTER = ("which events? give --id, --aggregate-type, --aggregate-id, --event-type, --since or --until "
             "(replaying every published event is refused)")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "replay", help="re-send published events (still in the table) as new events, in their original order",
        description="Copy the published events the filters match (combined with AND) as new events, in their "
                    "original order per aggregate, through outbox_replay(). The copies keep each event's msg_id "
                    "unless --new-msg-id. Asks before replaying more than one event, unless --yes.")
    add_dsn(p)
    add_options(p, ReplayFilters)
    p.add_argument("--dry-run", action="store_true",
                   help="only show how many and which events would be replayed, each with the msg_id it would carry")
    add_yes(p)
    p.set_defaults(func=cmd_replay)


def _filters(conn: psycopg.Connection[Any], filters: ReplayFilters) -> dict[str, Any]:
    """The given filters, since and until as timestamps, and include_replays."""
    values = {name: getattr(filters, name) for name in FILTERS if getattr(filters, name) is not None}
    for name in _TIMES:
        if name in values:
            values[name] = point_in_time(conn, values[name], f"--{name}")
    return {**values, "include_replays": filters.include_replays}


def _candidates(conn: psycopg.Connection[Any], values: dict[str, Any], first: int) -> tuple[int, list[dict[str, Any]]]:
    """How many published events match, and the first ``first`` of them (none when more match)."""
    try:
        with conn.cursor(row_factory=dict_row) as cur:
            count = cur.execute(statements.REPLAY_COUNT.format(arguments(values)), values).fetchone()
            n = int(count["count"]) if count else 0
            if n == 0 or n > first:
                return n, []
            return n, cur.execute(statements.REPLAY_CANDIDATES.format(arguments(values)),
                                  {**values, "first": first}).fetchall()
    except psycopg.errors.InvalidParameterValue as exc:   # since not before until
        raise CliError(first_line(exc), EXIT_USAGE) from None


def _not_published(conn: psycopg.Connection[Any], given: list[int], rows: list[dict[str, Any]],
                   include_replays: bool) -> list[str]:
    """A note per given id that is not a published event (as ``dead requeue`` notes ids not dead),
    or is a copy made by an earlier replay (without --include-replays); published ids that the
    other filters leave out are not noted: the filters combine with AND."""
    matched = {r["id"] for r in rows}
    rest = sorted(set(given) - matched)
    found = {i: (state, of) for i, state, of in conn.execute(statements.REPLAY_STATE_BY_ID, (rest,)).fetchall()}
    notes = []
    for i in rest:
        state, of = found.get(i, ("no such event", None))
        if state != "published":
            notes.append(f"{i} ({state})")
        elif of is not None and not include_replays:
            notes.append(f"{i} (a copy of {of}: --include-replays)")
    return notes


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _describe(rows: list[dict[str, Any]]) -> list[str]:
    """How many, which ids and creation times, which aggregates, and the counts per type."""
    created = [r["created_at"] for r in rows]
    aggregates = {(r["aggregate_type"], r["aggregate_id"]) for r in rows}
    first, last = min(created), max(created)
    return [f"  ids {rows[0]['id']}..{rows[-1]['id']}, created {first.isoformat(sep=' ', timespec='seconds')} .. "
            f"{last.isoformat(sep=' ', timespec='seconds')}, {_plural(len(aggregates), 'aggregate')}",
            *counts_by_type(rows)]


def _each(rows: list[dict[str, Any]], new_msg_id: bool) -> list[str]:
    """One line per event, in the order the copies are made: what each copy carries."""
    return table(["id", "aggregate", "event_type", "msg_id", "copy of"],
                 [[r["id"], f"{r['aggregate_type']}/{r['aggregate_id']}", r["event_type"],
                   "(new)" if new_msg_id else r["msg_id"], r["replay_of"]] for r in rows])


def _msg_id_note(new_msg_id: bool) -> str:
    if new_msg_id:
        return "each copy gets a new msg_id: JetStream stores it again (a forced redelivery)"
    return ("the copies keep their msg_id: JetStream drops those whose original is still inside the stream's "
            "duplicate window (--new-msg-id delivers them again)")


def cmd_replay(args: argparse.Namespace) -> int:
    filters: ReplayFilters = from_args(ReplayFilters, args)
    if all(getattr(filters, name) is None for name in FILTERS):
        raise CliError(NO_FILTER, EXIT_USAGE)
    if filters.max_events < 1:
        raise CliError(f"--max-events must be 1 or more, got {filters.max_events}", EXIT_USAGE)
    if not args.dry_run:
        require_target(args, "outboxpg replay")
    with open_outbox(args) as conn:
        values = _filters(conn, filters)
        n, rows = _candidates(conn, values, filters.max_events)
        if n > filters.max_events:
            too_many = (f"{_plural(n, 'published event')} match, more than --max-events ({filters.max_events}): "
                        "a replay copies all or none; narrow the filters (--since, --until, --aggregate-type, ...) "
                        "or raise --max-events")
            if args.dry_run:
                print(f"Would replay none: {too_many}\n(dry run: nothing changed)")
                return 1
            raise CliError(f"nothing replayed: {too_many}")
        notes = _not_published(conn, filters.ids, rows, filters.include_replays) if filters.ids else []
        if notes:
            print(f"outboxpg: not published, left alone: {', '.join(notes)}", file=sys.stderr)
        if not rows:
            print("no published events match: nothing to replay")
            return 1 if notes else 0
        n = len(rows)
        details = [f"{'Would replay' if args.dry_run else 'About to replay'} {_plural(n, 'published event')}"
                   f"{', including copies made by earlier replays' if filters.include_replays else ''}:",
                   *_describe(rows), _msg_id_note(filters.new_msg_id)]
        if args.dry_run:
            # Exactly what would be sent: each event, with the msg_id its copy would carry.
            print("\n".join([*details[:-1], *_each(rows, filters.new_msg_id), details[-1],
                             "(dry run: nothing changed)"]))
            return 1 if notes else 0
        if n > 1:
            confirm(f"Replay these {n} published events?", details, f"replay {n} events", args.yes)
        # Exactly the events shown: those published since are not added.
        ids = [r["id"] for r in rows]
        announce_target(conn, f"replaying {_plural(n, 'event')} in")
        done = replay(conn, **{**values, "ids": ids}, new_msg_id=filters.new_msg_id, max_events=filters.max_events)
    copies = "new msg_id" if filters.new_msg_id else "same msg_id"
    print(f"replayed {_plural(done, 'event')} as new events ({copies}): {id_list(ids)}")
    if done < n:
        print(f"outboxpg: {n - done} of the selected events were gone (their partition dropped) and were not replayed",
              file=sys.stderr)
        return 1
    return 1 if notes else 0
