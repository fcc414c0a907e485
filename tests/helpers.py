"""Small helpers shared by the SQL tests: inserting, claiming, settings, notifications."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from locks import WAKEUP_LOCK
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from outboxpg.relay.worker import Worker

T = TypeVar("T")


def connect(dsn: str, autocommit: bool = True, lock_timeout: str = "10s") -> psycopg.Connection[Any]:
    """A connection whose lock waits are bounded: a wakeup-lock call that should return but
    blocks fails the test after ``lock_timeout`` instead of hanging it."""
    return psycopg.connect(dsn, autocommit=autocommit, options=f"-c lock_timeout={lock_timeout}")


def insert(conn: psycopg.Connection[Any], aggregate_type: str = "order", aggregate_id: str = "1",
           event_type: str = "created", payload: str = "{}", **cols: Any) -> int:
    """INSERT one event (extra columns as keyword arguments); returns its id."""
    names = ["aggregate_type", "aggregate_id", "event_type", "payload", *cols]
    values = [aggregate_type, aggregate_id, event_type, payload, *cols.values()]
    stmt = sql.SQL("INSERT INTO outbox ({}) VALUES ({}) RETURNING id").format(
        sql.SQL(", ").join(map(sql.Identifier, names)), sql.SQL(", ").join(sql.Placeholder() * len(names)))
    row = conn.execute(stmt, values).fetchone()
    assert row is not None
    return int(row[0])


def insert_series(conn: psycopg.Connection[Any], aggregates: Iterable[str], aggregate_type: str = "order",
                  event_type: str = "created", created_at: str | None = None) -> list[int]:
    """One event per entry of ``aggregates`` (aggregate ids), in that order, in one statement;
    returns their ids in insert order. ``created_at``: an SQL expression, e.g. "now() - interval '30 days'"."""
    aggs = list(aggregates)
    created = sql.SQL(created_at) if created_at else sql.SQL("now()")
    rows = conn.execute(
        sql.SQL("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at) "
                "SELECT %s, a, %s, jsonb_build_object('n', n), {} "
                "FROM unnest(%s::text[]) WITH ORDINALITY AS u(a, n) ORDER BY n RETURNING id").format(created),
        (aggregate_type, event_type, aggs)).fetchall()
    return sorted(int(r[0]) for r in rows)


def aggregate_of_shard(conn: psycopg.Connection[Any], shard: str, aggregate_type: str = "order") -> str:
    """An aggregate id of ``aggregate_type`` whose bucket is in ``shard`` ('I/N')."""
    row = conn.execute("SELECT g::text FROM generate_series(1, 1000) g "
                       "WHERE outbox_aggregate_bucket(%s, g::text) = ANY (outbox_shard_buckets(%s)) LIMIT 1",
                       (aggregate_type, shard)).fetchone()
    assert row is not None
    return str(row[0])


def claim(conn: psycopg.Connection[Any], batch: int | None = 10, lease: str | None = None,
          worker: str | None = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT * FROM outbox_claim(%s, %s::interval, %s)", (batch, lease, worker)).fetchall()


def claim_ids(conn: psycopg.Connection[Any], n: int = 100) -> list[int]:
    """The ids outbox_claim(n) hands out, in its order."""
    return [r[0] for r in conn.execute("SELECT id FROM outbox_claim(%s)", (n,)).fetchall()]


def complete(conn: psycopg.Connection[Any], ids: list[int] | None, token: Any,
             created_min: Any = None, created_max: Any = None) -> int:
    row = conn.execute("SELECT outbox_complete(%s::bigint[], %s::uuid, %s, %s)",
                       (ids, token, created_min, created_max)).fetchone()
    assert row is not None
    return row[0]


def fail(conn: psycopg.Connection[Any], id: int | None, token: Any, error: str | None = "boom",
         permanent: bool | None = False) -> str | None:
    row = conn.execute("SELECT outbox_fail(%s::bigint, %s::uuid, %s::text, %s::boolean)",
                       (id, token, error, permanent)).fetchone()
    assert row is not None
    return row[0]


def release(conn: psycopg.Connection[Any], ids: list[int] | None, token: Any) -> int:
    row = conn.execute("SELECT outbox_release(%s::bigint[], %s::uuid)", (ids, token)).fetchone()
    assert row is not None
    return row[0]


def requeue(conn: psycopg.Connection[Any], ids: list[int] | None) -> int:
    row = conn.execute("SELECT outbox_requeue(%s::bigint[])", (ids,)).fetchone()
    assert row is not None
    return row[0]


def discard(conn: psycopg.Connection[Any], ids: list[int] | None, reason: str | None) -> int:
    row = conn.execute("SELECT outbox_discard(%s::bigint[], %s::text)", (ids, reason)).fetchone()
    assert row is not None
    return row[0]


def event(conn: psycopg.Connection[Any], id: int) -> dict[str, Any]:
    """The whole row of one event (plus the partition it lives in)."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute("SELECT o.*, c.relname::text AS partition FROM outbox o JOIN pg_class c ON c.oid = o.tableoid "
                          "WHERE id = %s",
                          (id,)).fetchone()
    assert row is not None, f"event {id} not found"
    return row


def events(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT o.*, c.relname::text AS partition FROM outbox o JOIN pg_class c ON c.oid = o.tableoid "
                           "ORDER BY id").fetchall()


def states(conn: psycopg.Connection[Any]) -> dict[str, int]:
    return {s: n for s, n in conn.execute("SELECT state::text, count(*) FROM outbox GROUP BY 1").fetchall()}


def set_settings(conn: psycopg.Connection[Any], **values: Any) -> None:
    """UPDATE outbox_settings SET k = v, ... (values as SQL literals, e.g. '1 millisecond')."""
    conn.execute(sql.SQL("UPDATE outbox_settings SET {}").format(sql.SQL(", ").join(
        sql.SQL("{} = {}").format(sql.Identifier(k), sql.Literal(v)) for k, v in values.items())))


def allow_subjects(conn: psycopg.Connection[Any], *prefixes: str) -> None:
    """Let producers write explicit subjects under these prefixes too (outbox_settings)."""
    conn.execute("UPDATE outbox_settings SET allowed_subject_prefixes = %s", (list(prefixes),))


def server_now(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def make_due(conn: psycopg.Connection[Any], ids: list[int]) -> None:
    """Skip a retry's backoff (test shortcut): the events become due at once, and so do the
    heads of their aggregates (recomputed from the events, as the report functions do)."""
    conn.execute("WITH due AS (UPDATE outbox SET next_attempt_at = clock_timestamp() WHERE id = ANY(%s) "
                 "RETURNING aggregate_type, aggregate_id) "
                 "SELECT outbox_refresh_heads(array_agg(aggregate_type), array_agg(aggregate_id)) FROM due",
                 (ids,))


def fail_times(conn: psycopg.Connection[Any], i: int, error: str, times: int) -> None:
    """Event ``i`` claimed and failed ``times`` times (whatever else the claims return is released)."""
    for _ in range(times):
        make_due(conn, [i])
        rows = claim(conn, 100)
        (row,) = [r for r in rows if r["id"] == i]
        assert release(conn, [r["id"] for r in rows if r["id"] != i], row["lease_token"]) == len(rows) - 1
        assert fail(conn, i, row["lease_token"], error) == "pending"


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.005,
               message: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


class Listener:
    """LISTENs on channel 'outbox'. ``collect()`` returns every notification that arrived for
    transactions committed before the call, without guessing a wait time: it sends a sentinel
    notification from another session and reads until the sentinel arrives (notifications are
    delivered in commit order)."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.poke = psycopg.connect(dsn, autocommit=True)
        self.conn.execute("LISTEN outbox")

    def collect(self, timeout: float = 10.0) -> list[str]:
        token = f"sentinel-{uuid.uuid4()}"
        self.poke.execute("SELECT pg_notify('outbox', %s)", (token,))
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n in self.conn.notifies(timeout=max(0.01, deadline - time.monotonic())):
                if n.payload == token:
                    return got
                got.append(n.payload)
        raise AssertionError(f"sentinel notification not received within {timeout}s (got {got!r})")

    def close(self) -> None:
        self.conn.close()
        self.poke.close()

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def waiting_for_advisory_lock(conn: psycopg.Connection[Any], pid: int) -> bool:
    """Whether backend ``pid`` waits for the wakeup advisory lock."""
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE pid = %s AND locktype = 'advisory' AND NOT granted "
        "AND classid = %s AND objid = %s", (pid, WAKEUP_LOCK[0], WAKEUP_LOCK[1])).fetchone()
    assert row is not None
    return bool(row[0])


class Background(threading.Thread):
    """Run fn() in a thread; ``result()`` re-raises its exception in the caller."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc

    def result(self, timeout: float) -> Any:
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"background call did not finish within {timeout}s")
        if self.error is not None:
            raise self.error
        return self.value


def psql_args(dsn: str) -> list[str]:
    """Connection arguments for psql from a libpq key=value DSN."""
    p = conninfo_to_dict(dsn)
    args = []
    for key, flag in (("host", "-h"), ("port", "-p"), ("user", "-U"), ("dbname", "-d")):
        if p.get(key):
            args += [flag, str(p[key])]
    return args


def psql_env(dsn: str) -> dict[str, str]:
    import os

    env = dict(os.environ)
    p = conninfo_to_dict(dsn)
    if p.get("password"):
        env["PGPASSWORD"] = str(p["password"])
    env["PGOPTIONS"] = "--client-min-messages=warning"
    return env


class Running:
    """A Worker running in a task of the test's event loop, stopped (and awaited) by stop()."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.task = asyncio.create_task(worker.run())

    async def stop(self, timeout: float = 30) -> None:
        self.worker.stop()
        await asyncio.wait_for(self.task, timeout)

    async def idle(self) -> bool:
        """True once the worker waits for work: it holds the wakeup lock and listens. Raises what
        the worker died of, if it did."""
        if self.task.done():
            self.task.result()
        return self.worker.idle_lock.held and self.worker.listener.up


# -- the psql files of sql/ ---------------------------------------------------------------------

SQL_DIR = Path(__file__).resolve().parent.parent / "sql"


def psql() -> str:
    exe = shutil.which("psql")
    if exe is None:
        pytest.skip("psql (the PostgreSQL client) is not installed on this machine")
    return exe


def start_psql(dsn: str, *args: str, input: str | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([psql(), "-X", "-v", "ON_ERROR_STOP=1", *psql_args(dsn), *args],
                            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=psql_env(dsn))


def finish_psql(p: subprocess.Popen[str], input: str | None = None) -> tuple[int, str, str]:
    out, err = p.communicate(input=input, timeout=60)
    return p.returncode, out, err


def run_files(dsn: str, *runs: tuple[str, ...]) -> list[tuple[int, str, str]]:
    """Each run: (file name, psql arguments...), all at once."""
    procs = [start_psql(dsn, *extra, "-f", str(SQL_DIR / f"{name}.sql")) for name, *extra in runs]
    return [finish_psql(p) for p in procs]


def entries_read(conn: psycopg.Connection[Any], index: str, action: Callable[[], T]) -> tuple[int, T]:
    """Index entries of ``index`` that ``action`` reads on this connection, and what it returns.
    (The backend's own counts not yet reported, read before and after: they also hold earlier
    transactions' counts until the backend reports them. All three in one transaction: a backend
    reports them, and starts counting from zero, whenever it is idle outside one, and between
    three statements of their own it was, on a slow machine: 0 entries read.)"""
    count = sql.SQL("SELECT pg_stat_get_xact_tuples_returned({}::regclass)").format(sql.Literal(index))
    with conn.transaction():
        (before,) = conn.execute(count).fetchone()  # type: ignore[misc]
        result = action()
        (after,) = conn.execute(count).fetchone()  # type: ignore[misc]
    return int(after) - int(before), result


def heads_updates(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """Updates of outbox_heads by this backend's current transaction so far: (all, HOT)."""
    row = conn.execute("SELECT pg_stat_get_xact_tuples_updated('outbox_heads'::regclass), "
                       "pg_stat_get_xact_tuples_hot_updated('outbox_heads'::regclass)").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


# How many statements this session has planned and keeps (one CachedPlanSource memory context
# each), but for the query that counts them: planning read without timing it.
PLANS_KEPT = ("SELECT count(*) FROM pg_backend_memory_contexts "
              "WHERE name = 'CachedPlanSource' AND ident NOT LIKE '%pg_backend_memory_contexts%'")
