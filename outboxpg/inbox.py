"""The transactional inbox: a consumer records each message id it processes in its own transaction
(schema/inbox/, installed alone with ``outboxpg migrate --inbox``; docs/how-to/inbox.md).

    with conn.transaction():
        if outboxpg.inbox.receive(conn, "billing", msg.headers["Nats-Msg-Id"]):
            ...  # the consumer's own writes, on the same connection
    await msg.ack()   # after the commit

``receive`` takes every connection the producer helpers take (psycopg 3 and psycopg2, asyncpg,
SQLAlchemy 2 connections and sessions, Django: outboxpg.drivers) and sends one statement
(statements.INBOX_RECEIVE) and nothing else: it neither opens nor commits a transaction. On an
autocommit connection outside a transaction the id is committed at once, before the side
effect: that is at-most-once, not exactly-once.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from outboxpg import drivers, statements

__all__ = ["InboxNotInstalled", "receive"]


class InboxNotInstalled(Exception):
    """outbox_inbox_receive is not in the database (or not on the connection's search_path)."""


def _checked(driver: drivers.Driver | drivers.AsyncDriver, exc: Exception) -> Exception:
    """InboxNotInstalled for a missing function (the driver's error as its cause), else ``exc``."""
    failure = driver.failure(exc)
    if failure is None or failure.kind != "undefined_function":
        return exc
    return InboxNotInstalled(f"the inbox is not installed in {driver.where()} (outbox_inbox_receive is missing): "
                             f"run outboxpg migrate --inbox --dsn ... ({failure.primary})")


def _answer(row: tuple[Any, ...] | None) -> bool:
    assert row is not None and isinstance(row[0], bool)
    return row[0]


def receive(conn: Any, consumer: str, msg_id: str) -> bool | Awaitable[bool]:
    """Record that ``consumer`` processes ``msg_id``, in the connection's current transaction.

    True the first time: process the message in this transaction. False when it was processed
    before (within the inbox's retention): skip it and ack. A concurrent duplicate waits for the
    first transaction, and answers False if it commits, True if it rolls back. On an async
    connection it returns an awaitable: ``await receive(aconn, ...)``.
    """
    if drivers.is_async(conn):
        return _receive_async(conn, consumer, msg_id)
    driver = drivers.sync_driver(conn)
    try:
        return _answer(driver.fetch_one(statements.INBOX_RECEIVE, (consumer, msg_id)))
    except Exception as exc:
        checked = _checked(driver, exc)
        if checked is exc:
            raise
        raise checked from exc


async def _receive_async(conn: Any, consumer: str, msg_id: str) -> bool:
    driver = await drivers.async_driver(conn)
    try:
        return _answer(await driver.fetch_one(statements.INBOX_RECEIVE, (consumer, msg_id)))
    except Exception as exc:
        checked = _checked(driver, exc)
        if checked is exc:
            raise
        raise checked from exc
