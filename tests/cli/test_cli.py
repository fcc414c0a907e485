"""The operator CLI (`outboxpg status | dead ... | maintain`, and migrate) as a user runs it: a
subprocess against a real PostgreSQL, output and exit codes checked.

Independent invocations run in parallel (`run_all`): each one pays for starting Python and
importing psycopg."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

import orjson
import psycopg
import pytest
from commands import Result, after_target, finish, one_line_error, run, run_all, run_on_tty, start
from dataset import build_dataset, last_claim_at, producing_transaction
from helpers import claim, insert

from outboxpg import sql_files
from outboxpg.cli.errors import EXIT_CONNECT, EXIT_SCHEMA, EXIT_USAGE

SECRET = "S3cr3t-pw-do-not-show"
NOT_INSTALLED = "outboxpg: the outbox schema is not installed in {where}: run outboxpg migrate --dsn ..."


@pytest.fixture
def data(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    return build_dataset(conn)


def state_of(conn: psycopg.Connection[Any], i: int) -> str:
    row = conn.execute("SELECT state::text FROM outbox WHERE id = %s", (i,)).fetchone()
    assert row is not None
    return row[0]


def dead_ids(conn: psycopg.Connection[Any]) -> set[int]:
    return {r[0] for r in conn.execute("SELECT id FROM outbox WHERE state = 'dead'").fetchall()}


# -- status -----------------------------------------------------------------------------------

def test_status_table_and_json(dsn: str, conn: psycopg.Connection[Any], data: dict[str, Any]) -> None:
    text, js, health_only = run_all(("status", "--dsn", dsn), ("status", "--dsn", dsn, "--json"),
                                    ("status", "--dsn", dsn, "--json", "--health-only"))
    assert text.code == 0 and text.err == "", text
    lines = text.out.splitlines()
    assert lines[0].startswith("outboxpg status: database ")
    assert any(line.split()[:2] == ["backlog", "3"] for line in lines), text.out
    assert any(line.split() == ["dead", "letters", "4"] for line in lines), text.out
    assert any(line.split() == ["worker", "claimed", "last", "minute", "yes"] for line in lines), text.out
    for state, n in (("pending", 2), ("processing", 1), ("published", 2), ("dead", 4), ("discarded", 0)):
        assert [state, str(n)] in [line.split() for line in lines], (state, text.out)
    assert "4 dead letters hold back later events of their aggregates: outboxpg dead list" in text.out

    obj = js.json()
    h = obj["health"]
    assert {k: h[k] for k in ("backlog", "pending", "processing", "waiting_retry", "dead", "expired_leases")} == \
        {"backlog": 3, "pending": 2, "processing": 1, "waiting_retry": 0, "dead": 4, "expired_leases": 0}
    assert h["worker_claimed_last_minute"] is True
    # When a worker last called outbox_claim, kept to the second by the claim (outbox_intake).
    assert h["last_claim_at"] == last_claim_at(conn).isoformat()
    assert 0 <= (data["leased_claimed_at"] - last_claim_at(conn)).total_seconds() < 1
    assert (h["open_producers"], h["oldest_producer_pid"], h["held_by_open_transactions"]) == (0, None, 0)
    assert obj["producers"] == []
    assert 0 <= h["oldest_pending_age_seconds"] < 60
    assert obj["states"] == {"pending": 2, "processing": 1, "published": 2, "dead": 4, "discarded": 0}
    assert obj["database"]["dbname"] == psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    assert len(obj["attention"]) == 1

    assert health_only.json()["states"] is None
    assert health_only.json()["health"]["backlog"] == 3


def test_status_names_the_open_transaction_that_holds_events_back(dsn: str, conn: psycopg.Connection[Any],
                                                                   operator_dsn: str) -> None:
    with producing_transaction(dsn, "o-held") as producer:
        pid = producer.info.backend_pid
        held = [insert(conn, "order", "o-held", "shipped") for _ in range(3)]
        free = [insert(conn, "order", f"o-free-{i}", "created") for i in range(2)]
        # A worker claims the other aggregates' events; the guard keeps o-held's back.
        assert sorted(r["id"] for r in claim(conn, 10)) == free
        text, js, as_operator = run_all(("status", "--dsn", dsn), ("status", "--dsn", dsn, "--json"),
                                        ("status", "--dsn", operator_dsn, "--json", "--health-only"))
    assert text.code == 0 and text.err == "", text
    attention = text.out.split("\nattention\n", 1)[1]
    assert f"  ! held back: 1 open producing transaction (pid {pid}, open " in attention, text.out
    assert ", idle in transaction) holds back 3 events of the 1 aggregate it wrote, until it commits or rolls back" \
        in attention, text.out
    assert "is a worker running?" not in text.out
    lines = [line.split() for line in text.out.splitlines()]
    assert ["worker", "claimed", "last", "minute", "yes"] in lines, text.out
    assert ["held", "back", "by", "them", "3", "events"] in lines, text.out
    assert any(line[:5] == ["open", "producing", "transactions", "1", "(oldest:"] and line[5:7] == ["pid", f"{pid},"]
               for line in lines), text.out

    for obj in (js.json(), as_operator.json()):
        h = obj["health"]
        assert (h["backlog"], h["pending"], h["processing"]) == (5, 3, 2)
        assert (h["open_producers"], h["oldest_producer_pid"], h["held_by_open_transactions"]) == (1, pid, 3)
        assert 0 < h["oldest_producer_age_seconds"] < 60
        assert h["worker_claimed_last_minute"] is True and h["last_claim_at"] is not None
        (p,) = obj["producers"]
        assert (p["pid"], p["state"], p["aggregates"], p["all_newer"]) == (pid, "idle in transaction", 1, False)
        assert p["held_above"] < held[0] and 0 < p["xact_age_seconds"] < 60
        (note,) = obj["attention"]
        assert re.fullmatch(rf"held back: 1 open producing transaction \(pid {pid}, open (\d+ ms|\d+\.\d s), idle in "
                            r"transaction\) holds back 3 events of the 1 aggregate it wrote, until it commits or "
                            r"rolls back", note), note

    # Rolled back: nothing held any more, and a worker claimed a moment ago.
    after = run("status", "--dsn", dsn, "--json").json()
    assert (after["health"]["open_producers"], after["health"]["held_by_open_transactions"]) == (0, 0)
    assert after["producers"] == [] and after["attention"] == []


def test_status_when_an_open_transaction_holds_back_every_newer_event(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The report of issue 12: one producing transaction open (beyond commit_order_max_aggregates, so
    it holds back every newer event), a backlog of more than 1,000 events, a worker claiming."""
    conn.execute("UPDATE outbox_settings SET commit_order_max_aggregates = 1")
    with producing_transaction(dsn, "o-1", "o-2") as producer:
        pid = producer.info.backend_pid
        (horizon,) = producer.execute("SELECT held_above FROM outbox_open_producers() WHERE pid = pg_backend_pid()"
                                      ).fetchone()
        conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                     "SELECT 'order', 'o-' || (g % 50), 'created', '{}' FROM generate_series(1, 1200) g")
        assert claim(conn, 100) == []            # everything committed is newer than its horizon
        text, js = run_all(("status", "--dsn", dsn, "--health-only"), ("status", "--dsn", dsn, "--json"))
    assert text.code == 0, text
    assert f"holds back every event newer than id {horizon} (1200 events), until it commits or rolls back" in text.out
    assert f"(pid {pid}, open " in text.out
    assert "is a worker running?" not in text.out and "never" not in text.out, text.out
    h = js.json()["health"]
    assert (h["backlog"], h["held_by_open_transactions"], h["worker_claimed_last_minute"]) == (1200, 1200, True)
    assert js.json()["producers"][0]["all_newer"] is True


def test_status_names_a_claim_left_open_instead_of_asking_for_a_worker(dsn: str, conn: psycopg.Connection[Any],
                                                                        operator_dsn: str) -> None:
    """A session claimed after BEGIN and stays (psql): no claim takes new events in, and the claims'
    last_claim_at, written on the row it holds, stands still. status names that session, not a
    missing worker; an operator login sees it too."""
    insert(conn, "order", "o-1")
    conn.execute("UPDATE outbox_intake SET last_claim_at = now() - interval '61 seconds'")
    with psycopg.connect(dsn, application_name="left in psql") as left:
        assert len(claim(left, 1)) == 1                  # its transaction stays open, idle
        pid = left.info.backend_pid
        insert(conn, "order", "o-2")
        time.sleep(1.2)                                  # open for over a second
        text, js, as_operator = run_all(("status", "--dsn", dsn), ("status", "--dsn", dsn, "--json"),
                                        ("status", "--dsn", operator_dsn, "--json", "--health-only"))
        left.rollback()
    assert text.code == 0 and text.err == "", text
    assert "is a worker running?" not in text.out, text.out
    assert (f"  ! a claim's transaction is open in pid {pid} (open ") in text.out, text.out
    assert (", idle in transaction, application 'left in psql'): no claim takes new events in until it ends (the "
            f"server ends it once idle for its lease; SELECT pg_terminate_backend({pid}) ends it now)") in text.out
    for obj in (js.json(), as_operator.json()):
        (c,) = obj["open_claims"]
        assert (c["pid"], c["state"], c["application_name"]) == (pid, "idle in transaction", "left in psql")
        assert 1 <= c["xact_age_seconds"] < 60
    # Ended: a worker's claim in autocommit is never listed.
    assert len(claim(conn, 10)) == 2
    after = run("status", "--dsn", dsn, "--json").json()
    assert after["open_claims"] == [] and after["attention"] == []


def test_status_says_when_no_worker_claims(dsn: str, conn: psycopg.Connection[Any]) -> None:
    insert(conn, "order", "o-1")
    assert len(claim(conn, 10)) == 1
    insert(conn, "order", "o-2")
    conn.execute("UPDATE outbox_intake SET last_claim_at = now() - interval '61 seconds'")
    obj = run("status", "--dsn", dsn, "--json").json()
    assert obj["health"]["worker_claimed_last_minute"] is False
    assert obj["attention"] == ["backlog of 2 but no claim in the last minute: is a worker running?"]
    conn.execute("UPDATE outbox_intake SET last_claim_at = NULL")
    text = run("status", "--dsn", dsn)
    assert ["last", "claim", "never"] in [line.split() for line in text.out.splitlines()], text.out


def test_status_watch_refreshes_until_ctrl_c(dsn: str) -> None:
    p = start("status", "--dsn", dsn, "--json", "--watch", "0.2")
    assert p.stdout is not None
    first = orjson.loads(p.stdout.readline())
    second = orjson.loads(p.stdout.readline())
    assert first["health"]["backlog"] == 0 and second["checked_at"] > first["checked_at"]
    p.send_signal(signal.SIGINT)
    r = finish(p, timeout=20)
    assert r.code == 0 and "Traceback" not in r.err, r


def test_status_ok_on_an_idle_outbox_and_dsn_from_the_environment(dsn: str) -> None:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    pg_env = {"PGHOST": str(params["host"]), "PGPORT": str(params["port"]), "PGUSER": str(params["user"]),
              "PGDATABASE": str(params["dbname"])}
    procs = [start("status", "--health-only", env={"OUTBOXPG_DSN": dsn}), start("status", env=pg_env),
             start("dead", "list", env={"OUTBOXPG_DSN": dsn})]
    from_outboxpg_dsn, from_pg_vars, dead_list = (finish(p) for p in procs)
    assert from_outboxpg_dsn.code == 0, from_outboxpg_dsn
    assert "OK: nothing needs attention" in from_outboxpg_dsn.out
    assert "events by state" not in from_outboxpg_dsn.out
    assert from_pg_vars.code == 0 and "OK: nothing needs attention" in from_pg_vars.out, from_pg_vars
    assert "events by state" in from_pg_vars.out
    assert (dead_list.code, dead_list.out) == (0, "no dead letters\n"), dead_list


# -- dead list / show -------------------------------------------------------------------------

def test_dead_list_filters(dsn: str, data: dict[str, Any]) -> None:
    d = ("dead", "list", "--dsn", dsn)
    (everything, created, one_aggregate, literal, injected, since_interval, since_ts, since_future, limited,
     text, bad_since) = run_all(
        (*d, "--json"),
        (*d, "--json", "--event-type", "created"),
        (*d, "--json", "--aggregate-type", "order", "--aggregate-id", "o-2"),
        (*d, "--json", "--event-type", "x'OR'1'='1"),
        (*d, "--json", "--event-type", "created' OR '1'='1"),
        (*d, "--json", "--since", "1 hour"),
        (*d, "--json", "--since", "2000-01-01 00:00"),
        (*d, "--json", "--since", "tomorrow"),
        (*d, "--limit", "2"),
        (*d,),
        (*d, "--since", "next blue moon"))

    def listed(r: Result) -> set[int]:
        obj = r.json()
        assert obj["total"] == len(obj["dead_letters"])
        return {e["id"] for e in obj["dead_letters"]}

    all_dead = {data["dead_o1"], data["dead_o2"], data["dead_c1"], data["dead_inj"]}
    assert listed(everything) == all_dead
    assert listed(created) == {data["dead_o1"], data["dead_c1"]}
    assert listed(one_aggregate) == {data["dead_o2"]}
    # a filter value is data, never SQL: it matches only an event_type spelled exactly like it
    assert listed(literal) == {data["dead_inj"]}
    assert listed(injected) == set()
    assert listed(since_interval) == all_dead
    assert listed(since_ts) == all_dead
    assert listed(since_future) == set()

    row = next(e for e in everything.json()["dead_letters"] if e["id"] == data["dead_o1"])
    assert row["last_error"] == "payload too large\n(limit 1048576 bytes)" and row["attempts"] == 1

    assert limited.code == 0
    assert limited.out.splitlines()[-1].startswith("4 dead letters; showing the newest 2 (--limit)")
    assert len([line for line in limited.out.splitlines() if line.strip()[:1].isdigit()]) == 2 + 1  # rows + footer
    assert text.code == 0 and "payload too large ..." in text.out and "order/o-1" in text.out, text.out
    assert one_line_error(bad_since, EXIT_USAGE) == "outboxpg: --since: neither a timestamp nor an interval: 'next blue moon'"


def test_dead_show(dsn: str, data: dict[str, Any]) -> None:
    i = data["dead_o1"]
    text, js, missing = run_all(("dead", "show", str(i), "--dsn", dsn), ("dead", "show", str(i), "--dsn", dsn, "--json"),
                                ("dead", "show", "999999", "--dsn", dsn))
    assert text.code == 0, text
    assert text.out.startswith(f"event {i} (dead)\n")
    for expected in ('"order": "o-1"', '"Trace-Id": "abc"', "payload too large", "(limit 1048576 bytes)",
                     "held_back_behind_it  1", f"outboxpg dead requeue {i}"):
        assert expected in text.out, (expected, text.out)
    obj = js.json()
    assert obj["payload"] == {"order": "o-1", "items": [1, 2]} and obj["headers"] == {"Trace-Id": "abc"}
    assert obj["state"] == "dead" and obj["held_back_behind_it"] == 1 and obj["last_error"].startswith("payload")
    assert one_line_error(missing, 1) == "outboxpg: no event with id 999999"


# -- dead requeue / discard -------------------------------------------------------------------

def test_several_events_need_confirmation_and_no_tty_refuses(dsn: str, conn: psycopg.Connection[Any],
                                                             data: dict[str, Any]) -> None:
    before = dead_ids(conn)
    all_requeue, two_discard, no_selection, both = run_all(
        ("dead", "requeue", "--dsn", dsn, "--all-matching"),
        ("dead", "discard", "--dsn", dsn, str(data["dead_o1"]), str(data["dead_o2"]), "--reason", "x"),
        ("dead", "requeue", "--dsn", dsn),
        ("dead", "requeue", "--dsn", dsn, "--all-matching", str(data["dead_o1"])))
    assert one_line_error(all_requeue, 1) == \
        "outboxpg: refusing to requeue 4 events without confirmation: stdin is not a terminal (pass --yes)"
    assert one_line_error(two_discard, 1) == \
        "outboxpg: refusing to discard 2 events without confirmation: stdin is not a terminal (pass --yes)"
    assert "which events?" in one_line_error(no_selection, EXIT_USAGE)
    assert "not both" in one_line_error(both, EXIT_USAGE)
    assert dead_ids(conn) == before


def test_requeue_one_by_id_needs_no_confirmation(dsn: str, conn: psycopg.Connection[Any], data: dict[str, Any]) -> None:
    r = run("dead", "requeue", "--dsn", dsn, str(data["dead_o2"]))
    assert (r.code, r.out, after_target(r.err)) == (0, f"requeued 1 event: {data['dead_o2']}\n", ""), r
    row = conn.execute("SELECT state::text, attempts, last_error FROM outbox WHERE id = %s",
                       (data["dead_o2"],)).fetchone()
    assert row == ("pending", 0, "boom paid")


def test_requeue_ids_that_are_not_dead_are_reported(dsn: str, conn: psycopg.Connection[Any],
                                                    data: dict[str, Any]) -> None:
    published = data["published"][0]
    mixed, none_dead = run_all(("dead", "requeue", "--dsn", dsn, str(data["dead_c1"]), str(published), "424242"),
                               ("dead", "requeue", "--dsn", dsn, str(data["pending"])))
    assert mixed.code == 1 and mixed.out == f"requeued 1 event: {data['dead_c1']}\n", mixed
    assert mixed.err.startswith(f"outboxpg: not dead, left alone: {published} (published), 424242 (no such event)\n")
    assert after_target(mixed.err.split("\n", 1)[1]) == "", mixed
    assert none_dead.code == 1 and none_dead.err.splitlines()[-1] == \
        "outboxpg: nothing to requeue: none of the given events is dead", none_dead
    assert state_of(conn, data["dead_c1"]) == "pending" and state_of(conn, published) == "published"
    assert state_of(conn, data["pending"]) == "pending"


def test_requeue_all_matching_with_yes(dsn: str, conn: psycopg.Connection[Any], data: dict[str, Any]) -> None:
    injected = run("dead", "requeue", "--dsn", dsn, "--all-matching", "--yes", "--event-type", "created' OR '1'='1")
    assert injected.code == 0 and injected.out == "no dead letters match: nothing to do\n", injected
    assert len(dead_ids(conn)) == 4

    r = run("dead", "requeue", "--dsn", dsn, "--all-matching", "--yes", "--event-type", "created")
    assert r.code == 0 and after_target(r.err) == "", r
    assert r.out == f"requeued 2 events: {data['dead_o1']}, {data['dead_c1']}\n"
    assert dead_ids(conn) == {data["dead_o2"], data["dead_inj"]}


def test_discard_all_matching_with_reason(dsn: str, conn: psycopg.Connection[Any], data: dict[str, Any]) -> None:
    no_reason, blank_reason = run_all(("dead", "discard", "--dsn", dsn, str(data["dead_o1"])),
                                      ("dead", "discard", "--dsn", dsn, str(data["dead_o1"]), "--reason", "  "))
    assert one_line_error(no_reason, 2) == ("outboxpg: the following arguments are required: --reason "
                                            "(see outboxpg dead discard --help)")
    assert one_line_error(blank_reason, EXIT_USAGE) == \
        "outboxpg: --reason must not be blank (it is kept with each discarded event)"

    r = run("dead", "discard", "--dsn", dsn, "--all-matching", "--aggregate-type", "order", "--since", "1 day",
            "--reason", "superseded by a manual fix", "--yes")
    assert r.code == 0, r
    gone = sorted([data["dead_o1"], data["dead_o2"], data["dead_inj"]])
    assert r.out == f"discarded 3 events: {', '.join(map(str, gone))}\n"
    rows = conn.execute("SELECT id, state::text, discard_reason FROM outbox WHERE id = ANY(%s) ORDER BY id",
                        (gone,)).fetchall()
    assert rows == [(i, "discarded", "superseded by a manual fix") for i in gone]
    assert dead_ids(conn) == {data["dead_c1"]}
    # the event held back behind dead_o1 is free now
    assert conn.execute("SELECT id FROM outbox_claim(10)").fetchall() == [(data["held"],), (data["pending"],)]


def test_confirmation_on_a_terminal(dsn: str, conn: psycopg.Connection[Any], data: dict[str, Any]) -> None:
    args = ["dead", "requeue", "--dsn", dsn, "--all-matching", "--aggregate-type", "order"]
    no = run_on_tty(args, "n\n")
    assert no.code == 1 and no.out == "", no
    assert "About to requeue 3 dead events:" in no.err and "Requeue these 3 dead events? [y/N]" in no.err
    assert [line.split() for line in no.err.splitlines() if line.strip().startswith("order")] == \
        [["order", "created", "1"], ["order", "paid", "1"], ["order", "x'OR'1'='1", "1"]]
    assert no.err.rstrip().endswith("outboxpg: cancelled: nothing changed")
    assert len(dead_ids(conn)) == 4

    yes = run_on_tty(args, "y\n")
    assert yes.code == 0 and yes.out.startswith("requeued 3 events: "), yes
    assert dead_ids(conn) == {data["dead_c1"]}


# -- maintain ---------------------------------------------------------------------------------

def test_maintain_dry_run_then_for_real(dsn: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("UPDATE outbox_settings SET partitions_ahead = partitions_ahead + 2")
    before = conn.execute("SELECT count(*) FROM outbox_partitions").fetchone()
    # one after the other: a concurrent outbox_maintain() (dry or not) reports 'skip' (advisory lock)
    dry, dry_json = run("maintain", "--dsn", dsn, "--dry-run"), run("maintain", "--dsn", dsn, "--dry-run", "--json")
    assert dry.code == 0 and dry.out.startswith("outbox_maintain(dry_run => true): what it would do:"), dry
    assert [line.split()[0] for line in dry.out.splitlines()[3:]] == ["create", "create"], dry.out
    actions = dry_json.json()["actions"]
    assert dry_json.json()["dry_run"] is True and [a["action"] for a in actions] == ["create", "create"]
    assert conn.execute("SELECT count(*) FROM outbox_partitions").fetchone() == before

    real = run("maintain", "--dsn", dsn)
    assert real.code == 0 and real.out.startswith("outbox_maintain(): done:"), real
    names = {a["partition"] for a in actions}
    assert all(name in real.out for name in names)
    assert conn.execute("SELECT count(*) FROM outbox_partitions").fetchone() == (before[0] + 2,)  # type: ignore[index]
    again = run("maintain", "--dsn", dsn, "--dry-run")
    assert again.out.strip().endswith("nothing (every partition needed exists, none is past retention)"), again


# -- errors: one line, no traceback, no password ---------------------------------------------

def test_usage_errors_are_one_line_naming_the_help_to_read() -> None:
    """A flag, a command or a value argparse refuses: one line on stderr, exit 2, no usage block;
    the hint names the --help of the (sub)command the bad argument belongs to."""
    expected = {
        ("status", "--bogus"): "unrecognized arguments: --bogus (see outboxpg status --help)",
        ("--bogus", "status"): "unrecognized arguments: --bogus (see outboxpg --help)",
        ("--bogus",): "unrecognized arguments: --bogus (see outboxpg --help)",
        ("nosuch",): "argument COMMAND: invalid choice: 'nosuch' (choose from 'migrate', 'sql', 'status', "
                     "'maintain', 'dead', 'replay', 'demo') (see outboxpg --help)",
        ("status", "--watch", "abc"): "argument --watch: not a number of seconds: 'abc' (see outboxpg status --help)",
        ("migrate", "--steps", "x"): "argument --steps: invalid int value: 'x' (see outboxpg migrate --help)",
        ("dead", "list", "--bogus"): "unrecognized arguments: --bogus (see outboxpg dead list --help)",
        ("dead", "nosuch"): "argument ACTION: invalid choice: 'nosuch' (choose from 'list', 'show', 'requeue', "
                            "'discard') (see outboxpg dead --help)",
        ("sql", "extra"): "unrecognized arguments: extra (see outboxpg sql --help)",
    }
    for r in run_all(*expected):
        assert one_line_error(r, EXIT_USAGE) == f"outboxpg: {expected[r.args]}"


def test_cannot_connect(dsn: str) -> None:
    results = run_all(
        ("status", "--dsn", f"host=127.0.0.1 port=1 user=postgres dbname=x password={SECRET}"),
        ("dead", "list", "--dsn", f"postgresql://postgres:{SECRET}@127.0.0.1:1/x"),
        ("maintain", "--dsn", f"host=127.0.0.1 port=1 password='{SECRET} with space'"),
        ("dead", "show", "1", "--dsn", f"host=127.0.0.1 password={SECRET} broken"),      # not a valid string
        ("status", "--dsn", f"postgresql://postgres:{SECRET}%zz@127.0.0.1:1/x"),         # bad percent-encoding
        ("dead", "requeue", "1", "--dsn", "host=127.0.0.1 port=1"),
        ("migrate", "--status", "--dsn", f"host=127.0.0.1 port=1 password={SECRET}"),
    )
    for i, r in enumerate(results):
        if i in (3, 4):   # not a connection string: bad usage
            assert one_line_error(r, EXIT_USAGE).startswith("outboxpg: invalid connection string"), r
        else:
            assert one_line_error(r, EXIT_CONNECT).startswith("outboxpg: cannot connect to PostgreSQL: "), r
        assert SECRET not in r.out + r.err, r
    assert "Connection refused" in results[0].err
    assert "withheld" in results[3].err and "withheld" in results[4].err
    # a password in $OUTBOXPG_DSN or $PGPASSWORD does not show either
    env_dsn = run("status", env={"OUTBOXPG_DSN": f"host=127.0.0.1 port=1 password={SECRET}", "PGPASSWORD": SECRET})
    assert one_line_error(env_dsn, EXIT_CONNECT).startswith("outboxpg: cannot connect to PostgreSQL: ")
    assert SECRET not in env_dsn.err


def test_database_without_the_schema(empty_dsn: str) -> None:
    with_password = f"{empty_dsn} password={SECRET}"  # the test server trusts local connections
    for r in run_all(("status", "--dsn", with_password), ("dead", "list", "--dsn", with_password),
                     ("dead", "requeue", "--all-matching", "--yes", "--dsn", empty_dsn),
                     ("maintain", "--dry-run", "--dsn", empty_dsn)):
        p = psycopg.conninfo.conninfo_to_dict(empty_dsn)
        assert one_line_error(r, EXIT_SCHEMA) == NOT_INSTALLED.format(where=f"database {p['dbname']} on {p['host']}:{p['port']}")
        assert SECRET not in r.err


def test_schema_older_than_this_version(empty_dsn: str) -> None:
    steps = [p.name.removesuffix(".sql") for p in sorted(sql_files.migrations_dir().glob("[0-9]*.sql"))
             if not p.name.endswith(".rollback.sql")]
    migrate = run("migrate", "--dsn", empty_dsn)
    assert migrate.code == 0 and migrate.out.splitlines() == [f"applied {s}" for s in steps], migrate
    rollback = run("migrate", "--dsn", empty_dsn, "--rollback", "--steps", "2", "--yes")
    assert rollback.code == 0 and rollback.out.splitlines() == [f"rolled back {s}" for s in steps[:-3:-1]]

    status, listing, migrate_status = run_all(("status", "--dsn", empty_dsn), ("dead", "list", "--dsn", empty_dsn),
                                              ("migrate", "--status", "--dsn", empty_dsn))
    expected = "outboxpg: the outbox schema is not up to date (2 steps pending): run outboxpg migrate --dsn ..."
    assert one_line_error(status, EXIT_SCHEMA) == expected
    assert one_line_error(listing, EXIT_SCHEMA) == expected
    assert migrate_status.out.splitlines()[-2:] == [f"pending  {s}" for s in steps[-2:]]

    assert run("migrate", "--dsn", empty_dsn).code == 0
    assert run("status", "--dsn", empty_dsn, "--health-only").code == 0

    # installed by hand (no yoyo bookkeeping) and missing the newest view: found by looking for it
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        c.execute("DROP TABLE _yoyo_migration, _yoyo_log, _yoyo_version, yoyo_lock")
        c.execute("DROP VIEW outbox_health")
    assert one_line_error(run("status", "--dsn", empty_dsn), EXIT_SCHEMA) == (
        "outboxpg: the outbox schema is not up to date (view outbox_health is missing): run outboxpg migrate "
        "--dsn ... (or apply the newer files of migrations/ with psql)")


def test_password_never_shown_on_success(dsn: str, data: dict[str, Any]) -> None:
    with_password = f"{dsn} password={SECRET}"
    for r in run_all(("status", "--dsn", with_password), ("status", "--json", "--dsn", with_password),
                     ("dead", "list", "--dsn", with_password), ("dead", "show", str(data["dead_o1"]), "--dsn",
                                                                with_password),
                     ("maintain", "--dry-run", "--dsn", with_password)):
        assert r.code == 0, r
        assert SECRET not in r.out + r.err


def test_every_command_works_as_an_outbox_operator_login(operator_dsn: str, conn: psycopg.Connection[Any],
                                                        data: dict[str, Any]) -> None:
    op = operator_dsn
    status, listing, show, dry = run_all(("status", "--json", "--dsn", op), ("dead", "list", "--json", "--dsn", op),
                                         ("dead", "show", str(data["dead_o1"]), "--dsn", op),
                                         ("maintain", "--dry-run", "--dsn", op))
    assert status.json()["health"]["dead"] == 4 and status.json()["states"]["published"] == 2
    assert listing.json()["total"] == 4
    assert show.code == 0 and "payload too large" in show.out, show
    assert '"order": "o-1"' not in show.out and "(payload and headers not shown: this role may not read them)" in show.out
    assert dry.code == 0, dry
    shown = run("dead", "show", str(data["dead_o1"]), "--json", "--dsn", op).json()
    assert "payload" not in shown and shown["not_readable"] == ["payload", "headers"]

    requeue, discard = run_all(("dead", "requeue", str(data["dead_o2"]), "--dsn", op),
                               ("dead", "discard", "--all-matching", "--aggregate-type", "customer", "--reason", "gone",
                                "--yes", "--dsn", op))
    assert (requeue.code, discard.code) == (0, 0), (requeue, discard)
    assert state_of(conn, data["dead_o2"]) == "pending" and state_of(conn, data["dead_c1"]) == "discarded"
    password = psycopg.conninfo.conninfo_to_dict(op)["password"]
    assert all(password not in r.out + r.err for r in (status, listing, show, dry, requeue, discard))


def test_sql_command_prints_the_current_schema() -> None:
    r = run("sql")
    assert r.code == 0 and r.out == sql_files.install_sql()
    assert "-- ==== schema/40_claim.sql ====" in r.out


def test_a_database_with_steps_this_version_does_not_ship(empty_dsn: str) -> None:
    """A development database that ran the steps of a release in the making (0016_outbox_views_for_cli
    ... 0031_outbox_heads_parked, before they became 0016_schema_2): migrate and the other commands
    say in one line what it is and what to do, and change nothing."""
    first = [s for s in sql_files.released_steps() if s <= "0015"]
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        for step in first:
            c.execute((sql_files.migrations_dir() / f"{step}.sql").read_text())
    assert run("migrate", "--adopt", "--dsn", empty_dsn).code == 0     # yoyo records schema-1's steps
    dev = ["0016_outbox_views_for_cli", "0017_outbox_xmin_holder", "0031_outbox_heads_parked"]
    with psycopg.connect(empty_dsn, autocommit=True) as c:
        for step in dev:
            c.execute("INSERT INTO _yoyo_migration (migration_hash, migration_id, applied_at_utc) "
                      "VALUES (encode(sha256(convert_to(%s, 'UTF8')), 'hex'), %s, now())", (step, step))
    p = psycopg.conninfo.conninfo_to_dict(empty_dsn)
    where = f"database {p['dbname']} on {p['host']}:{p['port']}"
    migrate = run("migrate", "--dsn", empty_dsn)
    assert one_line_error(migrate, EXIT_SCHEMA) == (
        f"outboxpg: {where} records outbox steps this version does not ship ({', '.join(dev)}): steps of a "
        "release in the making, since squashed into one step; roll them back with the outboxpg that made them "
        "(outboxpg migrate --rollback --steps N), or migrate a new database")
    assert one_line_error(run("status", "--dsn", empty_dsn), EXIT_SCHEMA) == (
        f"outboxpg: the outbox schema in {where} has steps this version does not ship ({', '.join(dev)}): "
        "outboxpg migrate says what to do")
    with psycopg.connect(empty_dsn) as c:
        assert c.execute("SELECT to_regclass('outbox_failing')").fetchone() == (None,)      # nothing applied


def test_discarding_even_one_dead_event_asks(dsn: str, conn: psycopg.Connection[Any], data: dict[str, Any]) -> None:
    """A discard is never undone: asked for one event too (a requeue of one is not: see above)."""
    refused = run("dead", "discard", "--dsn", dsn, str(data["dead_o1"]), "--reason", "x")
    assert one_line_error(refused, 1) == \
        "outboxpg: refusing to discard 1 event without confirmation: stdin is not a terminal (pass --yes)"
    no = run_on_tty(["dead", "discard", "--dsn", dsn, str(data["dead_o1"]), "--reason", "x"], "n\n")
    assert no.code == 1 and "Discard this dead event? [y/N]" in no.err and "cancelled: nothing changed" in no.err, no
    assert state_of(conn, data["dead_o1"]) == "dead"
    yes = run_on_tty(["dead", "discard", "--dsn", dsn, str(data["dead_o1"]), "--reason", "x"], "y\n")
    assert (yes.code, yes.out) == (0, f"discarded 1 event: {data['dead_o1']}\n"), yes
    assert state_of(conn, data["dead_o1"]) == "discarded"
