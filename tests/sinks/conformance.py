"""What a built-in sink is held to: the interface of a sink's test case, and the tools the
generic tests (test_conformance.py) use on it. A sink is done when its case passes them all.

A case is a pytest fixture named ``<module>_case`` in ``tests/sinks/cases/<module>.py`` (the
folder's conftest.py finds every module there and runs each test once per case). The fixture
yields an object of a subclass of SinkCase below, on a server of the case's own that it may stop
and start, reached by the worker through a TcpProxy (tests/sinks/proxy.py) the case owns. Where
the server cannot be had (its binary missing, say), the fixture calls ``pytest.skip(reason)``
naming what is missing. See cases/nats.py.

What ``read_back`` returns, one ``Stored`` per message the server holds, in the order the server
stored them (duplicates included: they are what some tests look for):

- ``msg_id``: the event's msg_id as the message carries it (the id a consumer deduplicates on);
- ``subject``: the event's subject (``<subject_prefix>.<aggregate_type>.<event_type>`` or the
  row's own), mapped back if the sink translates it (a topic with '/' for '.': give back the '.');
- ``headers``: every header, property or field the message carries besides the payload, names as
  sent (the tests compare them case-insensitively): the row's headers and the Outbox-* ids;
- ``payload``: the body as stored (the event's JSON text).

The tests check, besides the row's own headers, ``Outbox-Id``, ``Outbox-Aggregate-Type``,
``Outbox-Aggregate-Id`` and ``Outbox-Event-Type`` with the event's values. Each test has a fresh
database of its own (subject_prefix ``outbox`` unless the case's ``prepare`` sets another) and
starts its own worker(s): ``--lease 2 --publish-timeout 1`` (the slow-server test ``--lease 6
--publish-timeout 3`` with the proxy's latency at 0.3 s; the cut and restart test at 3 ms),
backoff 50 ms to 300 ms, 50 attempts. A sink that shares a server between tests (two test
processes run at once) reads back only what its own test published: a stream, queue or path of
the case's own per fixture.
"""

from __future__ import annotations

import abc
import asyncio
import json
import os
import signal
import subprocess
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import psycopg
from commands import WORKER
from proxy import TcpProxy
from psycopg.rows import dict_row

__all__ = ["Stored", "SinkCase", "SinkWorker", "Row", "insert_events", "rows", "check_order", "count", "until",
           "fast_settings"]


@dataclass(frozen=True)
class Stored:
    msg_id: str
    subject: str
    headers: dict[str, str]
    payload: bytes


class SinkCase(abc.ABC):
    """One sink on a server of the case's own. Subclasses set the attributes and write the methods.

    ``name``        the sink's name in test ids ("nats", "rabbitmq", ...)
    ``url``         what the worker gets as --sink: through the case's proxy, credentials and all
    ``worker_args`` more flags for the worker (e.g. ("--ensure-sink",), ("--sink-option", "k=v"))
    ``worker_env``  more environment variables for the worker (e.g. {"OUTBOXPG_WEBHOOK_SECRET": ...})
    ``too_large``   a JSON payload (bytes, valid JSON: it goes into the jsonb payload column) the
                    server refuses, so the event is dead-lettered at its first attempt; None when
                    the server takes any size, with the reason in ``too_large_why``
    ``refused_reason`` a piece of text the dead letter's last_error must hold for ``too_large``
                    (the real reason, e.g. "max_payload")
    ``dedups``      the server drops a second copy of a msg_id (JetStream's duplicate window):
                    then not even a cut or a restart may leave a duplicate behind
    ``settle``      seconds to wait after the worker reported everything before read_back (a server
                    whose stored messages become readable a little later)
    ``slow_latency`` how late the slow-server test makes every answer: enough that a batch of 10 runs
                    of 7 takes past a third of the 12 s lease (0.6 s for a sink with a round trip
                    per event; a sink that stores a whole run in one round trip sets about 4.3)
    ``strike_latency`` how late every answer is in the cut / restart test, so that the strike
                    comes in the middle of the run: 0.003 s for a sink with a round trip per event
                    (600 events in runs of 20: about 1.5 s of publishing); a sink that stores a
                    whole run in one round trip sets about 0.1
    ``proxy``       the TcpProxy (tests/sinks/proxy.py) the worker reaches the server through; the
                    tests set its ``latency`` (a slow server) and the default cut() cuts it
    """

    name: str = ""
    url: str = ""
    worker_args: Sequence[str] = ()
    worker_env: Mapping[str, str] = MappingProxyType({})
    too_large: bytes | None = None
    too_large_why: str = ""
    refused_reason: str = ""
    dedups: bool = False
    settle: float = 0.0
    slow_latency: float = 0.6
    strike_latency: float = 0.003
    proxy: TcpProxy

    @abc.abstractmethod
    async def read_back(self) -> list[Stored]:
        """Every message the server holds for this case's worker, in store order."""

    async def cut(self) -> None:
        """Drop the worker's connections mid-run; the worker must be able to connect again within
        a second or so. By default: the case's proxy drops them all and refuses new ones for 0.5 s."""
        await self.proxy.cut(refuse_for=0.5)

    @abc.abstractmethod
    async def stop(self) -> None:
        """Take the server down (the case's own instance), keeping what it stored."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Bring it up again after stop(), with what it stored; return once it takes connections."""

    def prepare(self, conn: psycopg.Connection[Any]) -> None:  # noqa: B027 - optional, nothing by default
        """Called on each test's database (autocommit) before any event is written, e.g. to set
        outbox_settings.subject_prefix; nothing by default."""


# -- the database side --------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    id: int
    msg_id: str
    aggregate: str          # aggregate_type/aggregate_id
    subject: str
    headers: dict[str, str]
    payload: Any            # the payload, parsed
    state: str
    attempts: int
    last_error: str | None


def fast_settings(conn: psycopg.Connection[Any], *, max_attempts: int = 50, max_run: int = 1000) -> None:
    """Retries within a fraction of a second (backoff 50 ms doubling to 300 ms), enough attempts
    that an outage of a few seconds kills nothing."""
    conn.execute("UPDATE outbox_settings SET backoff_base = '50 milliseconds', backoff_cap = '300 milliseconds', "
                 "max_attempts = %s, max_run = %s", (max_attempts, max_run))


def insert_events(conn: psycopg.Connection[Any], aggregates: Sequence[str], *, event_type: str = "updated",
                  headers: dict[str, str] | None = None, payload: bytes | None = None) -> list[int]:
    """One event per entry of ``aggregates`` (aggregate ids of type "order"), in that order, in
    one statement; payload {"n": <position>} unless ``payload`` (JSON text) is given."""
    rows_ = conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) "
        "SELECT 'order', a, %s, coalesce(convert_from(%s::bytea, 'UTF8')::jsonb, jsonb_build_object('n', n)), "
        "%s::jsonb FROM unnest(%s::text[]) WITH ORDINALITY AS u(a, n) ORDER BY n RETURNING id",
        (event_type, payload, json.dumps(headers or {}), list(aggregates))).fetchall()
    return sorted(int(r[0]) for r in rows_)


def rows(conn: psycopg.Connection[Any]) -> list[Row]:
    """Every event of the outbox, in id order, with the subject it is published to."""
    with conn.cursor(row_factory=dict_row) as cur:
        found = cur.execute(
            "SELECT o.id, o.msg_id, o.aggregate_type || '/' || o.aggregate_id AS aggregate, "
            "coalesce(o.subject, s.subject_prefix || '.' || o.aggregate_type || '.' || o.event_type) AS subject, "
            "o.headers, o.payload, o.state::text AS state, o.attempts, o.last_error "
            "FROM outbox o, outbox_settings s ORDER BY o.id").fetchall()
    return [Row(**r) for r in found]


def count(conn: psycopg.Connection[Any], where: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM outbox WHERE {where}").fetchone()
    assert row is not None
    return int(row[0])


def check_order(stored: Sequence[Stored], by_msg_id: dict[str, Row]) -> dict[str, list[int]]:
    """Per aggregate, the ids in store order, each at its first appearance: they must increase
    (a later copy of an event already stored is a re-publish, which a consumer drops by msg_id;
    an event stored before an earlier one of its aggregate is a broken order). Returns them."""
    seen: set[str] = set()
    per: dict[str, list[int]] = defaultdict(list)
    for s in stored:
        row = by_msg_id.get(s.msg_id)
        assert row is not None, f"stored a message with msg_id {s.msg_id!r} that no event has"
        if s.msg_id in seen:
            continue
        seen.add(s.msg_id)
        ids = per[row.aggregate]
        assert not ids or ids[-1] < row.id, f"{row.aggregate}: event {row.id} stored after {ids[-1]}"
        ids.append(row.id)
    return dict(per)


async def until(pred: Callable[[], bool | Awaitable[bool]], timeout: float, what: str,
                worker: SinkWorker | None = None, interval: float = 0.05) -> float:
    """Wait (awaiting: the case's proxy runs in this loop) until ``pred()``; the seconds it took.
    Fails after ``timeout``, or at once when ``worker`` exited, with its log."""
    start = time.monotonic()
    while True:
        got = pred()
        if not isinstance(got, bool):
            got = await got
        if got:
            return time.monotonic() - start
        if worker is not None and worker.p.poll() is not None:
            raise AssertionError(f"the worker exited with {worker.p.returncode} waiting for {what}:\n{worker.text()}")
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                                 + (f":\n{worker.text()[-6000:]}" if worker is not None else ""))
        await asyncio.sleep(interval)


# -- the worker ---------------------------------------------------------------------------------

@dataclass
class SinkWorker:
    """``outboxpg-worker --sink <case.url>`` as a process of the test's own, its log in a file."""

    case: SinkCase
    dsn: str
    log: Path
    name: str = "w1"
    lease: float = 2.0
    publish_timeout: float = 1.0
    extra: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    p: subprocess.Popen[bytes] = field(init=False)

    def __post_init__(self) -> None:
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_"))}
        self.p = subprocess.Popen(
            [WORKER, "--dsn", self.dsn, "--sink", self.case.url, *self.case.worker_args, "--name", self.name,
             "--lease", f"{self.lease:g}", "--publish-timeout", f"{self.publish_timeout:g}", "--poll-interval", "1",
             "--summary-interval", "3600", "--maintenance-interval", "0", "--xmin-check-interval", "0", *self.extra],
            stdout=subprocess.DEVNULL, stderr=self.log.open("ab"), env={**clean, **self.case.worker_env, **self.env})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    async def stop(self) -> int:
        """SIGTERM, and wait (in-flight batches are finished first); its exit code."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            end = time.monotonic() + 20
            while self.p.poll() is None and time.monotonic() < end:
                await asyncio.sleep(0.05)
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
                raise AssertionError(f"the worker did not stop on SIGTERM within 20 s:\n{self.text()}")
        return self.p.returncode

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
