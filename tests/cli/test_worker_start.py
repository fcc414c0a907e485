"""outboxpg-worker started wrong (issue 10): a publisher module in the current directory, a
misspelt one, a metrics port it cannot bind, an environment variable that does not parse: one
line on stderr and exit 2, never a traceback. And what a DBA sees of a running worker in
pg_stat_activity (application_name), and --version of both tools."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import WORKER
from locks import WAKEUP_LOCK

from outboxpg import Event, enqueue_many

CLI = str(Path(sys.executable).parent / "outboxpg")
Conn = psycopg.Connection[Any]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_")) and k != "PYTHONPATH"}
    return {**env, **(extra or {})}


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
        exe: str = WORKER) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=_env(env))


def one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("outboxpg-worker: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def wait_for(conn: Conn, query: str, want: Any, timeout: float = 30, proc: subprocess.Popen[str] | None = None
             ) -> None:
    end = time.monotonic() + timeout
    while (got := conn.execute(query).fetchone()[0]) != want:  # type: ignore[index]
        assert time.monotonic() < end, f"{query}: {got!r}, not {want!r} within {timeout}s"
        assert proc is None or proc.poll() is None, f"exited {proc.returncode}: {proc.communicate()}"
        time.sleep(0.05)


def stop(p: subprocess.Popen[str]) -> tuple[str, str]:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    try:
        return p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.communicate()


@pytest.fixture
def pubdir(tmp_path: Path) -> Path:
    """A directory with a publisher module in it, as a user would have next to their code."""
    (tmp_path / "mypub.py").write_text("def publish(event):\n    print('GOT', event.id, event.subject, flush=True)\n")
    (tmp_path / "brokenpub.py").write_text("import outboxpg_no_such_dependency\n\ndef publish(event):\n    pass\n")
    (tmp_path / "raisingpub.py").write_text("raise RuntimeError('no credentials configured')\n")
    return tmp_path


# -- --publisher ------------------------------------------------------------------------------

def test_publisher_module_in_the_current_directory(dsn: str, conn: Conn, pubdir: Path) -> None:
    enqueue_many(conn, [Event("order", "1", "created", {"x": 1})])
    p = subprocess.Popen([WORKER, "--dsn", dsn, "--publisher", "mypub:publish", "--poll-interval", "0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=pubdir, env=_env())
    try:
        wait_for(conn, "SELECT count(*) FROM outbox WHERE state = 'published'", 1, proc=p)
    finally:
        out, err = stop(p)
    assert p.returncode == 0, err
    assert "GOT 1 outbox.order.created" in out


def test_publisher_that_cannot_be_loaded_is_one_line_exit_2(dsn: str, pubdir: Path) -> None:
    cases = {
        "nosuchmodule:publish": "cannot load --publisher nosuchmodule:publish: no module named 'nosuchmodule' "
                                f"(looked in the current directory {pubdir} and the Python path)",
        "mypub:publsh": "cannot load --publisher mypub:publsh: module 'mypub' has no attribute 'publsh'",
        "brokenpub:publish": "cannot load --publisher brokenpub:publish: importing brokenpub failed: "
                             "ModuleNotFoundError: No module named 'outboxpg_no_such_dependency'",
        "raisingpub:publish": "cannot load --publisher raisingpub:publish: importing raisingpub failed: "
                              "RuntimeError: no credentials configured",
        "mypub": "--publisher must look like module:callable, got 'mypub'",
    }
    procs = {spec: subprocess.Popen([WORKER, "--dsn", dsn, "--publisher", spec], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=pubdir, env=_env())
             for spec in cases}
    for spec, p in procs.items():
        out, err = p.communicate(timeout=60)
        line = one_line(subprocess.CompletedProcess(p.args, p.returncode, out, err), 2)
        assert line == f"outboxpg-worker: {cases[spec]}", (spec, line)


# -- --metrics-port ---------------------------------------------------------------------------

def test_metrics_port_that_cannot_be_bound_is_one_line_exit_2(dsn: str, pubdir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        base = ["--dsn", dsn, "--publisher", "mypub:publish", "--maintenance-interval", "0"]
        cases = {
            "in use": ([*base, "--metrics-port", str(port)],
                       f"cannot serve metrics on 127.0.0.1:{port}: address already in use"),
            "out of range": ([*base, "--metrics-port", "99999"],
                             "--metrics-port must be 0 (off) or a port from 1 to 65535, got 99999"),
            "negative": ([*base, "--metrics-port", "-1"],
                         "--metrics-port must be 0 (off) or a port from 1 to 65535, got -1"),
            "foreign address": ([*base, "--metrics-port", "19999", "--metrics-addr", "192.0.2.1"],
                                "cannot serve metrics on 192.0.2.1:19999: cannot assign requested address"),
            "unresolvable": ([*base, "--metrics-port", "19999", "--metrics-addr", "outboxpg-no-such-host.invalid"],
                             "cannot serve metrics on outboxpg-no-such-host.invalid:19999: "),
        }
        procs = {k: subprocess.Popen([WORKER, *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=pubdir, env=_env()) for k, (a, _) in cases.items()}
        for what, p in procs.items():
            try:
                out, err = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                out, err = stop(p)
            line = one_line(subprocess.CompletedProcess(p.args, p.returncode, out, err), 2)
            assert line.startswith(f"outboxpg-worker: {cases[what][1]}"), (what, line)


# -- the environment --------------------------------------------------------------------------

def test_environment_variable_that_does_not_parse_is_one_line_exit_2() -> None:
    cases = {
        ("OUTBOXPG_BATCH_SIZE", "abc"): "OUTBOXPG_BATCH_SIZE: not a whole number: 'abc'",
        ("OUTBOXPG_LEASE", "30s"): "OUTBOXPG_LEASE: not a number: '30s'",
        ("OUTBOXPG_METRICS_PORT", "x"): "OUTBOXPG_METRICS_PORT: not a whole number: 'x'",
        ("OUTBOXPG_LOG_LEVEL", "LOUD"): "OUTBOXPG_LOG_LEVEL: must be one of DEBUG, INFO, WARNING, ERROR: 'LOUD'",
        ("OUTBOXPG_POLL_ONLY", "maybe"):
            "OUTBOXPG_POLL_ONLY: not a yes/no value (1, true, yes, on; 0, false, no, off): 'maybe'",
    }
    for (name, value), message in cases.items():
        r = run("--help", env={name: value})
        assert one_line(r, 2) == f"outboxpg-worker: {message}", (name, r.stderr)
        assert r.stdout == ""
    ok = run("--help", env={"OUTBOXPG_BATCH_SIZE": "200"})
    assert ok.returncode == 0 and "(default: 200)" in ok.stdout, ok.stderr


def test_flag_that_does_not_parse_is_one_line_exit_2() -> None:
    cases = {
        ("--batch-size", "abc"): "argument --batch-size: invalid int value: 'abc'",
        ("--lease", "30s"): "argument --lease: invalid float value: '30s'",
        ("--log-level", "LOUD"): "argument --log-level: invalid choice: 'LOUD'",
        ("--no-such-flag", "1"): "unrecognized arguments: --no-such-flag 1",
    }
    for args, message in cases.items():
        line = one_line(run(*args), 2)
        assert line.startswith(f"outboxpg-worker: {message}") and line.endswith("(see outboxpg-worker --help)"), \
            (args, line)


def test_every_worker_option_has_its_flag_and_variable_declared_once() -> None:
    """WorkerConfig's fields are the worker's options: each one is a flag with its variable, and
    a value given either way reaches WorkerConfig."""
    import dataclasses

    from outboxpg.cli.options import env_name, flag_name, from_args
    from outboxpg.cli.outboxpg_worker import build_parser
    from outboxpg.relay.worker import WorkerConfig

    help_text = run("--help").stdout
    for f in dataclasses.fields(WorkerConfig):
        assert flag_name(f) in help_text and f"[{env_name(f)}]" in help_text, f.name
    parser = build_parser()
    args = parser.parse_args(["--dsn", "dbname=x", "--dsn", "dbname=y", "--batch-size", "7", "--poll-only"])
    assert args.dsn == ["dbname=x", "dbname=y"]   # --dsn repeated: a WorkerConfig per database
    cfg = from_args(WorkerConfig, args, dsn=args.dsn[0])
    assert (cfg.dsn, cfg.batch_size, cfg.poll_only, cfg.concurrency) == ("dbname=x", 7, True, WorkerConfig("").concurrency)
    saved = dict(os.environ)
    try:
        os.environ.update(OUTBOXPG_LEASE="45", OUTBOXPG_POLL_ONLY="off", OUTBOXPG_NAME="w9")
        cfg = from_args(WorkerConfig, build_parser().parse_args(["--lease", "50"]))
        assert (cfg.lease, cfg.poll_only, cfg.name) == (50.0, False, "w9")   # the flag wins over the variable
    finally:
        os.environ.clear()
        os.environ.update(saved)


# -- --version --------------------------------------------------------------------------------

def test_both_tools_say_their_version() -> None:
    import importlib.metadata

    version = importlib.metadata.version("outboxpg")
    worker, cli = run("--version"), run("--version", exe=CLI)
    assert (worker.returncode, worker.stdout, worker.stderr) == (0, f"outboxpg-worker {version}\n", "")
    assert (cli.returncode, cli.stdout, cli.stderr) == (0, f"outboxpg {version}\n", "")


# -- application_name -------------------------------------------------------------------------

def _app_names(conn: Conn, pattern: str) -> list[str]:
    return sorted(r[0] for r in conn.execute(
        "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
        "AND application_name LIKE %s", (pattern,)).fetchall())


@pytest.fixture
def running_worker(dsn: str, pubdir: Path) -> Iterator[subprocess.Popen[str]]:
    p = subprocess.Popen([WORKER, "--dsn", dsn, "--publisher", "mypub:publish", "--name", "relay-7",
                          "--maintenance-interval", "0", "--metrics-port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=pubdir, env=_env())
    try:
        yield p
    finally:
        out, err = stop(p)
        assert p.returncode == 0, err


def test_worker_connections_name_the_worker_in_pg_stat_activity(conn: Conn, running_worker: Any) -> None:
    # The claim pool, the LISTEN connection and the idle worker's wakeup-lock connection.
    wait_for(conn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                   "AND application_name = 'outboxpg-worker relay-7 (wakeup lock)'", 1, proc=running_worker)
    wait_for(conn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                   "AND application_name = 'outboxpg-worker relay-7 (listen)'", 1)
    names = _app_names(conn, "outboxpg-worker%")
    assert "outboxpg-worker relay-7" in names, names
    assert set(names) <= {"outboxpg-worker relay-7", "outboxpg-worker relay-7 (listen)",
                          "outboxpg-worker relay-7 (wakeup lock)"}, names
    # The lock a DBA wonders about is held by the connection named for it. The worker lets it go
    # while it claims (a maintenance pass, a wakeup): wait until it is idle and holds it again.
    # Only the wakeup lock: a claim holds advisory locks of its own while its transaction runs.
    wakeup = ("FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' AND l.granted "
              f"AND (l.classid, l.objid, l.objsubid) = ({WAKEUP_LOCK[0]}, {WAKEUP_LOCK[1]}, 2) "
              "AND a.datname = current_database()")
    wait_for(conn, "SELECT count(*) " + wakeup, 1)
    held = conn.execute("SELECT a.application_name " + wakeup).fetchall()
    assert held == [("outboxpg-worker relay-7 (wakeup lock)",)], held


def test_an_application_name_in_the_dsn_wins(dsn: str, conn: Conn, pubdir: Path) -> None:
    p = subprocess.Popen([WORKER, "--dsn", f"{dsn} application_name=billing-relay", "--publisher", "mypub:publish",
                          "--maintenance-interval", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=pubdir, env=_env())
    try:
        wait_for(conn, "SELECT count(*) >= 3 FROM pg_stat_activity WHERE datname = current_database() "
                       "AND application_name = 'billing-relay'", True, proc=p)
        assert _app_names(conn, "outboxpg-worker%") == []
    finally:
        stop(p)


def test_the_cli_names_itself_in_pg_stat_activity(dsn: str, conn: Conn) -> None:
    p = subprocess.Popen([CLI, "status", "--dsn", dsn, "--watch", "0.2", "--json"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env(),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout is not None
        p.stdout.readline()
        assert _app_names(conn, "outboxpg") == ["outboxpg"]
    finally:
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=20)


def test_a_signal_sent_twice_as_gnu_timeout_does_stops_it_quietly(dsn: str, pubdir: Path, tmp_path: Path) -> None:
    """`timeout -s INT 5 outboxpg-worker ...` sends SIGINT to the worker and to its process group:
    the second one, arriving while asyncio closed its loop, printed "Exception ignored ...
    OSError: [Errno 9] Bad file descriptor". Now: exit 0 and nothing but log lines, every time."""
    for i in range(8):
        log = tmp_path / f"w{i}.log"
        p = subprocess.Popen([WORKER, "--dsn", dsn, "--publisher", "mypub:publish", "--maintenance-interval", "0",
                              "--summary-interval", "3600"],
                             stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True, cwd=pubdir, env=_env(),
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            end = time.monotonic() + 20
            while "event=start " not in log.read_text():
                assert p.poll() is None and time.monotonic() < end, log.read_text()
                time.sleep(0.02)
            p.send_signal(signal.SIGINT)
            while "event=stopped" not in log.read_text() and p.poll() is None:   # the shutdown's last line
                time.sleep(0.0005)
            p.send_signal(signal.SIGINT)   # as the loop closes
            assert p.wait(20) == 0, log.read_text()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        text = log.read_text()
        assert all(" level=" in line for line in text.splitlines()), text
