"""`outboxpg-worker` over several databases (repeated --dsn, --dsn-file re-read on SIGHUP), as a
process: labels in the log and in /metrics, /readyz over the databases, a database added,
removed and unchanged on reload, a bad file on reload, a database unavailable at start checked
again while the others run, and what refuses to start. `outboxpg status` over several --dsn.
(docs/how-to/many-databases.md; the relay itself under a locked and a refusing database:
tests/relay/test_fleet.py.)"""

from __future__ import annotations

import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg
from commands import WORKER, Proc, cli_env, run
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from pytest_postgresql.executors import NoopExecutor

from outboxpg.cli.errors import EXIT_CONNECT, EXIT_USAGE
from outboxpg.embedded import free_port

PRINT = "outboxpg.relay.publishers:print_event"
SECRET = "S3cr3t-pw-never-shown"


def label(dsn: str) -> str:
    p = conninfo_to_dict(dsn)
    return f"{p['dbname']}@{p['host']}:{p['port']}"


def write(dsn: str, n: int, tag: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                  "SELECT 'order', %s || '-' || g, 'created', '{}' FROM generate_series(1, %s) g", (tag, n))


def published(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        return int(c.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0])  # type: ignore[index]


def until(pred: Callable[[], bool], timeout: float, what: str, w: Proc) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert w.p.poll() is None, f"exited {w.p.returncode}: {w.text()}"
        assert time.monotonic() < end, f"{what} not within {timeout}s: {w.text()}"
        time.sleep(0.05)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_several_databases_with_a_file_reloaded_on_sighup(more_databases: Callable[[int], list[str]],
                                                         tmp_path: Path) -> None:
    a, b, c = more_databases(3)
    listing = tmp_path / "databases.txt"
    listing.write_text(f"# tenants\nname=bee {b}\n\n")
    port = free_port()
    w = Proc(tmp_path, "--dsn", a, "--dsn-file", str(listing), "--publisher", PRINT, "--metrics-port", str(port),
             "--poll-interval", "1")
    try:
        write(a, 3, "a")
        write(b, 4, "b")
        until(lambda: published(a) == 3 and published(b) == 4, 20, "a's and b's events", w)
        # Each database's lines say which; the metrics carry the label, never a password.
        assert re.search(rf"event=start database={re.escape(label(a))} worker=", w.text()), w.text()
        assert "event=first_delivery database=bee " in w.text(), w.text()
        metrics = get(port, "/metrics")[1]
        assert f'outboxpg_events_delivered_total{{database="{label(a)}",event_type="created"}} 3.0' in metrics
        assert 'outboxpg_events_delivered_total{database="bee",event_type="created"} 4.0' in metrics
        assert 'outboxpg_backlog_events{database="bee"} 0.0' in metrics
        assert get(port, "/readyz") == (200, "ok\n")

        # Added: c. Removed: bee. Unchanged: a (given by --dsn; not in the file at all).
        listing.write_text(f"{c}\n")
        w.p.send_signal(signal.SIGHUP)
        w.wait_for("event=reload databases=2 added=1 removed=1 unchanged=1", 15)
        w.wait_for("event=stopped database=bee", 15)
        write(a, 2, "a2")
        write(b, 2, "b2")
        write(c, 5, "c")
        until(lambda: published(a) == 5 and published(c) == 5, 20, "a's and c's events after the reload", w)
        time.sleep(0.5)
        assert published(b) == 4, "a database removed from the file is not served any more"
        assert w.count(f"event=start database={label(a)} ") == 1, "a ran on untouched"
        metrics = get(port, "/metrics")[1]
        assert 'database="bee"' not in metrics and f'database="{label(c)}"' in metrics

        # A file that does not parse: logged, and the same databases served.
        listing.write_text("name= nothing\n")
        w.p.send_signal(signal.SIGHUP)
        w.wait_for("event=reload_failed", 15)
        write(c, 1, "c2")
        until(lambda: published(c) == 6, 20, "c's event after a bad reload", w)
    finally:
        assert w.stop() == 0
    assert "Traceback" not in w.text()


def test_a_database_unavailable_at_start_is_checked_again_while_the_others_run(
        more_databases: Callable[[int], list[str]], outbox_template: NoopExecutor, tmp_path: Path) -> None:
    (up,) = more_databases(1)
    name = f"{conninfo_to_dict(up)['dbname']}_later"
    later = make_conninfo(up, dbname=name, password=SECRET)
    port = free_port()
    w = Proc(tmp_path, "--dsn", up, "--dsn", later, "--publisher", PRINT, "--metrics-port", str(port))
    admin = psycopg.connect(up, autocommit=True)
    try:
        w.wait_for(f"event=database_unavailable database={name}@", 20)
        write(up, 3, "up")
        until(lambda: published(up) == 3, 20, "the available database's events", w)
        status, body = get(port, "/readyz")
        assert status == 200 and body.startswith(f"ok: 1 of 2 databases not ready: {label(later)}: cannot connect"), body
        admin.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(outbox_template.template_dbname)))
        w.wait_for(f"event=database_available database={label(later)}", 20)
        write(later, 2, "later")
        until(lambda: published(later) == 2, 20, "the late database's events", w)
        until(lambda: get(port, "/readyz") == (200, "ok\n"), 10, "ready over both", w)
    finally:
        assert w.stop() == 0
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        admin.close()
    assert SECRET not in w.text()


def _one_line(r: subprocess.Popen[str]) -> str:
    out, err = r.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("outboxpg-worker: "), err
    assert SECRET not in err + out
    return f"{r.returncode} {lines[0].removeprefix('outboxpg-worker: ')}"


def test_what_refuses_to_start_over_several_databases(dsn: str, tmp_path: Path) -> None:
    p = conninfo_to_dict(dsn)
    down = f"host=127.0.0.1 port={free_port()} user=u dbname=x password={SECRET}"
    bad_file = tmp_path / "bad.txt"
    bad_file.write_text(f"{dsn}\nname=two host=127.0.0.1 password='{SECRET}\n")
    twice = tmp_path / "twice.txt"
    twice.write_text(f"{dsn}\n")
    cases = {   # all at once: each is a process start
        ("--dsn", dsn, "--dsn", "dbname='x"):
            f"{EXIT_USAGE} invalid connection string: unterminated quoted string in connection info string",
        ("--dsn-file", str(bad_file)):
            f"{EXIT_USAGE} --dsn-file {bad_file}:2: invalid connection string (libpq's message is withheld because "
            "the string holds a password)",
        ("--dsn", dsn, "--dsn-file", str(twice)):
            f"{EXIT_USAGE} two databases are labelled '{p['dbname']}@{p['host']}:{p['port']}' (--dsn and {twice}:1): "
            "give one a name=LABEL in the --dsn-file",
        ("--dsn-file", str(tmp_path / "missing.txt")):
            f"{EXIT_USAGE} --dsn-file {tmp_path / 'missing.txt'}: cannot read it: No such file or directory",
        ("--dsn", down, "--dsn", make_conninfo(down, dbname="y")):
            f"{EXIT_CONNECT} no database passed its start-up checks; x@127.0.0.1:",
        ("--dsn", dsn, "--dsn", down, "--cloudevents"):
            f"{EXIT_USAGE} --cloudevents over several databases needs --cloudevents-source (its default names one "
            "database)",
    }
    procs = {args: subprocess.Popen([WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env=cli_env()) for args in cases}
    for args, expected in cases.items():
        line = _one_line(procs[args])
        assert line.startswith(expected) if expected.endswith(":") else line == expected, (args, line)


def test_status_over_several_databases(more_databases: Callable[[int], list[str]]) -> None:
    a, b = more_databases(2)
    write(b, 2, "b")
    down = f"host=127.0.0.1 port={free_port()} user=u dbname=x password={SECRET}"
    r = run("status", "--health-only", "--dsn", a, "--dsn", down, "--dsn", b)
    assert r.code == EXIT_CONNECT, r
    blocks = r.out.split("\n\noutboxpg status: ")
    assert len(blocks) == 2, r.out
    assert blocks[0].startswith(f"outboxpg status: database {conninfo_to_dict(a)['dbname']} on ")
    assert blocks[1].startswith(f"database {conninfo_to_dict(b)['dbname']} on ") and "backlog                      2" \
        in blocks[1], r.out
    assert r.err.startswith("outboxpg: --dsn #2: cannot connect to PostgreSQL: ") and r.err.count("\n") == 1, r.err
    assert SECRET not in r.err + r.out
    lines = run("status", "--json", "--health-only", "--dsn", a, "--dsn", b).out.splitlines()
    objs: list[dict[str, Any]] = [orjson.loads(line) for line in lines]
    assert [o["database"]["dbname"] for o in objs] == [conninfo_to_dict(a)["dbname"], conninfo_to_dict(b)["dbname"]]
    assert [o["health"]["backlog"] for o in objs] == [0, 2]
