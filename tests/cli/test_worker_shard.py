"""outboxpg-worker --shard I/N: a shard that is not of that form is one line and exit 2, before
any connection; on a database where shards are not enabled, one line and exit 1."""

from __future__ import annotations

import os
import subprocess

from commands import WORKER


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_")) and k != "PYTHONPATH"}
    return subprocess.run([WORKER, *args], capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def one_line(r: subprocess.CompletedProcess[str], code: int) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


def test_a_malformed_shard_is_one_line_and_exit_2() -> None:
    for bad in ("2/2", "0/65", "1", "a/b"):
        line = one_line(run("--dsn", "host=192.0.2.1 connect_timeout=1", "--shard", bad), 2)
        assert line == f"outboxpg-worker: --shard must be I/N with 0 <= I < N <= 64 (0/2, 1/2), got {bad!r}"
    line = one_line(run("--dsn", "host=192.0.2.1 connect_timeout=1", env={"OUTBOXPG_SHARD": "3/3"}), 2)
    assert line.endswith("got '3/3'")


def test_a_shard_where_shards_are_not_enabled_is_one_line_and_exit_1(dsn: str) -> None:
    line = one_line(run("--dsn", dsn, "--shard", "0/2", "--nats-url", "nats://127.0.0.1:1"), 1)
    assert line.startswith("outboxpg-worker: --shard 0/2: shards are not enabled in database ")
    assert line.endswith("the schema owner runs SELECT outbox_shards_enable() (docs/how-to/shards.md)")


def test_a_shard_group_with_a_shard_or_poll_only_is_one_line_and_exit_2() -> None:
    for extra in (("--shard", "0/2"), ("--poll-only",)):
        line = one_line(run("--dsn", "host=192.0.2.1 connect_timeout=1", "--shard-group", "relays", *extra), 2)
        assert line == ("outboxpg-worker: --shard-group takes no --shard (it picks its own) and no --poll-only "
                        "(it holds a session lock)")
