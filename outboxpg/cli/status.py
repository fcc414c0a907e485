"""``outboxpg status`` (the outbox_health row and events per state) and ``outboxpg maintain``."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outboxpg import statements
from outboxpg.cli.common import (
    DSN_HELP,
    add_dsn,
    announce_target,
    number_type,
    open_outbox,
    print_json,
    redact,
    require_target,
    secrets_of,
    untrusted_creators_text,
    where_am_i,
    where_text,
)
from outboxpg.cli.errors import EXIT_USAGE, CliError
from outboxpg.cli.render import jsonable, pairs, table
from outboxpg.relay.horizon import XminHolder
from outboxpg.relay.nats.subjects import MAX_SUBJECTS, Subject, missing_text
from outboxpg.text import age, clip_first_line, describe, printable

STATES = ("pending", "processing", "published", "dead", "discarded")

# The publisher's reason when no stream captures an event's subject (NatsPublisher._outcome).
NO_STREAM = "(no responders)"

# A reason that has failed an event this many attempts in a row is not a passing hiccup: an
# attention line says so (the events die after max_attempts).
RECURRING_ATTEMPTS = 3


_positive_seconds = number_type(float, "not a number of seconds: {!r}", lambda v: v > 0,
                                "must be more than 0 seconds, got {!r}")


def register(sub: Any) -> None:
    p = sub.add_parser("status", help="is it healthy? the outbox_health row and events per state",
                       description="The outbox_health row (backlog, oldest pending age, dead letters, expired "
                                   "leases, last claim, open producing transactions and the events they hold "
                                   "back, what holds back the xmin horizon) and the number of events in each "
                                   "state.")
    p.add_argument("--dsn", action="append", help=f"{DSN_HELP}; repeat it for several databases: a block each (with "
                                                   "--json, one object per line), in the order given")
    p.add_argument("--json", action="store_true", help="print one JSON object (intervals in seconds)")
    p.add_argument("--watch", nargs="?", type=_positive_seconds, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C; with --json, one object per line")
    p.add_argument("--health-only", action="store_true",
                   help="skip the per-state counts, which read the whole table (outbox_health alone reads "
                        "only unfinished events)")
    p.add_argument("--nats-url", default=os.environ.get("OUTBOXPG_NATS_URL") or None, metavar="URL",
                   help="also ask JetStream whether a stream captures the subject of every unfinished event "
                        "(without it, a subject no stream captures shows only once its events fail) "
                        "[OUTBOXPG_NATS_URL]")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("maintain", help="run outbox_maintain(): create partitions ahead, drop expired ones",
                       description="Call outbox_maintain(dry_run) and print one row per action: create, drop, "
                                   "keep (past retention but holding unfinished events) or skip.")
    add_dsn(p)
    p.add_argument("--dry-run", action="store_true", help="only show what it would do")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_maintain)


# -- status ---------------------------------------------------------------------------------

async def _uncaptured(url: str, subjects: list[Subject]) -> list[Subject]:
    import nats

    from outboxpg.relay.nats.streams import uncaptured

    seen: list[Exception] = []

    async def on_error(exc: Exception) -> None:   # nats-py's default prints a traceback
        seen.append(exc)

    try:
        nc = await nats.connect([u.strip() for u in url.split(",") if u.strip()], connect_timeout=3,
                                allow_reconnect=False, max_reconnect_attempts=1, name="outboxpg-status",
                                error_cb=on_error)
    except Exception as exc:  # noqa: BLE001 - the first error says more than nats-py's "no servers"
        raise (seen[0] if seen else exc) from None
    try:
        return await uncaptured(nc.jetstream(timeout=5), subjects)
    finally:
        await nc.close()


def _check_subjects(conn: psycopg.Connection[Any], url: str) -> dict[str, Any]:
    """Which subjects of the unfinished events no JetStream stream captures (--nats-url)."""
    subjects = [Subject(*row) for row in conn.execute(statements.UNFINISHED_SUBJECTS, (MAX_SUBJECTS,)).fetchall()]
    try:
        missing = asyncio.run(_uncaptured(url, subjects)) if subjects else []
    except Exception as exc:  # noqa: BLE001 - unreachable, refused, no JetStream...
        return {"checked": len(subjects), "missing": None, "error": describe(exc)}
    return {"checked": len(subjects), "missing": [vars(s) for s in missing], "error": None}


def _snapshot(conn: psycopg.Connection[Any], with_states: bool, nats_url: str | None = None) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        health = cur.execute(statements.HEALTH).fetchone()
        assert health is not None
        producers: list[dict[str, Any]] = []
        if health["open_producers"]:
            # Who holds what back (0013); any of them may have ended meanwhile.
            producers = cur.execute(statements.OPEN_PRODUCERS).fetchall()
        # Claims left open in their transaction: they keep every claim from taking new events in.
        claims = cur.execute(statements.OPEN_CLAIMS).fetchall()
        # Events failing now (outbox_failing): like outbox_health, it reads only unfinished events.
        failing = cur.execute(statements.FAILING).fetchall()
        untrusted = cur.execute(statements.INSTALL_UNTRUSTED_CREATORS).fetchone()
        settings = cur.execute(statements.MAX_ATTEMPTS).fetchone()
        max_attempts = settings["max_attempts"] if settings else None
        for f in failing:
            f["recurring"] = f["max_attempts"] >= RECURRING_ATTEMPTS
        states: dict[str, int] | None = None
        if with_states:
            counts = cur.execute(statements.STATE_COUNTS).fetchone()   # outbox_stats
            assert counts is not None
            states = {s: int(counts[s]) for s in STATES}
    subjects = _check_subjects(conn, nats_url) if nats_url else None
    checked_at = health.pop("checked_at")
    return {"database": where_am_i(conn), "checked_at": checked_at, "health": health, "producers": producers,
            "open_claims": claims, "failing": failing, "states": states, "subjects": subjects,
            "attention": _attention(health, producers, failing, max_attempts, subjects, untrusted, claims)}


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _producer_text(pid: int | None, xact_age: Any, state: str | None) -> str:
    """'pid 1234, open 20.0 s, idle in transaction' (age and state are NULL when the installing
    role may not see other roles' sessions)."""
    parts = [f"pid {pid}", f"open {age(xact_age)}" if xact_age is not None else "open for an unknown time"]
    if state:
        parts.append(state)
    return ", ".join(parts)


def _claim_text(c: dict[str, Any]) -> str:
    """'pid 1234 (open 20.0 s, idle in transaction, application 'psql')'."""
    parts = [f"open {age(c['xact_age'])}"]
    if c["state"]:
        parts.append(c["state"])
    if c["application_name"]:
        parts.append(f"application {c['application_name']!r}")
    return f"pid {c['pid']} ({', '.join(parts)})"


def _held_note(h: dict[str, Any], producers: list[dict[str, Any]]) -> str:
    """One line: which open producing transactions hold back how many events."""
    held = _plural(h["held_by_open_transactions"], "event")
    if len(producers) == 1:
        p = producers[0]
        who = f"1 open producing transaction ({_producer_text(p['pid'], p['xact_age'], p['state'])})"
        if p["all_newer"]:
            return (f"held back: {who} holds back every event newer than id {p['held_above']} ({held}), "
                    "until it commits or rolls back")
        return (f"held back: {who} holds back {held} of the {_plural(p['aggregates'], 'aggregate')} it wrote, "
                "until it commits or rolls back")
    # Several, or they ended between the two reads: the health row's figures.
    n = max(len(producers), h["open_producers"])
    oldest = (_producer_text(producers[0]["pid"], producers[0]["xact_age"], producers[0]["state"]) if producers
              else _producer_text(h["oldest_producer_pid"], h["oldest_producer_age"], None))
    note = f"held back: {n} open producing transactions hold back {held}, until they end; the oldest: {oldest}"
    everything = [p for p in producers if p["all_newer"]]
    if everything:
        first = min(everything, key=lambda p: p["held_above"])
        note += f"; pid {first['pid']} holds back every event newer than id {first['held_above']}"
    return note


def _xmin_holder(h: dict[str, Any]) -> XminHolder | None:
    """The oldest holder of the xmin horizon past outbox_settings.xmin_warn_after (0017), if any."""
    if not h.get("xmin_holders"):
        return None
    held = h["xmin_holder_age"]
    return XminHolder(h["xmin_holder_kind"], h["xmin_holder_pid"], h["xmin_holder_name"], None,
                      None if held is None else held.total_seconds(), None, h["xmin_holder_state"],
                      h["xmin_holder_role"], h["xmin_holder_application"])


def _xmin_text(h: dict[str, Any]) -> str:
    holder = _xmin_holder(h)
    if holder is None:
        return "not held past xmin_warn_after"
    more = f"  (and {h['xmin_holders'] - 1} more)" if h["xmin_holders"] > 1 else ""
    return f"held by {holder.text()}{more}"


def _recurring_note(f: dict[str, Any], max_attempts: int | None) -> str:
    n = f["events"]
    attempts = (f"{f['max_attempts']} attempts so far" if f["min_attempts"] == f["max_attempts"]
                else f"{f['min_attempts']} to {f['max_attempts']} attempts so far")
    dies = f"; dead after {max_attempts}" if max_attempts else ""
    ids = ", ".join(map(str, f["ids"][:5])) + (", ..." if n > 5 else "")
    return (f"{_plural(n, 'event')} {'keeps' if n == 1 else 'keep'} failing with {f['reason']!r} "
            f"({attempts}{dies}): event{'s' if n != 1 else ''} {ids}")


def _no_stream_note(f: dict[str, Any]) -> str:
    n = f["events"]
    subjects = ", ".join(map(repr, f["subjects"])) + (", ..." if len(f["subjects"]) >= 5 else "")
    return (f"{_plural(n, 'event')} {'fails' if n == 1 else 'fail'}: no JetStream stream captures "
            f"{'its' if n == 1 else 'their'} subject ({subjects}; {f['max_attempts']} attempts so far): add it to "
            "a stream (outboxpg-worker --ensure-stream NAME adds the explicit subjects of unfinished events under "
            "allowed_subject_prefixes)")


def _attention(h: dict[str, Any], producers: list[dict[str, Any]], failing: list[dict[str, Any]],
               max_attempts: int | None, subjects: dict[str, Any] | None = None,
               untrusted: dict[str, Any] | None = None, claims: list[dict[str, Any]] | None = None) -> list[str]:
    notes = []
    for c in claims or []:
        notes.append(f"a claim's transaction is open in {_claim_text(c)}: no claim takes new events in until "
                     f"it ends (the server ends it once idle for its lease; SELECT pg_terminate_backend({c['pid']}) "
                     "ends it now)")
    if untrusted is not None and untrusted["who"] is not None:
        notes.append(f"workers refuse to start: {untrusted_creators_text(untrusted['who'], untrusted['schema'])}")
    if h["dead"]:
        notes.append("1 dead letter holds back later events of its aggregate: outboxpg dead list" if h["dead"] == 1
                     else f"{h['dead']} dead letters hold back later events of their aggregates: outboxpg dead list")
    # A subject no stream captures fails every attempt: said at the first one, not at the third.
    notes += [_no_stream_note(f) if NO_STREAM in f["reason"] else _recurring_note(f, max_attempts)
              for f in failing if f["recurring"] or NO_STREAM in f["reason"]]
    if subjects is not None:
        if subjects["error"]:
            notes.append(f"cannot check the subjects against JetStream (--nats-url): {subjects['error']}")
        elif subjects["missing"]:
            missing = [Subject(**m) for m in subjects["missing"]]
            notes.append(f"{missing_text(missing)}: their publishes fail (no responders) until a stream captures "
                         "them (outboxpg-worker --ensure-stream NAME adds the explicit ones under "
                         "allowed_subject_prefixes)")
    if h["expired_leases"]:
        notes.append(f"{h['expired_leases']} lease{'s' if h['expired_leases'] != 1 else ''} expired (the worker "
                     "died or hung): the next claim retries them")
    if h["held_by_open_transactions"]:
        notes.append(_held_note(h, producers))
    holder = _xmin_holder(h)
    if holder is not None:
        notes.append(f"the xmin horizon is held back by {holder.text()}: {holder.advice()}")
    # last_claim_at is when a worker last called outbox_claim, whatever it found: recent means a
    # worker runs, even while everything it could claim is held back. A claim left open holds the
    # row it is written on: then it says nothing of the workers.
    if h["backlog"] and not h["worker_claimed_last_minute"] and not claims:
        notes.append(f"backlog of {h['backlog']} but no claim in the last minute: is a worker running?")
    return notes


def _subjects_pair(sub: dict[str, Any] | None) -> list[tuple[str, str]]:
    """With --nats-url: how many subjects of unfinished events were checked against JetStream."""
    if sub is None:
        return []
    text = (f"{sub['checked']} checked; the check failed (see attention)" if sub["error"] else
            f"{sub['checked']} checked; {len(sub['missing'])} captured by no stream" if sub["missing"] else
            f"{sub['checked']} checked; each captured by a stream")
    return [("subjects in JetStream", text)]


def _render(snap: dict[str, Any]) -> list[str]:
    h = snap["health"]
    checked = snap["checked_at"]
    last = h["last_claim_at"]
    last_text = "never" if last is None else \
        f"{last.isoformat(sep=' ', timespec='seconds')} ({age(checked - last)} ago)"
    oldest = h["oldest_pending_age"]
    producers_text = str(h["open_producers"])
    if h["open_producers"]:
        producers_text += "  (oldest: " + _producer_text(h["oldest_producer_pid"], h["oldest_producer_age"], None) + ")"
    lines = [f"outboxpg status: {where_text(snap['database'])}, {checked.isoformat(sep=' ', timespec='seconds')}", "",
             "health (outbox_health)"]
    lines += pairs([
        # Scheduled events (never tried, not due yet) are not failures: counted apart from retries.
        ("backlog", f"{h['backlog']}  (pending {h['pending']}, of which scheduled {h['scheduled']}, waiting for a "
                    f"retry {h['waiting_retry']}; processing {h['processing']})"),
        ("oldest pending age", age(oldest) if oldest is not None else "none pending"),
        ("dead letters", h["dead"]),
        ("expired leases", h["expired_leases"]),
        ("last claim", last_text),
        ("worker claimed last minute", h["worker_claimed_last_minute"]),
        ("open producing transactions", producers_text),
        ("held back by them", _plural(h["held_by_open_transactions"], "event")),
        ("xmin horizon (VACUUM)", _xmin_text(h)),
    ] + _subjects_pair(snap["subjects"]))
    if snap["failing"]:
        lines += ["", "failing now (failed, not delivered yet: waiting for a retry or retrying; by last error)"]
        lines += table(["events", "attempts min", "max", "retrying now", "event types", "last error"],
                       [[f["events"], f["min_attempts"], f["max_attempts"], f["retrying_now"],
                         ", ".join(f["event_types"]), clip_first_line(f["reason"], 120)] for f in snap["failing"]])
    if snap["states"] is not None:
        lines += ["", "events by state"]
        lines += table(["state", "events"], list(snap["states"].items()))
    lines.append("")
    if snap["attention"]:
        lines.append("attention")
        lines += [f"  ! {note}" for note in snap["attention"]]
    else:
        lines.append("OK: nothing needs attention")
    # The attention notes quote what producers wrote (reasons, subjects) and what other sessions
    # call themselves (application_name): each stays on its line, unable to drive the terminal.
    return [printable(line) for line in lines]


def _as_json(snap: dict[str, Any]) -> dict[str, Any]:
    return {"database": snap["database"], "checked_at": snap["checked_at"], "health": jsonable(snap["health"]),
            "producers": [jsonable(p) for p in snap["producers"]],
            "open_claims": [jsonable(c) for c in snap["open_claims"]],
            "failing": [jsonable(f) for f in snap["failing"]], "states": snap["states"],
            **({"subjects": snap["subjects"]} if snap["subjects"] is not None else {}),
            "attention": snap["attention"]}


def cmd_status(args: argparse.Namespace) -> int:
    dsns = args.dsn or [None]
    if len(dsns) > 1:
        return _status_of_several(args, dsns)
    args.dsn = dsns[0]
    with open_outbox(args) as conn:
        if args.watch is None:
            snap = _snapshot(conn, not args.health_only, args.nats_url)
            if args.json:
                print_json(_as_json(snap))
            else:
                print("\n".join(_render(snap)))
            return 0
        clear = sys.stdout.isatty() and not args.json
        try:
            while True:
                snap = _snapshot(conn, not args.health_only, args.nats_url)
                if args.json:
                    print_json(_as_json(snap))
                else:
                    text = "\n".join(_render(snap) + ["", f"(every {args.watch:g} s; Ctrl-C to stop)"])
                    sys.stdout.write(("\033[H\033[2J" if clear else "") + text + "\n" + ("" if clear else "\n"))
                    sys.stdout.flush()
                time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def _status_of_several(args: argparse.Namespace, dsns: list[str]) -> int:
    """One block (or JSON line) per database; one that cannot be read is one line on stderr,
    naming which, and the exit code is the first such failure's (0 when every one was read)."""
    if args.watch is not None:
        raise CliError("--watch takes one --dsn", EXIT_USAGE)
    code = 0
    for n, dsn in enumerate(dsns):
        try:
            with open_outbox(argparse.Namespace(dsn=dsn)) as conn:
                snap = _snapshot(conn, not args.health_only, args.nats_url)
        except CliError as exc:
            print(printable(redact(f"outboxpg: --dsn #{n + 1}: {exc}", secrets_of(dsn))), file=sys.stderr, flush=True)
            code = code or exc.code
            continue
        if args.json:
            print_json(_as_json(snap))
        else:
            print("\n".join(_render(snap)) + ("\n" if n < len(dsns) - 1 else ""), flush=True)
    return code


# -- maintain -------------------------------------------------------------------------------

def cmd_maintain(args: argparse.Namespace) -> int:
    if not args.dry_run:
        require_target(args, "outboxpg maintain")
    with open_outbox(args) as conn, conn.cursor(row_factory=dict_row) as cur:
        if not args.dry_run:
            announce_target(conn, "maintaining partitions of")
        rows = cur.execute(statements.MAINTAIN, (args.dry_run,)).fetchall()
    if args.json:
        print_json({"dry_run": args.dry_run, "actions": rows})
        return 0
    title = "outbox_maintain(dry_run => true): what it would do" if args.dry_run else "outbox_maintain(): done"
    if not rows:
        print(f"{title}: nothing (every partition needed exists, none is past retention)")
        return 0
    print(f"{title}:")
    print("\n".join(table(["action", "partition", "range_start", "range_end", "detail"],
                          [[r["action"], r["partition"], r["range_start"], r["range_end"], r["detail"]]
                           for r in rows])))
    return 0
