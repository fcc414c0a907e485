"""outboxpg-worker --sink URL: the scheme picks the sink; its failures at start are one line with
the exit code of outboxpg/cli/errors.py; its password and the webhook secret never show.

The path of a built-in sink (the scheme registry, open_sink, start, the worker) is run here with a
sink module of the test's own put in the registry for amqp:// (``registry_worker``); the real
sinks' own behaviour is the conformance suite's (tests/sinks)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
import pytest
from commands import WORKER

from outboxpg.cli.errors import EXIT_BROKER, EXIT_CONNECT, EXIT_USAGE
from outboxpg.embedded import free_port

PASSWORD = "Sink-pw-never-shown"
SECRET = "whsec-never-shown-4711"

# A sink of the test's own: appends each event to the file named by ?out=, after a TCP connect
# to the URL's host and port at start (so that a closed port is SinkUnreachable); ?refuse=1
# makes start() raise SinkRefused; ?need=LIB imports LIB in open_sink (a client library). Its
# errors quote the URL and the secret, to prove the worker redacts both.
TEST_SINK = '''
import asyncio, importlib
from outboxpg.sinks.base import SinkRefused, SinkUnreachable, url_options, without_credentials
from urllib.parse import urlsplit

class FileSink:
    run_publishing = "test-file-sink"

    def __init__(self, settings):
        self.settings = settings
        self.options = settings.options
        self.starts = 0

    async def start(self):
        self.starts += 1
        if self.starts > 1:
            raise RuntimeError("started twice")
        u = urlsplit(self.settings.url)
        try:
            _, w = await asyncio.open_connection(u.hostname, u.port)
            w.close()
        except OSError as exc:
            raise SinkUnreachable(f"cannot connect to {self.settings.url} (refused) "
                                  f"with secret {(self.settings.secret or b'').decode()}") from None
        if self.options.get("hang"):
            await asyncio.Event().wait()
        if self.options.get("refuse"):
            raise SinkRefused(f"no exchange {self.options.get('exchange', 'outbox')!r}: declare it or pass --ensure-sink")

    async def publish_batch(self, events):
        with open(self.options["out"], "a") as f:
            for e in events:
                f.write(f"{e.id} {e.subject} {self.options.get('exchange', 'outbox')} ensure={self.settings.ensure} "
                        f"secret={self.settings.secret is not None}\\n")
        return [None] * len(events)

    async def close(self):
        pass

    def health_problem(self):
        down = self.options.get("down")
        return "the test sink is down" if down and __import__("os").path.exists(down) else None

    def describe(self):
        return f"file sink {without_credentials(self.settings.url)} -> {self.options.get('out')}"


def open_sink(settings):
    if "need" in settings.options:
        importlib.import_module(settings.options["need"])
    if "out" not in settings.options:
        raise ValueError("--sink: the test sink needs ?out=FILE")
    return FileSink(settings)
'''

RUN_WITH_TEST_SINK = ("import sys, outboxpg.sinks as s; s.SCHEMES['amqp'] = ('test_file_sink', 'rabbitmq'); "
                      "from outboxpg.cli.outboxpg_worker import main; sys.exit(main(sys.argv[1:]))")


def clean_env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_"))}
    return {**env, "PYTHONPATH": str(tmp_path), **(extra or {})}


def registry_worker(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
                    timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """outboxpg-worker with amqp:// mapped to the test's own sink module."""
    (tmp_path / "test_file_sink.py").write_text(TEST_SINK)
    return subprocess.run([sys.executable, "-c", RUN_WITH_TEST_SINK, *args], capture_output=True, text=True,
                          timeout=timeout, env=clean_env(tmp_path, env))


def one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, r.stderr
    assert lines and lines[-1].startswith("outboxpg-worker: "), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert PASSWORD not in r.stderr and SECRET not in r.stderr, r.stderr
    return lines[-1]


# Usage errors come before any connection: a database nobody listens at.
NOWHERE = f"host=127.0.0.1 port={free_port()} dbname=nowhere"


def workers_at_once(*arglists: tuple[str, ...], env: dict[str, str] | None = None,
                    ) -> list[subprocess.CompletedProcess[str]]:
    """Several worker invocations at once (each only checks its flags and exits)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_"))}
    procs = [subprocess.Popen([WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**clean, **(env or {})}) for args in arglists]
    done = []
    for p, args in zip(procs, arglists):
        out, err = p.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(args, p.returncode, out, err))
    return done


def test_an_unknown_scheme_exits_2_in_one_line_without_the_password() -> None:
    url = f"kafka://user:{PASSWORD}@127.0.0.1:9092"
    flag, = workers_at_once(("--dsn", NOWHERE, "--sink", url))
    env, = workers_at_once(("--dsn", NOWHERE), env={"OUTBOXPG_SINK": url})
    for r in (flag, env):
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert one_line(r, EXIT_USAGE) == (
            "outboxpg-worker: --sink 'kafka://user:***@127.0.0.1:9092': unknown scheme 'kafka'; "
            "one of amqp, amqps, http, https, mqtt, mqtts, nats, redis, rediss"), r.stderr


MISFITS = {
    ("--sink", "nats://127.0.0.1:4222", "--nats-url", "nats://10.0.0.1:4222"):
        "--sink and --nats-url both name the NATS server: keep one",
    ("--sink-option", "exchange=x"): "--sink-option needs --sink URL",
    ("--ensure-sink",): "--ensure-sink needs --sink URL",
    ("--sink", "nats://127.0.0.1:4222", "--ensure-sink"):
        "--ensure-sink does not apply to a NATS --sink (NATS: --ensure-stream NAME)",
    ("--sink", "redis://127.0.0.1:6379", "--ensure-stream", "S"):
        "--ensure-stream applies to NATS only; for this sink: --ensure-sink",
    ("--sink", "mqtt://127.0.0.1:1883", "--cloudevents"): "--cloudevents applies to NATS only, not to a mqtt:// --sink",
    ("--sink", "http://127.0.0.1:1/hook", "--publisher", "m:f"):
        "--sink and --publisher both name where to publish: keep one",
    ("--sink", "amqp://127.0.0.1", "--sink-option", "novalue"):
        "--sink-option must look like KEY=VALUE, got 'novalue'",
}


def test_flags_that_do_not_fit_the_sink_exit_2_in_one_line() -> None:
    results = workers_at_once(*(("--dsn", NOWHERE, *args) for args in MISFITS))
    for args, r in zip(MISFITS, results):
        assert one_line(r, EXIT_USAGE) == f"outboxpg-worker: {MISFITS[args]}", (args, r.stderr)


def test_the_webhook_secret_given_twice_or_unreadable_exits_2(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    (tmp_path / "empty").write_text("\n")
    hook = ("--dsn", NOWHERE, "--sink", "https://hooks.example/x", "--webhook-secret-file")
    both, = workers_at_once((*hook, str(secret_file)), env={"OUTBOXPG_WEBHOOK_SECRET": SECRET})
    missing, empty = workers_at_once((*hook, str(tmp_path / "nope")), (*hook, str(tmp_path / "empty")))
    assert "the webhook secret is given twice" in one_line(both, EXIT_USAGE)
    assert one_line(missing, EXIT_USAGE).endswith(f"--webhook-secret-file {tmp_path / 'nope'}: cannot read it: "
                                                  "no such file or directory")
    assert "the file is empty" in one_line(empty, EXIT_USAGE)


def test_a_sink_whose_client_library_is_missing_exits_2_naming_the_extra(tmp_path: Path) -> None:
    r = registry_worker(tmp_path, "--dsn", NOWHERE, "--sink",
                        f"amqp://guest:{PASSWORD}@127.0.0.1:5672/?need=outboxpg_no_such_client_library")
    assert one_line(r, EXIT_USAGE) == ("outboxpg-worker: the amqp:// sink needs outboxpg_no_such_client_library: "
                                       "pip install 'outboxpg[rabbitmq]'"), r.stderr


def test_an_option_the_sink_refuses_exits_2_before_connecting_anywhere(tmp_path: Path) -> None:
    # The database is not reachable either: the sink's usage error comes first.
    r = registry_worker(tmp_path, "--dsn", NOWHERE, "--sink",
                        "amqp://127.0.0.1:5672/")
    assert one_line(r, EXIT_USAGE) == "outboxpg-worker: --sink: the test sink needs ?out=FILE", r.stderr


def test_an_unreachable_sink_exits_3_and_a_refusing_one_5_without_the_secrets(dsn: str, tmp_path: Path) -> None:
    closed = free_port()
    out = tmp_path / "out.txt"
    r = registry_worker(tmp_path, "--dsn", dsn, "--sink", f"amqp://guest:{PASSWORD}@127.0.0.1:{closed}/?out={out}",
                        env={"OUTBOXPG_WEBHOOK_SECRET": SECRET})
    line = one_line(r, EXIT_CONNECT)
    assert line == (f"outboxpg-worker: --sink file sink amqp://127.0.0.1:{closed}/ -> {out}: cannot connect to "
                    f"amqp://guest:***@127.0.0.1:{closed}/?out={out} (refused) with secret ***"), line
    assert f"event=sink_target url=amqp://127.0.0.1:{closed}/ sink=" in r.stderr, r.stderr

    # A server there (PostgreSQL's port will do: the test sink only connects), but it refuses.
    port = psycopg.conninfo.conninfo_to_dict(dsn)["port"]
    refused = registry_worker(tmp_path, "--dsn", dsn, "--sink", f"amqp://127.0.0.1:{port}/?out={out}&refuse=1",
                              "--sink-option", "exchange=orders")
    assert one_line(refused, EXIT_BROKER).endswith(
        "no exchange 'orders': declare it or pass --ensure-sink"), refused.stderr
    assert not out.exists()


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, "not listening yet"


def test_a_started_sink_delivers_through_the_worker_once_started(dsn: str, conn: psycopg.Connection[Any],
                                                                 tmp_path: Path) -> None:
    """The registry's path end to end: options from the URL and the flags (a flag wins), --ensure-sink
    and the secret file in SinkSettings, start() called once, the sink's events delivered; /readyz
    asks the sink's health_problem()."""
    (tmp_path / "test_file_sink.py").write_text(TEST_SINK)
    out, down, metrics = tmp_path / "out.txt", tmp_path / "down", free_port()
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    port = psycopg.conninfo.conninfo_to_dict(dsn)["port"]
    for i in range(3):
        conn.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                     "VALUES ('order', 'o1', 'paid', %s)", (f'{{"i": {i}}}',))
    log = tmp_path / "worker.log"
    p = subprocess.Popen([sys.executable, "-c", RUN_WITH_TEST_SINK, "--dsn", dsn, "--sink",
                          f"amqp://guest:{PASSWORD}@127.0.0.1:{port}/?out={out}&exchange=fromurl&down={down}",
                          "--sink-option", "exchange=fromflag", "--ensure-sink", "--webhook-secret-file",
                          str(secret_file), "--poll-interval", "1", "--maintenance-interval", "0",
                          "--metrics-port", str(metrics)],
                         stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=clean_env(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and len(out.read_text().splitlines()) == 3):
            assert p.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert readyz(metrics) == (200, "ok\n")
        down.touch()
        assert readyz(metrics)[0] == 503 and "the test sink is down" in readyz(metrics)[1]
    finally:
        p.terminate()
        assert p.wait(20) == 0, log.read_text()
    assert out.read_text().splitlines() == [f"{i} outbox.order.paid fromflag ensure=True secret=True"
                                            for i in (1, 2, 3)]
    text = log.read_text()
    assert f"event=sink_target url=amqp://127.0.0.1:{port}/ sink='file sink amqp://127.0.0.1:{port}/ -> {out}'" \
        in text, text
    assert "run_publishing=test-file-sink" in text and "started twice" not in text, text
    assert PASSWORD not in text and SECRET not in text
    assert conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone()[0] == 3


@pytest.mark.parametrize("scheme", ["amqp", "redis", "mqtt"])
def test_an_unreachable_server_of_a_built_in_sink_exits_3(dsn: str, scheme: str) -> None:
    user = "guest" if scheme == "amqp" else ""
    r, = workers_at_once(("--dsn", dsn, "--sink", f"{scheme}://{user}:{PASSWORD}@127.0.0.1:{free_port()}/"))
    one_line(r, EXIT_CONNECT)


def test_sigterm_while_a_sink_starts_stops_the_worker_with_0(dsn: str, tmp_path: Path) -> None:
    """A sink whose start() does not return (a server that accepts and never answers) does not
    keep the worker from stopping."""
    (tmp_path / "test_file_sink.py").write_text(TEST_SINK)
    port = psycopg.conninfo.conninfo_to_dict(dsn)["port"]
    log = tmp_path / "worker.log"
    p = subprocess.Popen([sys.executable, "-c", RUN_WITH_TEST_SINK, "--dsn", dsn, "--sink",
                          f"amqp://127.0.0.1:{port}/?out={tmp_path / 'out'}&hang=1"],
                         stdout=subprocess.DEVNULL, stderr=log.open("wb"), env=clean_env(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while "event=sink_target" not in log.read_text():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        time.sleep(0.3)
        p.terminate()
        assert p.wait(10) == 0, log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "Traceback" not in log.read_text()
