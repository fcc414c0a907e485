"""outboxpg.enqueue and enqueue_many on the stacks Python applications already use: psycopg2,
asyncpg (a connection, and one from a pool), SQLAlchemy 2 (Connection, Session, AsyncConnection,
AsyncSession on psycopg 3, psycopg2 and asyncpg) and Django (its psycopg 3 backend: with psycopg 3
installed, as outboxpg's core install has it, Django takes that one), against the real PostgreSQL.

Each stack: the event joins the caller's transaction (commit keeps it, rollback leaves nothing),
enqueue_many writes 1,000 events through the driver's bulk path with idempotency keys, deliver_at
and headers, and the one-line errors (outboxpg.NotInstalled, a raw payload that is not JSON) and
savepoint=True hold."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import psycopg
import psycopg2
import pytest
import sqlalchemy
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outboxpg
from outboxpg import drivers, inbox, schema

# -- the stacks ---------------------------------------------------------------------------------


@dataclass
class Stack:
    conn: Any                       # what the application passes to outboxpg.enqueue
    commit: Callable[[], Any]
    rollback: Callable[[], Any]


def _params(dsn: str) -> dict[str, Any]:
    p = conninfo_to_dict(dsn)
    return {"host": p["host"], "port": int(p["port"]), "user": p["user"], "dbname": p["dbname"],
            "password": p.get("password")}


def _url(dsn: str, dialect: str) -> sqlalchemy.URL:
    p = _params(dsn)
    return sqlalchemy.URL.create(f"postgresql+{dialect}", username=p["user"], password=p["password"],
                                 host=p["host"], port=p["port"], database=p["dbname"])


@contextlib.contextmanager
def _psycopg2(dsn: str) -> Iterator[Stack]:
    c = psycopg2.connect(dsn)
    try:
        yield Stack(c, c.commit, c.rollback)
    finally:
        c.close()


@contextlib.contextmanager
def _sa_connection(dsn: str, dialect: str) -> Iterator[Stack]:
    engine = sqlalchemy.create_engine(_url(dsn, dialect))
    try:
        with engine.connect() as c:
            yield Stack(c, c.commit, c.rollback)
    finally:
        engine.dispose()


@contextlib.contextmanager
def _sa_session(dsn: str, dialect: str) -> Iterator[Stack]:
    engine = sqlalchemy.create_engine(_url(dsn, dialect))
    try:
        with Session(engine) as s:
            yield Stack(s, s.commit, s.rollback)
    finally:
        engine.dispose()


def _django_ready(dsn: str) -> Any:
    """Django configured once per process; its default database pointed at this test's."""
    import django
    from django.conf import settings
    from django.db import connection

    p = _params(dsn)
    if not settings.configured:
        settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.postgresql"}}, USE_TZ=True)
        django.setup()
    connection.close()
    connection.settings_dict.update(NAME=p["dbname"], USER=p["user"], PASSWORD=p["password"] or "",
                                    HOST=p["host"], PORT=str(p["port"]))
    return connection


@contextlib.contextmanager
def _django(dsn: str) -> Iterator[Stack]:
    from django.db import transaction

    connection = _django_ready(dsn)
    transaction.set_autocommit(False)
    try:
        yield Stack(connection, transaction.commit, transaction.rollback)
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
        connection.close()


SYNC: dict[str, Callable[[str], contextlib.AbstractContextManager[Stack]]] = {
    "psycopg2": _psycopg2,
    "sqlalchemy-connection-psycopg": lambda dsn: _sa_connection(dsn, "psycopg"),
    "sqlalchemy-connection-psycopg2": lambda dsn: _sa_connection(dsn, "psycopg2"),
    "sqlalchemy-session-psycopg": lambda dsn: _sa_session(dsn, "psycopg"),
    "sqlalchemy-session-psycopg2": lambda dsn: _sa_session(dsn, "psycopg2"),
    "django": _django,
}


def _asyncpg_kwargs(dsn: str) -> dict[str, Any]:
    p = _params(dsn)
    return {"host": p["host"], "port": p["port"], "user": p["user"], "database": p["dbname"],
            "password": p["password"]}


@contextlib.asynccontextmanager
async def _asyncpg(dsn: str) -> AsyncIterator[Stack]:
    c = await asyncpg.connect(**_asyncpg_kwargs(dsn))
    tx = c.transaction()
    await tx.start()
    try:
        yield Stack(c, tx.commit, tx.rollback)
    finally:
        await c.close()


@contextlib.asynccontextmanager
async def _asyncpg_pool(dsn: str) -> AsyncIterator[Stack]:
    async with asyncpg.create_pool(**_asyncpg_kwargs(dsn), min_size=1, max_size=1) as pool:
        async with pool.acquire() as c:
            tx = c.transaction()
            await tx.start()
            try:
                yield Stack(c, tx.commit, tx.rollback)
            finally:
                if c.is_in_transaction():
                    await tx.rollback()


@contextlib.asynccontextmanager
async def _sa_async_connection(dsn: str, dialect: str) -> AsyncIterator[Stack]:
    engine = create_async_engine(_url(dsn, dialect))
    try:
        async with engine.connect() as c:
            yield Stack(c, c.commit, c.rollback)
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def _sa_async_session(dsn: str, dialect: str) -> AsyncIterator[Stack]:
    engine = create_async_engine(_url(dsn, dialect))
    try:
        async with AsyncSession(engine) as s:
            yield Stack(s, s.commit, s.rollback)
    finally:
        await engine.dispose()


ASYNC: dict[str, Callable[[str], contextlib.AbstractAsyncContextManager[Stack]]] = {
    "asyncpg": _asyncpg,
    "asyncpg-pool": _asyncpg_pool,
    "sqlalchemy-asyncconnection-asyncpg": lambda dsn: _sa_async_connection(dsn, "asyncpg"),
    "sqlalchemy-asyncconnection-psycopg": lambda dsn: _sa_async_connection(dsn, "psycopg"),
    "sqlalchemy-asyncsession-asyncpg": lambda dsn: _sa_async_session(dsn, "asyncpg"),
    "sqlalchemy-asyncsession-psycopg": lambda dsn: _sa_async_session(dsn, "psycopg"),
}


def _count(conn: psycopg.Connection[Any], where: str = "true") -> int:
    row = conn.execute(f"SELECT count(*) FROM outbox WHERE {where}").fetchone()
    assert row is not None
    return int(row[0])


LATER = datetime.now(UTC).replace(microsecond=0) + timedelta(days=30)


def _batch(n: int) -> list[outboxpg.Event]:
    return [outboxpg.Event("order", f"o-{i}", "imported", {"i": i}, headers={"h": f"{i}\tx\\y"},
                           idempotency_key=f"k-{i}" if i % 2 else None,
                           deliver_at=LATER if i % 10 == 0 else None)
            for i in range(n)]


# -- sync --------------------------------------------------------------------------------------

@pytest.mark.parametrize("stack", SYNC)
def test_sync_commit_keeps_rollback_leaves_nothing(stack: str, dsn: str, conn: psycopg.Connection[Any]) -> None:
    with SYNC[stack](dsn) as s:
        assert drivers.fetch_one(s.conn, "SELECT %s::int + 1", (1,)) == (2,)
        rolled = outboxpg.enqueue(s.conn, "order", "o-1", "created", {"total": 1})
        assert isinstance(rolled, int)
        assert _count(conn) == 0, "not visible before the caller commits"
        s.rollback()
        assert _count(conn) == 0
        first = outboxpg.enqueue(s.conn, "order", "o-1", "created", {"total": 42}, headers={"a": "b"},
                                 deliver_at=LATER, idempotency_key="key-1")
        again = outboxpg.enqueue(s.conn, "order", "o-1", "created", {"total": 42}, idempotency_key="key-1")
        assert (int(again), again.duplicate, first.duplicate) == (int(first), True, False)
        s.commit()
    row = conn.execute("SELECT id, payload, headers, deliver_at, idempotency_key FROM outbox").fetchall()
    assert row == [(int(first), {"total": 42}, {"a": "b"}, LATER, "key-1")]


@pytest.mark.parametrize("stack", SYNC)
def test_sync_enqueue_many_bulk(stack: str, dsn: str, conn: psycopg.Connection[Any]) -> None:
    with SYNC[stack](dsn) as s:
        assert outboxpg.enqueue_many(s.conn, _batch(1000)) == 1000
        assert outboxpg.enqueue_many(s.conn, []) == 0
        # the odd ones hold their keys: a second batch writes only the even ones
        assert outboxpg.enqueue_many(s.conn, _batch(10)) == 5
        s.commit()
        assert outboxpg.enqueue_many(s.conn, _batch(1000)) == 500
        s.rollback()
    assert _count(conn) == 1005
    assert _count(conn, "deliver_at IS NOT NULL") == 101
    assert _count(conn, "headers->>'h' = '7' || chr(9) || 'x\\y'") == 1
    assert _count(conn, "payload = '{\"i\": 999}'") == 1


@pytest.mark.parametrize("stack", SYNC)
def test_sync_not_installed(stack: str, empty_dsn: str) -> None:
    with SYNC[stack](empty_dsn) as s:
        with pytest.raises(outboxpg.NotInstalled, match=r"^the outbox schema is not installed in database "
                           r"outboxpg_empty_\d+ on 127\.0\.0\.1:\d+ \(relation \"outbox\" does not exist\): run"):
            outboxpg.enqueue(s.conn, "order", "o-1", "created", {})
        s.rollback()
        with pytest.raises(outboxpg.NotInstalled):
            outboxpg.enqueue_many(s.conn, _batch(3))


@pytest.mark.parametrize("stack", SYNC)
def test_sync_not_json_and_savepoint(stack: str, dsn: str, conn: psycopg.Connection[Any]) -> None:
    with SYNC[stack](dsn) as s:
        outboxpg.enqueue(s.conn, "order", "o-1", "kept", {})
        with pytest.raises(Exception, match=r"^payload is not JSON \(.*\): a str or bytes payload") as caught:
            outboxpg.enqueue(s.conn, "order", "o-1", "bad", "shipped", savepoint=True)
        assert "\n" not in str(caught.value)
        with pytest.raises(Exception, match=r"^event 2 of the batch: payload is not JSON"):
            outboxpg.enqueue_many(s.conn, [outboxpg.Event("order", "o-1", "ok", "{}"),
                                           outboxpg.Event("order", "o-1", "bad", "nope")], savepoint=True)
        outboxpg.enqueue(s.conn, "order", "o-1", "after", {})   # the transaction goes on
        s.commit()
    assert [r[0] for r in conn.execute("SELECT event_type FROM outbox ORDER BY id")] == ["kept", "after"]


def test_sync_unknown_connection_type() -> None:
    with pytest.raises(TypeError, match=r"^outboxpg cannot write through a builtins.object: pass a psycopg 3"):
        outboxpg.enqueue(object(), "order", "o-1", "created", {})


def test_django_atomic(dsn: str, conn: psycopg.Connection[Any]) -> None:
    from django.db import transaction

    connection = _django_ready(dsn)
    try:
        with transaction.atomic():
            outboxpg.enqueue(connection, "order", "o-1", "kept", {})
        with pytest.raises(RuntimeError, match="the business change failed"), transaction.atomic():
            outboxpg.enqueue(connection, "order", "o-1", "rolled-back", {})
            raise RuntimeError("the business change failed")
    finally:
        connection.close()
    assert [r[0] for r in conn.execute("SELECT event_type FROM outbox")] == ["kept"]


# -- async -------------------------------------------------------------------------------------

@pytest.mark.parametrize("stack", ASYNC)
async def test_async_commit_keeps_rollback_leaves_nothing(stack: str, dsn: str,
                                                          conn: psycopg.Connection[Any]) -> None:
    async with ASYNC[stack](dsn) as s:
        assert await drivers.fetch_one(s.conn, "SELECT %s::int + 1", (1,)) == (2,)
        await outboxpg.enqueue(s.conn, "order", "o-1", "created", {"total": 1})
        assert _count(conn) == 0
        await s.rollback()
    async with ASYNC[stack](dsn) as s:
        first = await outboxpg.enqueue(s.conn, "order", "o-1", "created", {"total": 42}, headers={"a": "b"},
                                       deliver_at=LATER, idempotency_key="key-1")
        again = await outboxpg.enqueue(s.conn, "order", "o-1", "created", {}, idempotency_key="key-1")
        assert (int(again), again.duplicate) == (int(first), True)
        await s.commit()
    rows = conn.execute("SELECT id, payload, headers, deliver_at, idempotency_key FROM outbox").fetchall()
    assert rows == [(int(first), {"total": 42}, {"a": "b"}, LATER, "key-1")]


@pytest.mark.parametrize("stack", [s for s in ASYNC if s.startswith("sqlalchemy")])
async def test_async_sqlalchemy_first_statement(stack: str, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The event is the transaction's first statement: SQLAlchemy's autobegin still holds it."""
    async with ASYNC[stack](dsn) as s:
        await outboxpg.enqueue(s.conn, "order", "o-1", "created", {})
        await outboxpg.enqueue_many(s.conn, _batch(3))
        assert _count(conn) == 0
        await s.rollback()
    assert _count(conn) == 0


@pytest.mark.parametrize("stack", ASYNC)
async def test_async_enqueue_many_bulk(stack: str, dsn: str, conn: psycopg.Connection[Any]) -> None:
    async with ASYNC[stack](dsn) as s:
        assert await outboxpg.enqueue_many(s.conn, _batch(1000)) == 1000
        assert await outboxpg.enqueue_many(s.conn, []) == 0
        assert await outboxpg.enqueue_many(s.conn, _batch(10)) == 5
        await s.commit()
    async with ASYNC[stack](dsn) as s:
        assert await outboxpg.enqueue_many(s.conn, _batch(1000)) == 500
        await s.rollback()
    assert _count(conn) == 1005
    assert _count(conn, "deliver_at IS NOT NULL") == 101
    assert _count(conn, "headers->>'h' = '7' || chr(9) || 'x\\y'") == 1


@pytest.mark.parametrize("stack", ASYNC)
async def test_async_not_installed(stack: str, empty_dsn: str) -> None:
    async with ASYNC[stack](empty_dsn) as s:
        with pytest.raises(outboxpg.NotInstalled, match=r"^the outbox schema is not installed in database "
                           r"outboxpg_empty_\d+ on 127\.0\.0\.1:\d+ \(relation \"outbox\" does not exist\): run"):
            await outboxpg.enqueue(s.conn, "order", "o-1", "created", {}, savepoint=True)
        with pytest.raises(outboxpg.NotInstalled):
            await outboxpg.enqueue_many(s.conn, _batch(3), savepoint=True)
        await s.rollback()


@pytest.mark.parametrize("stack", ASYNC)
async def test_async_not_json_and_savepoint(stack: str, dsn: str, conn: psycopg.Connection[Any]) -> None:
    async with ASYNC[stack](dsn) as s:
        await outboxpg.enqueue(s.conn, "order", "o-1", "kept", {})
        with pytest.raises(Exception, match=r"^payload is not JSON \(.*\): a str or bytes payload"):
            await outboxpg.enqueue(s.conn, "order", "o-1", "bad", "shipped", savepoint=True)
        with pytest.raises(Exception, match=r"^event 2 of the batch: payload is not JSON"):
            await outboxpg.enqueue_many(s.conn, [outboxpg.Event("order", "o-1", "ok", "{}"),
                                                 outboxpg.Event("order", "o-1", "bad", "nope")], savepoint=True)
        await outboxpg.enqueue(s.conn, "order", "o-1", "after", {})
        await s.commit()
    assert [r[0] for r in conn.execute("SELECT event_type FROM outbox ORDER BY id")] == ["kept", "after"]


# -- the inbox on every stack -------------------------------------------------------------------

@pytest.mark.parametrize("stack", SYNC)
def test_sync_inbox_receive(stack: str, dsn: str, conn: psycopg.Connection[Any]) -> None:
    """outboxpg.inbox.receive goes through the same drivers: in the caller's transaction."""
    schema.migrate_inbox(dsn)
    with SYNC[stack](dsn) as s:
        assert inbox.receive(s.conn, "billing", "m-1") is True
        assert inbox.receive(s.conn, "billing", "m-1") is False
        s.rollback()
        assert inbox.receive(s.conn, "billing", "m-1") is True     # the rollback took the first one back
        s.commit()
        assert inbox.receive(s.conn, "billing", "m-1") is False
        s.rollback()


@pytest.mark.parametrize("stack", ASYNC)
async def test_async_inbox_receive(stack: str, dsn: str, conn: psycopg.Connection[Any]) -> None:
    schema.migrate_inbox(dsn)
    async with ASYNC[stack](dsn) as s:
        assert await inbox.receive(s.conn, "billing", "a-1") is True
        assert await inbox.receive(s.conn, "billing", "a-1") is False
        await s.rollback()
    async with ASYNC[stack](dsn) as s:
        assert await inbox.receive(s.conn, "billing", "a-1") is True
        await s.commit()
    async with ASYNC[stack](dsn) as s:
        assert await inbox.receive(s.conn, "billing", "a-1") is False


@pytest.mark.parametrize("stack", ["psycopg2", "asyncpg"])
async def test_inbox_not_installed_names_the_database(stack: str, dsn: str) -> None:
    where = f"database {conninfo_to_dict(dsn)['dbname']}"
    if stack in SYNC:
        with SYNC[stack](dsn) as s, pytest.raises(inbox.InboxNotInstalled, match=f"not installed in {where}"):
            inbox.receive(s.conn, "billing", "m-1")
    else:
        async with ASYNC[stack](dsn) as s:
            with pytest.raises(inbox.InboxNotInstalled, match=f"not installed in {where}"):
                await inbox.receive(s.conn, "billing", "m-1")
