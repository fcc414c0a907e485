"""`outboxpg replay` (outbox_replay) as a user runs it: a subprocess against a real
PostgreSQL, output and exit codes checked, as in tests/cli/test_cli.py."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import pytest
from commands import Result, after_target, one_line_error, run, run_all, run_on_tty
from helpers import claim, complete, fail, insert
from roles import login_roles

from outboxpg.cli.errors import EXIT_FAILED, EXIT_USAGE
from outboxpg.cli.render import id_list

Conn = psycopg.Connection[Any]


def publish_all(conn: Conn) -> None:
    while rows := claim(conn, 100):
        complete(conn, [r["id"] for r in rows], rows[0]["lease_token"])


@pytest.fixture
def shop(conn: Conn) -> dict[str, list[int]]:
    """Published: order o-1 created, paid, shipped; order o-2 created; customer c-1 created. A dead
    order o-3 and a pending order o-1 event, not published."""
    ids: dict[str, list[int]] = {"o-1": [], "o-2": [], "c-1": []}
    for agg, kind, event_type in (("o-1", "order", "created"), ("o-2", "order", "created"),
                                  ("o-1", "order", "paid"), ("c-1", "customer", "created"),
                                  ("o-1", "order", "shipped")):
        ids[agg].append(insert(conn, kind, agg, event_type))
    publish_all(conn)
    dead = insert(conn, "order", "o-3", "created")
    (row,) = claim(conn, 1)
    fail(conn, dead, row["lease_token"], "boom", True)
    ids["not_published"] = [dead, insert(conn, "order", "o-1", "delivered")]
    return ids


def copies(conn: Conn, since_id: int) -> list[tuple[int, str, str]]:
    """(original id, msg_id, original's msg_id) of each copy made after ``since_id``."""
    return conn.execute(
        "SELECT (c.headers->>'Outbox-Replay-Of')::bigint, c.msg_id, o.msg_id FROM outbox c "
        "JOIN outbox o ON o.id = (c.headers->>'Outbox-Replay-Of')::bigint WHERE c.id > %s ORDER BY c.id",
        (since_id,)).fetchall()


def max_id(conn: Conn) -> int:
    return int(conn.execute("SELECT max(id) FROM outbox").fetchone()[0])  # type: ignore[index]


def test_dry_run_shows_how_many_and_which_and_changes_nothing(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    last = max_id(conn)
    dry, new_ids, none = run_all(
        ("replay", "--dsn", dsn, "--aggregate-type", "order", "--dry-run"),
        ("replay", "--dsn", dsn, "--aggregate-id", "o-1", "--event-type", "paid", "--new-msg-id", "--dry-run"),
        ("replay", "--dsn", dsn, "--aggregate-id", "o-3", "--dry-run"))          # dead, not published
    o1 = shop["o-1"]
    assert dry.code == 0 and dry.err == "", dry
    lines = dry.out.splitlines()
    assert lines[0] == "Would replay 4 published events:"
    assert re.fullmatch(rf"  ids {o1[0]}\.\.{o1[2]}, created \S+ \S+ \.\. \S+ \S+, 2 aggregates", lines[1]), lines[1]
    assert [line.split() for line in lines[4:6]] == [["order", "created", "2"], ["order", "paid", "1"]]
    assert [line.split() for line in lines[6:7]] == [["order", "shipped", "1"]]
    assert [line.split()[0] for line in lines[9:13]] == [str(i) for i in sorted(o1 + shop["o-2"])]   # each event
    assert lines[13:] == ["the copies keep their msg_id: JetStream drops those whose original is still inside the "
                          "stream's duplicate window (--new-msg-id delivers them again)", "(dry run: nothing changed)"]
    assert new_ids.code == 0 and new_ids.out.splitlines()[0] == "Would replay 1 published event:", new_ids
    assert f"  ids {o1[1]}..{o1[1]}, " in new_ids.out and "1 aggregate\n" in new_ids.out
    assert "each copy gets a new msg_id: JetStream stores it again (a forced redelivery)" in new_ids.out
    assert (none.code, none.out, none.err) == (0, "no published events match: nothing to replay\n", ""), none
    assert max_id(conn) == last



def test_several_events_need_confirmation_and_no_tty_refuses(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    last = max_id(conn)
    r = run("replay", "--dsn", dsn, "--aggregate-id", "o-1")
    assert one_line_error(r, 1) == \
        "outboxpg: refusing to replay 3 events without confirmation: stdin is not a terminal (pass --yes)"
    assert max_id(conn) == last


def test_one_event_needs_no_confirmation_and_keeps_its_msg_id(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    last, paid = max_id(conn), shop["o-1"][1]
    r = run("replay", "--dsn", dsn, "--id", str(paid))
    assert (r.code, r.out, after_target(r.err)) == (0, f"replayed 1 event as new events (same msg_id): {paid}\n", ""), r
    ((original, msg_id, original_msg_id),) = copies(conn, last)
    assert original == paid and msg_id == original_msg_id


def test_ids_repeated_or_listed_with_yes_and_new_msg_id(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    last = max_id(conn)
    o1, c1 = shop["o-1"], shop["c-1"]
    # Ids that are not published (dead, pending) are left out; the other filters narrow further (AND).
    r = run("replay", "--dsn", dsn, f"--id={o1[2]},{c1[0]}", "--id", str(o1[0]),
            "--id", ",".join(map(str, shop["not_published"])), "--new-msg-id", "--yes")
    dead, pending = shop["not_published"]
    notes, rest = r.err.split("\n", 1)
    assert (r.code, notes) == (1, f"outboxpg: not published, left alone: {dead} (dead), {pending} (pending)"), r
    assert after_target(rest) == "", r
    assert r.out == f"replayed 3 events as new events (new msg_id): {o1[0]}, {c1[0]}, {o1[2]}\n"
    made = copies(conn, last)
    assert [m[0] for m in made] == [o1[0], c1[0], o1[2]]          # in the originals' order
    assert all(msg_id != original for _, msg_id, original in made)
    narrowed, nothing = run_all(("replay", "--dsn", dsn, "--id", f"{o1[0]},{c1[0]}", "--aggregate-type", "customer"),
                                ("replay", "--dsn", dsn, "--id", f"{dead},424242"))
    assert (narrowed.code, narrowed.out, after_target(narrowed.err)) == \
        (0, f"replayed 1 event as new events (same msg_id): {c1[0]}\n", ""), narrowed
    assert (nothing.code, nothing.out, nothing.err) == \
        (1, "no published events match: nothing to replay\n",
         f"outboxpg: not published, left alone: {dead} (dead), 424242 (no such event)\n"), nothing


def test_confirmation_on_a_terminal(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    last = max_id(conn)
    args = ["replay", "--dsn", dsn, "--aggregate-type", "order", "--since", "1 hour"]
    no = run_on_tty(args, "n\n")
    assert no.code == 1 and no.out == "", no
    assert "About to replay 4 published events:" in no.err and "Replay these 4 published events? [y/N]" in no.err
    assert no.err.rstrip().endswith("outboxpg: cancelled: nothing changed")
    assert max_id(conn) == last
    yes = run_on_tty(args, "y\n")
    assert yes.code == 0 and yes.out.startswith("replayed 4 events as new events (same msg_id): "), yes
    assert [m[0] for m in copies(conn, last)] == [*sorted(shop["o-1"] + shop["o-2"])]


def test_bad_input_is_one_line(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    last = max_id(conn)
    no_filter, new_msg_id_only, bad_id, bad_since, backwards, unknown = run_all(
        ("replay", "--dsn", dsn),
        ("replay", "--dsn", dsn, "--new-msg-id", "--yes"),
        ("replay", "--dsn", dsn, "--id", "5,x"),
        ("replay", "--dsn", dsn, "--since", "next blue moon"),
        ("replay", "--dsn", dsn, "--since", "1 hour", "--until", "2 hours"),
        ("replay", "--dsn", dsn, "--aggregate", "order"))
    refused = ("outboxpg: which events? give --id, --aggregate-type, --aggregate-id, --event-type, --since or --until "
               "(replaying every published event is refused)")
    assert one_line_error(no_filter, 2) == refused
    assert one_line_error(new_msg_id_only, 2) == refused
    assert _usage_error(bad_id) == ("outboxpg: argument --id: not a comma-separated list of whole numbers: "
                                    "'5,x' (see outboxpg replay --help)")
    assert one_line_error(bad_since, EXIT_USAGE) == "outboxpg: --since: neither a timestamp nor an interval: 'next blue moon'"
    assert re.fullmatch(r"outboxpg: outbox_replay: since \(.+\) is not before until \(.+\)",
                        one_line_error(backwards, 2)), backwards
    assert _usage_error(unknown) == ("outboxpg: ambiguous option: --aggregate could match --aggregate-type, "
                                     "--aggregate-id (see outboxpg replay --help)")
    assert max_id(conn) == last


def _usage_error(r: Result) -> str:
    assert (r.code, r.out) == (2, ""), r
    lines = r.err.splitlines()
    assert len(lines) == 1 and "Traceback" not in r.err, r
    return lines[0]


def test_a_worker_login_is_denied(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    last = max_id(conn)
    with login_roles(dsn, worker="outbox_worker", operator="outbox_operator") as logins:
        worker, operator = logins["worker"], logins["operator"]
        denied, allowed = run_all(("replay", "--dsn", worker.dsn, "--id", str(shop["o-2"][0])),
                                  ("replay", "--dsn", operator.dsn, "--id", str(shop["o-2"][0])))
    line = one_line_error(denied, 1)
    assert line.startswith(f"outboxpg: role '{worker.name}' may not "), line
    assert "permission denied" in line and "GRANT outbox_operator TO" in line, line
    assert allowed.code == 0 and allowed.out == f"replayed 1 event as new events (same msg_id): {shop['o-2'][0]}\n"
    assert [m[0] for m in copies(conn, last)] == shop["o-2"]


def test_max_events_caps_a_replay_all_or_nothing_and_the_dry_run_says_so(dsn: str, conn: Conn,
                                                                          shop: dict[str, list[int]]) -> None:
    """Issue 25 (12): `--since -infinity` copied every published event still in the table. A
    replay copies at most --max-events (10,000 by default), all or nothing."""
    last = max_id(conn)
    dry, refused, bad = run_all(
        ("replay", "--dsn", dsn, "--since=-infinity", "--max-events", "4", "--dry-run"),
        ("replay", "--dsn", dsn, "--since=-infinity", "--max-events", "4", "--yes"),
        ("replay", "--dsn", dsn, "--since=-infinity", "--max-events", "0", "--yes"))
    assert dry.code == 1 and dry.err == "", dry
    assert dry.out == ("Would replay none: 5 published events match, more than --max-events (4): a replay copies "
                       "all or none; narrow the filters (--since, --until, --aggregate-type, ...) or raise "
                       "--max-events\n(dry run: nothing changed)\n"), dry.out
    assert one_line_error(refused, 1) == (
        "outboxpg: nothing replayed: 5 published events match, more than --max-events (4): a replay copies all or "
        "none; narrow the filters (--since, --until, --aggregate-type, ...) or raise --max-events")
    assert one_line_error(bad, 2) == "outboxpg: --max-events must be 1 or more, got 0"
    assert max_id(conn) == last, "nothing copied"
    # -infinity is a time PostgreSQL reads and Python's datetime cannot hold: passed on as text.
    dead = run("dead", "list", "--dsn", dsn, "--since=-infinity")
    assert dead.code == 0 and "1 dead letter match" in dead.out, dead
    done = run("replay", "--dsn", dsn, "--since=-infinity", "--max-events", "5", "--yes")
    assert done.code == 0 and done.out.startswith("replayed 5 events as new events"), done
    assert len(copies(conn, last)) == 5


def test_the_default_cap_is_ten_thousand(dsn: str, conn: Conn) -> None:
    conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                 "SELECT 'order', 'o-' || n, 'created', '{}' FROM generate_series(1, 10001) n")
    conn.execute("UPDATE outbox SET state = 'published', published_at = now()")
    last = max_id(conn)
    dry, refused = run_all(("replay", "--dsn", dsn, "--since=-infinity", "--dry-run"),
                           ("replay", "--dsn", dsn, "--since=-infinity", "--yes"))
    assert dry.out.startswith("Would replay none: 10001 published events match, more than --max-events (10000)"), dry
    assert one_line_error(refused, 1).startswith(
        "outboxpg: nothing replayed: 10001 published events match, more than --max-events (10000)")
    assert max_id(conn) == last



def test_replaying_twice_copies_the_originals_only(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    """`replay --aggregate-id o-1 --new-msg-id --yes` twice copies o-1's published events twice;
    it used to copy the first replay's copies too (3, then 7). --include-replays asks for them."""
    o1 = shop["o-1"]
    args = ("replay", "--dsn", dsn, "--aggregate-id", "o-1", "--new-msg-id", "--yes")
    first = run(*args)
    assert first.code == 0 and first.out == f"replayed 3 events as new events (new msg_id): {id_list(o1)}\n"
    publish_all(conn)                                  # the copies, and o-1's pending event
    originals = [*o1, shop["not_published"][1]]
    last = max_id(conn)
    second = run(*args)
    assert second.code == 0, second
    assert second.out == f"replayed 4 events as new events (new msg_id): {id_list(originals)}\n"
    assert [m[0] for m in copies(conn, last)] == originals
    publish_all(conn)
    dry = run("replay", "--dsn", dsn, "--aggregate-id", "o-1", "--include-replays", "--dry-run")
    assert dry.code == 0, dry
    assert dry.out.splitlines()[0] == \
        "Would replay 11 published events, including copies made by earlier replays:", dry.out


def test_dry_run_lists_each_event_with_the_msg_id_it_will_carry(dsn: str, conn: Conn,
                                                                shop: dict[str, list[int]]) -> None:
    o1 = shop["o-1"]
    msg_ids = dict(conn.execute("SELECT id, msg_id FROM outbox WHERE id = ANY(%s)", (o1,)).fetchall())
    same, new = run_all(("replay", "--dsn", dsn, "--aggregate-id", "o-1", "--dry-run"),
                        ("replay", "--dsn", dsn, "--aggregate-id", "o-1", "--new-msg-id", "--dry-run"))
    for r, carried in ((same, msg_ids), (new, dict.fromkeys(o1, "(new)"))):
        assert r.code == 0, r
        rows = [line.split() for line in r.out.splitlines() if line.split()[:1] in ([str(i)] for i in o1)]
        assert [(int(row[0]), row[-1]) for row in rows] == [(i, carried[i]) for i in o1], r.out
        assert [row[1:3] for row in rows] == [["order/o-1", "created"], ["order/o-1", "paid"],
                                              ["order/o-1", "shipped"]]


def test_an_id_of_a_copy_is_left_alone_unless_asked(dsn: str, conn: Conn, shop: dict[str, list[int]]) -> None:
    paid = shop["o-1"][1]
    last = max_id(conn)
    assert run("replay", "--dsn", dsn, "--id", str(paid)).code == 0
    publish_all(conn)
    (copy,) = [r[0] for r in conn.execute("SELECT id FROM outbox WHERE replay_of = %s", (paid,)).fetchall()]
    assert copy > last
    left, asked = run_all(("replay", "--dsn", dsn, "--id", str(copy)),
                          ("replay", "--dsn", dsn, "--id", str(copy), "--include-replays"))
    assert (left.code, left.out) == (EXIT_FAILED, "no published events match: nothing to replay\n"), left
    assert left.err == f"outboxpg: not published, left alone: {copy} (a copy of {paid}: --include-replays)\n"
    assert (asked.code, asked.out) == (0, f"replayed 1 event as new events (same msg_id): {copy}\n"), asked
