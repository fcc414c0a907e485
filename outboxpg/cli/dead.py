"""``outboxpg dead``: list, show, requeue and discard dead letters.

It reads the view outbox_dead_letters (held_back: what a dead letter holds back) and calls
outbox_requeue / outbox_discard; the table only for one event's every column (show), the state of
ids that are not dead, and the row locks of a repair. Filters travel as query parameters only;
the SQL text is built from the fixed fragments of outboxpg/statements.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from outboxpg import statements
from outboxpg.cli.common import (
    add_dsn,
    add_yes,
    announce_target,
    confirm,
    number_type,
    open_outbox,
    point_in_time,
    print_json,
    require_target,
)
from outboxpg.cli.errors import EXIT_USAGE, CliError
from outboxpg.cli.render import Lines, counts_by_type, id_list, pairs, table
from outboxpg.text import clip_first_line, printable

# Columns of outbox that dead show leaves out: what the partial indexes select on (0002), no
# information beyond state.
INTERNAL_COLUMNS = ("in_flow", "unfinished")
DEFAULT_MAX_BYTES = 4096

_event_id = number_type(int, "not an event id: {!r}", lambda v: v >= 1)
_max_bytes = number_type(int, "not a number of bytes: {!r}", lambda v: v >= 0, "must be 0 (all) or more: {!r}")


def _add_filters(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("filters (combined with AND)")
    g.add_argument("--event-type", metavar="T", help="only this event_type")
    g.add_argument("--aggregate-type", metavar="A", help="only this aggregate_type")
    g.add_argument("--aggregate-id", metavar="ID", help="only this aggregate_id")
    g.add_argument("--since", metavar="INTERVAL_OR_TIMESTAMP",
                   help="only dead since then: an interval ago ('1 hour', '2 days', '30 min') or a timestamp "
                        "('2026-11-22 10:00', 'today', 'yesterday'), read by PostgreSQL")


def register(sub: Any) -> None:
    dead = sub.add_parser("dead", help="dead letters: list, show, requeue, discard",
                          description="Dead events hold back the later events of their aggregate until they are "
                                      "requeued (tried again from attempt 1) or discarded (with a reason).")
    dsub = dead.add_subparsers(dest="dead_command", required=True, metavar="ACTION")

    p = dsub.add_parser("list", help="dead letters, newest first")
    add_dsn(p)
    _add_filters(p)
    p.add_argument("--limit", type=int, default=50, metavar="N", help="show at most N (default 50; 0: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_list)

    p = dsub.add_parser("show", help="one event, every column (payload, headers, last_error)")
    add_dsn(p)
    p.add_argument("id", type=_event_id, help="event id")
    p.add_argument("--max-bytes", type=_max_bytes, default=DEFAULT_MAX_BYTES, metavar="N",
                   help=f"show at most N bytes of the payload (default {DEFAULT_MAX_BYTES}; 0: all). A longer one "
                        "is cut, saying how much was left out; with --json it is then the cut JSON text, a "
                        "string, and payload_cut_bytes says how many bytes are missing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_show)

    for name, helptext in (("requeue", "send dead events back to pending, attempts reset"),
                           ("discard", "take dead events out of the flow for good, keeping a reason")):
        p = dsub.add_parser(name, help=helptext,
                            usage=f"%(prog)s [-h] [--dsn DSN] [--yes] "
                                  f"{'--reason TEXT ' if name == 'discard' else ''}"
                                  f"(ID [ID ...] | --all-matching [filters])")
        add_dsn(p)
        p.add_argument("ids", nargs="*", type=_event_id, metavar="ID", help="ids of dead events")
        p.add_argument("--all-matching", action="store_true",
                       help="every dead letter the filters match (no filter: every dead letter)")
        _add_filters(p)
        if name == "discard":
            p.add_argument("--reason", required=True, metavar="TEXT", help="why (kept with each event)")
        add_yes(p)
        p.set_defaults(func=cmd_requeue if name == "requeue" else cmd_discard)


# -- selecting ------------------------------------------------------------------------------

def _has_filters(args: argparse.Namespace) -> bool:
    return any(getattr(args, k) is not None for k in ("event_type", "aggregate_type", "aggregate_id", "since"))


def _where(conn: psycopg.Connection[Any], args: argparse.Namespace) -> tuple[sql.Composed, list[Any]]:
    conds: list[sql.Composable] = []
    params: list[Any] = []
    for attr, column in (("event_type", "event_type"), ("aggregate_type", "aggregate_type"),
                         ("aggregate_id", "aggregate_id")):
        value = getattr(args, attr)
        if value is not None:
            conds.append(statements.FILTER_EQUALS.format(sql.Identifier(column)))
            params.append(value)
    if args.since is not None:
        conds.append(statements.FILTER_DEAD_SINCE)
        params.append(point_in_time(conn, args.since, "--since"))
    return statements.where(conds), params


# -- list and show --------------------------------------------------------------------------

def cmd_list(args: argparse.Namespace) -> int:
    if args.limit < 0:
        raise CliError("--limit must be 0 (all) or more", EXIT_USAGE)
    with open_outbox(args) as conn, conn.cursor(row_factory=dict_row) as cur:
        where, params = _where(conn, args)
        total_row = cur.execute(statements.DEAD_COUNT.format(where), params).fetchone()
        total = int(total_row["n"]) if total_row else 0
        query = statements.DEAD_LIST.format(where)
        if args.limit:
            query = statements.LIMIT.format(query)
            params = [*params, args.limit]
        rows = cur.execute(query, params).fetchall()
    if args.json:
        print_json({"total": total, "dead_letters": rows})
        return 0
    if not rows:
        print("no dead letters match" if _has_filters(args) else "no dead letters")
        return 0
    lines = table(["id", "dead_at", "attempts", "aggregate", "event_type", "last_error"],
                  [[r["id"], r["dead_at"], r["attempts"], f"{r['aggregate_type']}/{r['aggregate_id']}", r["event_type"],
                    clip_first_line(r["last_error"], 200)] for r in rows])
    if sys.stdout.isatty():  # fit the terminal: cut the last column (last_error)
        width = max(shutil.get_terminal_size().columns, 60)
        lines = [line if len(line) <= width else line[: width - 3] + "..." for line in lines]
    print("\n".join(lines))
    shown = f"showing the newest {len(rows)} (--limit)" if len(rows) < total else "all shown"
    print(f"\n{total} dead letter{'s' if total != 1 else ''}{' match' if _has_filters(args) else ''}; {shown}. "
          "Details: outboxpg dead show ID")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with open_outbox(args) as conn, conn.cursor(row_factory=dict_row) as cur:
        # Every column this role may read: an outbox_operator login may not read payload and headers.
        readable = [r["attname"] for r in cur.execute(statements.READABLE_COLUMNS).fetchall()
                    if r["attname"] not in INTERNAL_COLUMNS]
        hidden = [c for c in ("payload", "headers") if c not in readable]
        # The payload as the JSON text stored (jsonb's output): its size, and where to cut it.
        # (no view holds every column of an event in any state: this reads the table)
        row = cur.execute(statements.EVENT.format(
            sql.SQL(", ").join(statements.EVENT_PAYLOAD_TEXT if c == "payload" else sql.Identifier("o", c)
                               for c in readable)), (args.id,)).fetchone()
        if row is None:
            raise CliError(f"no event with id {args.id}")
        if "payload" in row:
            _cut_payload(row, args.max_bytes)
        part = cur.execute(statements.PARTITION_OF, {"t": row["created_at"]}).fetchone()
        row["partition"] = part["p"] if part else None
        # outbox_dead_letters.held_back (0016); none (0) when the event is not dead (any more).
        held = cur.execute(statements.HELD_BACK, (row["id"],)).fetchone() if row["state"] == "dead" else None
        row["held_back_behind_it"] = int(held["held_back"]) if held else 0
    if args.json:
        print_json({**row, "not_readable": hidden})
        return 0
    items: list[tuple[str, Any]] = []
    for key, value in row.items():
        if key in ("payload_bytes", "payload_cut_bytes"):
            continue
        if key == "payload" and row["payload_cut_bytes"]:
            # jsonb's text is one line: the only line break is this one.
            value = Lines(f"{value}\n... ({row['payload_cut_bytes']} more bytes of {row['payload_bytes']} not "
                          "shown: --max-bytes 0 shows them all)")
        elif key in ("payload", "headers"):
            # orjson escapes the strings' line breaks: the lines are the indentation's.
            value = Lines(orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode())
        elif isinstance(value, dt.datetime):
            value = value.isoformat(sep=" ")  # full precision, to match against logs
        items.append((key, value))
    print(f"event {row['id']} ({row['state']})")
    print("\n".join(pairs(items)))
    if hidden:
        print(f"\n({' and '.join(hidden)} not shown: this role may not read them)")
    if row["state"] == "dead":
        held = row["held_back_behind_it"]
        print(f"\nIt holds back {held} later event{'' if held == 1 else 's'} of "
              f"{printable(row['aggregate_type'])}/{printable(row['aggregate_id'])}. outboxpg dead requeue "
              f"{row['id']}  |  outboxpg dead discard {row['id']} --reason '...'")
    return 0


def _cut_payload(row: dict[str, Any], max_bytes: int) -> None:
    """row["payload"] (the stored JSON text): parsed when it has at most ``max_bytes`` bytes (0: any
    size), else its first ``max_bytes`` bytes as text (never half a character). Adds
    payload_bytes and payload_cut_bytes."""
    raw = row["payload"].encode()
    row["payload_bytes"] = len(raw)
    if max_bytes and len(raw) > max_bytes:
        shown = raw[:max_bytes].decode("utf-8", "ignore")
        row["payload"] = shown
        row["payload_cut_bytes"] = len(raw) - len(shown.encode())
    else:
        row["payload"] = orjson.loads(raw)
        row["payload_cut_bytes"] = 0


# -- requeue and discard --------------------------------------------------------------------

def _check_selection(args: argparse.Namespace) -> None:
    """Usage errors of requeue and discard, before connecting."""
    if args.ids and args.all_matching:
        raise CliError("give event ids or --all-matching, not both", EXIT_USAGE)
    if args.ids and _has_filters(args):
        raise CliError("--event-type, --aggregate-type, --aggregate-id and --since select events only with "
                       "--all-matching", EXIT_USAGE)
    if not args.ids and not args.all_matching:
        raise CliError(f"which events? give their ids, or --all-matching with filters "
                       f"(see outboxpg dead {args.dead_command} --help)", EXIT_USAGE)
    require_target(args, f"outboxpg dead {args.dead_command}")


def _targets(conn: psycopg.Connection[Any], args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """The dead events to act on, and a note per requested id that is not dead."""
    with conn.cursor(row_factory=dict_row) as cur:
        if args.ids:
            ids = sorted(set(args.ids))
            rows = cur.execute(statements.DEAD_BY_ID, (ids,)).fetchall()
            dead = {r["id"] for r in rows}
            others = {r["id"]: r["state"] for r in cur.execute(
                statements.STATE_BY_ID, ([i for i in ids if i not in dead],)).fetchall()}
            notes = [f"{i} ({others[i]})" if i in others else f"{i} (no such event)" for i in ids if i not in dead]
            return rows, notes
        where, params = _where(conn, args)
        rows = cur.execute(statements.DEAD_MATCHING.format(where), params).fetchall()
        return rows, []


def _act(args: argparse.Namespace, verb: str, past: str) -> int:
    _check_selection(args)
    with open_outbox(args) as conn:
        rows, notes = _targets(conn, args)
        if notes:
            print(f"outboxpg: not dead, left alone: {', '.join(notes)}", file=sys.stderr)
        if not rows:
            if args.ids:
                raise CliError(f"nothing to {verb}: none of the given events is dead")
            print("no dead letters match: nothing to do" if _has_filters(args) else "no dead letters: nothing to do")
            return 0
        # A discard is never undone (the event is not delivered): asked even for one event. A
        # requeue sends again what was meant to be sent: asked for several.
        if len(rows) > 1 or verb == "discard":
            what = f"{len(rows)} dead event{'s' if len(rows) != 1 else ''}"
            confirm(f"{verb.capitalize()} {'these ' + what if len(rows) > 1 else 'this dead event'}?",
                    [f"About to {verb} {what}:", *counts_by_type(rows)],
                    f"{verb} {len(rows)} event{'s' if len(rows) != 1 else ''}", args.yes)
        ids = [r["id"] for r in rows]
        announce_target(conn, f"{'requeueing' if verb == 'requeue' else 'discarding'} {len(ids)} in")
        with conn.transaction():
            # Lock the ones still dead: none can be requeued or discarded by someone else meanwhile,
            # so a discard never catches an event that just went back to pending. Locking rows
            # needs an UPDATE right, which an outbox_operator login has not (it changes events only
            # through the repair functions): it then acts on those still dead a moment ago.
            lock = conn.execute(statements.MAY_LOCK).fetchone()
            locked = [r[0] for r in conn.execute(
                statements.STILL_DEAD.format(statements.FOR_UPDATE if lock and lock[0] else sql.SQL("")),
                (ids,)).fetchall()]
            if verb == "requeue":
                done_row = conn.execute(statements.REQUEUE, (locked,)).fetchone()
            else:
                done_row = conn.execute(statements.DISCARD, (locked, args.reason)).fetchone()
        done = int(done_row[0]) if done_row else 0
    print(f"{past} {done} event{'s' if done != 1 else ''}: {id_list(locked)}")
    if done < len(ids):
        print(f"outboxpg: {len(ids) - done} of the selected events were no longer dead and were left alone",
              file=sys.stderr)
    return 1 if notes or done < len(ids) else 0


def cmd_requeue(args: argparse.Namespace) -> int:
    return _act(args, "requeue", "requeued")


def cmd_discard(args: argparse.Namespace) -> int:
    if not args.reason or not args.reason.strip():
        raise CliError("--reason must not be blank (it is kept with each discarded event)", EXIT_USAGE)
    return _act(args, "discard", "discarded")

