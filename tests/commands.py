"""The two commands as a user runs them, for the tests of every layer: `outboxpg` (``run``,
``run_all``, ``start``/``finish``; ``one_line_error`` checks the house rule for errors) and a running
`outboxpg-worker` whose log a test reads (``Proc``)."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

WORKER = str(Path(sys.executable).parent / "outboxpg-worker")   # the console script pip installed
CLI = [sys.executable, "-m", "outboxpg.cli"]                      # outboxpg, with this interpreter


@dataclass
class Result:
    """What one `outboxpg` invocation did: its arguments (after ``outboxpg``), exit code, stdout, stderr."""

    args: tuple[str, ...]
    code: int
    out: str
    err: str

    def json(self) -> Any:
        assert self.code == 0, self
        return orjson.loads(self.out)


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without PG* and OUTBOXPG_DSN (a test names its database itself), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "OUTBOXPG_DSN"}
    env.update(extra or {})
    return env


def _default_sigint() -> None:
    # A suite started as a background job inherits SIGINT ignored, and Python then leaves it
    # ignored: the Ctrl-C tests would wait forever. Give the CLI the terminal's usual SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args: str, env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=kw.pop("stdin", subprocess.DEVNULL), text=True, env=cli_env(env),
                            preexec_fn=_default_sigint, **kw)


def finish(p: subprocess.Popen[str], timeout: float = 60) -> Result:
    out, err = p.communicate(timeout=timeout)
    return Result(tuple(p.args[len(CLI):]), p.returncode, out, err)  # type: ignore[index]


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return finish(start(*args, env=env))


def run_all(*commands: tuple[str, ...], env: dict[str, str] | None = None) -> list[Result]:
    """Several invocations at once (they only read, or touch different events)."""
    procs = [start(*c, env=env) for c in commands]
    return [finish(p) for p in procs]


# The line a command that writes prints on stderr before it does: what, and in which database.
TARGET = re.compile(r"outboxpg: [a-z][^\n]* database \S+ on \S+ as \S+\n")


def after_target(err: str) -> str:
    """``err`` without its first line, which must name the database the command writes to."""
    m = TARGET.match(err)
    assert m, f"no target line first: {err!r}"
    return err[m.end():]


def one_line_error(r: Result, code: int) -> str:
    """The house rule for bad input: exit ``code``, nothing on stdout, one line 'outboxpg: ...' on
    stderr and no traceback. Returns that line."""
    assert r.code == code, r
    assert r.out == "", r
    lines = r.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("outboxpg: "), r
    assert "Traceback" not in r.err
    return lines[0]


class Proc:
    """A worker process whose log (stderr) the test reads while it runs."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = tmp_path / f"worker-{time.monotonic_ns()}.log"
        self.p = subprocess.Popen([WORKER, "--summary-interval", "3600", "--maintenance-interval", "0", *args],
                                  stdout=subprocess.DEVNULL, stderr=self.log.open("wb"),
                                  env={**os.environ, **(env or {})})

    def text(self) -> str:
        return self.log.read_text()

    def count(self, needle: str) -> int:
        return self.text().count(needle)

    def wait_for(self, needle: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while needle not in self.text():
            assert self.p.poll() is None, f"exited {self.p.returncode}: {self.text()}"
            assert time.monotonic() < end, f"{needle!r} not logged within {timeout}s: {self.text()}"
            time.sleep(0.05)

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                return self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
                raise AssertionError(f"did not stop on SIGTERM: {self.text()}") from None
        return self.p.returncode


def run_on_tty(args: list[str], answer: str) -> Result:
    """Run with a pseudo-terminal as stdin, answer the prompt once it shows on stderr."""
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([*CLI, *args], stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=cli_env())
        os.close(slave)
        assert p.stderr is not None
        err = ""
        deadline = time.monotonic() + 30
        while "[y/N]" not in err and time.monotonic() < deadline:
            ready, _, _ = select.select([p.stderr], [], [], 1)
            if ready:
                chunk = os.read(p.stderr.fileno(), 4096).decode()
                if not chunk:
                    break
                err += chunk
        os.write(master, answer.encode())
        out, rest = p.communicate(timeout=30)
        return Result(tuple(args), p.returncode, out, err + rest)
    finally:
        os.close(master)
