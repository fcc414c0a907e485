"""SQL injection (issue 5): quoting and placeholder tricks through every text field, into the
insert, the SQL functions and the `outboxpg` command line's filters. Each value must have no
effect beyond itself: the tables are still there, the value is stored and handed back
verbatim, and a filter matches it literally (equality, not LIKE; a quote is a quote).

The command line runs in this process (`outboxpg.cli.outboxpg.main(argv)`, its real entry point) so that
a hundred invocations stay cheap; one runs as a subprocess, as a shell would start it.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import orjson
import psycopg
import pytest
from hostile import INJECTIONS
from psycopg.rows import dict_row

from outboxpg import Event, enqueue, enqueue_many
from outboxpg.cli.errors import EXIT_USAGE
from outboxpg.cli.outboxpg import main as outboxpg_main

Conn = psycopg.Connection[Any]

# Values that NATS subjects and header names can hold: no whitespace, no '.', '*', '>' or ':'.
SUBJECT_SAFE = [v for v in INJECTIONS if v and not any(c.isspace() or c in ".*>" for c in v)]
HEADER_NAME_SAFE = [v for v in INJECTIONS if v and not any(c.isspace() or c == ":" for c in v)]


def name_for(v: str) -> str:
    """v as an aggregate or event type, if it can be one (a subject token), else a stand-in."""
    return v if v in SUBJECT_SAFE else "inj"


@pytest.fixture
def canary(conn: Conn) -> Conn:
    """A table that an injected DROP TABLE hi_canary or DELETE would hit; explicit subjects under
    "inj" allowed (outbox_settings.allowed_subject_prefixes)."""
    conn.execute("CREATE TABLE hi_canary (x int); INSERT INTO hi_canary VALUES (1)")
    conn.execute("UPDATE outbox_settings SET allowed_subject_prefixes = '{inj}'")
    return conn


def intact(conn: Conn, events: int) -> None:
    assert conn.execute("SELECT to_regclass('outbox') IS NOT NULL, to_regclass('hi_canary') IS NOT NULL").fetchone() \
        == (True, True)
    assert conn.execute("SELECT count(*) FROM hi_canary").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (events,)


def claim_all(conn: Conn, worker: str | None = "inj-test") -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM outbox_claim(1000, '1 minute', %s)", (worker,)).fetchall()


def test_insert_and_claim_hand_back_every_field_verbatim(conn: Conn, canary: Conn, dsn: str) -> None:
    with psycopg.connect(dsn) as tx:
        for i, v in enumerate(INJECTIONS):
            # aggregate_type and event_type are subject tokens: the values that can be one go
            # there too (the others are refused: test_names_that_are_not_subject_tokens_are_refused).
            name = name_for(v)
            enqueue(tx, name, v, name, {"v": v, v: [v]}, subject=f"inj.one.{i}", headers={"X-Value": v}, msg_id=v)
            enqueue_many(tx, [Event(name, f"{v}-many", name, {"v": v}, subject=f"inj.many.{i}",
                                    headers={"X-Value": v}, msg_id=f"{v}-many")])
        for i, v in enumerate(SUBJECT_SAFE):
            enqueue(tx, "subject", str(i), "e", {}, subject=f"inj.{v}")
        for i, v in enumerate(HEADER_NAME_SAFE):
            enqueue(tx, "header", str(i), "e", {}, headers={v: v})
        # Raw JSON text with the values inside, as the payload.
        for i, v in enumerate(INJECTIONS):
            enqueue(tx, "raw", str(i), "e", orjson.dumps({"v": v}))
        tx.commit()
    total = 2 * len(INJECTIONS) + len(SUBJECT_SAFE) + len(HEADER_NAME_SAFE) + len(INJECTIONS)
    intact(conn, total)
    rows = claim_all(conn)
    assert len(rows) == total
    for r in rows:
        if r["aggregate_type"] == "subject":
            assert r["subject"] == f"inj.{SUBJECT_SAFE[int(r['aggregate_id'])]}"
        elif r["aggregate_type"] == "header":
            v = HEADER_NAME_SAFE[int(r["aggregate_id"])]
            assert r["headers"] == {v: v}
        elif r["aggregate_type"] == "raw":
            assert r["payload"] == {"v": INJECTIONS[int(r["aggregate_id"])]}
        else:
            kind, i = r["subject"].split(".")[1:]
            v, many = INJECTIONS[int(i)], kind == "many"
            assert r["aggregate_type"] == r["event_type"] == name_for(v)
            assert (r["aggregate_id"], r["msg_id"]) == ((f"{v}-many", f"{v}-many") if many else (v, v))
            assert r["headers"] == {"X-Value": v}
            assert r["payload"] == ({"v": v} if many else {"v": v, v: [v]})


def test_names_that_are_not_subject_tokens_are_refused(conn: Conn, canary: Conn) -> None:
    refused = [v for v in INJECTIONS if v and v not in SUBJECT_SAFE and "." not in v]
    assert refused
    for v in refused:
        for column in ("aggregate_type", "event_type"):
            names = {"aggregate_type": "inj", "event_type": "e", column: v}
            with pytest.raises(psycopg.errors.CheckViolation) as exc:
                enqueue(conn, names["aggregate_type"], "1", names["event_type"], {}, subject="inj.explicit")
            assert exc.value.diag.constraint_name == "outbox_subject_is_valid_nats_subject"
    intact(conn, 0)


def test_functions_store_worker_names_errors_and_reasons_verbatim(conn: Conn, canary: Conn) -> None:
    for i, _ in enumerate(INJECTIONS):
        enqueue(conn, "fn", str(i), "e", {})
    for v in INJECTIONS:
        # One claim per worker name: each takes the oldest due event.
        (row,) = claim_all_one(conn, v)
        assert conn.execute("SELECT locked_by FROM outbox WHERE id = %s", (row["id"],)).fetchone() == (v,)
        assert conn.execute("SELECT outbox_fail(%s, %s, %s, true)", (row["id"], row["lease_token"], v)).fetchone() \
            == ("dead",)
    with conn.cursor(row_factory=dict_row) as cur:
        dead = cur.execute("SELECT id, aggregate_id, last_error FROM outbox_dead_letters ORDER BY id").fetchall()
    assert [d["last_error"] for d in dead] == INJECTIONS
    for d in dead:
        reason = INJECTIONS[int(d["aggregate_id"])]
        if not reason.strip():
            continue   # blank reasons are refused (test_sql_contract)
        assert conn.execute("SELECT outbox_discard(%s, %s)", ([d["id"]], reason)).fetchone() == (1,)
        assert conn.execute("SELECT discard_reason FROM outbox WHERE id = %s", (d["id"],)).fetchone() == (reason,)
    intact(conn, len(INJECTIONS))


def claim_all_one(conn: Conn, worker: str) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM outbox_claim(1, '1 minute', %s)", (worker,)).fetchall()


# -- the command line ---------------------------------------------------------------------------

def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = outboxpg_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def dead_event(conn: Conn, aggregate_type: str, aggregate_id: str, event_type: str) -> int:
    i = enqueue(conn, aggregate_type, aggregate_id, event_type, {}, subject="inj.dead")
    (row,) = claim_all_one(conn, "w")
    assert row["id"] == i
    assert conn.execute("SELECT outbox_fail(%s, %s, 'x', true)", (i, row["lease_token"])).fetchone() == ("dead",)
    return i


def pg_reads_as_time(conn: Conn, text: str) -> bool:
    for cast in ("SELECT %s::timestamptz", "SELECT %s::interval"):
        try:
            with conn.transaction():
                conn.execute(cast, (text,))
            return True
        except psycopg.DataError:
            continue
    return False


def test_cli_filters_match_literally(conn: Conn, canary: Conn, dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`outboxpg dead list|requeue|discard` with --event-type / --aggregate-type / --aggregate-id /
    --since / --reason set to each value: what matches is the event holding exactly that value."""
    ids = {v: dead_event(conn, name_for(v), v, name_for(v)) for v in INJECTIONS}
    control = dead_event(conn, "order", "o-1", "created")
    total = len(ids) + 1
    flags = ("--event-type", "--aggregate-type", "--aggregate-id")
    for n, (v, i) in enumerate(ids.items()):
        flag = flags[n % 3]   # each value through one filter, each filter with a third of the values
        code, out, err = run_cli(capsys, "dead", "list", "--dsn", dsn, "--json", f"{flag}={v}")
        assert code == 0, err
        got = orjson.loads(out)
        # Types hold only the values that are subject tokens; any other matches nothing.
        expected = [i] if flag == "--aggregate-id" or v in SUBJECT_SAFE else []
        assert [d["id"] for d in got["dead_letters"]] == expected, (flag, v)
    # No filter, and filters that match nothing (a LIKE pattern or a quote trick would match all).
    code, out, _ = run_cli(capsys, "dead", "list", "--dsn", dsn, "--json", "--limit=0")
    assert orjson.loads(out)["total"] == total
    for v in ("o-%", "o-_", "%1", "' OR ''='", "o-1' --"):
        code, out, _ = run_cli(capsys, "dead", "list", "--dsn", dsn, "--json", f"--aggregate-id={v}")
        assert code == 0 and orjson.loads(out)["total"] == 0
    # --since is read by PostgreSQL as a timestamp or an interval, as a parameter: refused in one
    # line unless PostgreSQL reads the value as one (it reads '{0}' as an interval of 0).
    for v in INJECTIONS:
        code, out, err = run_cli(capsys, "dead", "list", "--dsn", dsn, f"--since={v}")
        if pg_reads_as_time(conn, v):
            assert code == 0, (v, err)
        else:
            assert code == EXIT_USAGE and err.startswith("outboxpg: --since: neither a timestamp nor an interval"), (v, err)
            assert len(err.splitlines()) == 1 or "\n" in v
    # requeue --all-matching with one value: exactly its event.
    for v in INJECTIONS[:8]:
        code, out, err = run_cli(capsys, "dead", "requeue", "--dsn", dsn, "--all-matching", "--yes",
                                 f"--aggregate-id={v}")
        assert code == 0, err
        assert conn.execute("SELECT state::text FROM outbox WHERE id = %s", (ids[v],)).fetchone() == ("pending",)
    assert conn.execute("SELECT count(*) FROM outbox WHERE state = 'dead'").fetchone() == (total - 8,)
    # discard with each value as the reason: stored verbatim.
    for v in INJECTIONS[8:]:
        code, out, err = run_cli(capsys, "dead", "discard", "--dsn", dsn, str(ids[v]), f"--reason={v}", "--yes")
        if not v.strip():
            assert code == EXIT_USAGE and "--reason must not be blank" in err
            continue
        assert code == 0, err
        assert conn.execute("SELECT state::text, discard_reason FROM outbox WHERE id = %s", (ids[v],)).fetchone() \
            == ("discarded", v)
    assert conn.execute("SELECT state::text FROM outbox WHERE id = %s", (control,)).fetchone() == ("dead",)
    code, out, err = run_cli(capsys, "status", "--dsn", dsn, "--json")
    assert code == 0, err
    intact(conn, total)


def test_cli_filter_as_a_shell_starts_it(conn: Conn, canary: Conn, dsn: str) -> None:
    v = "'); DROP TABLE outbox; --"
    i = dead_event(conn, "order", v, "created")
    r = subprocess.run([sys.executable, "-m", "outboxpg.cli", "dead", "list", "--dsn", dsn, "--json",
                        "--aggregate-id", v], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [d["id"] for d in orjson.loads(r.stdout)["dead_letters"]] == [i]
    intact(conn, 1)
