"""The transactional inbox: a consumer records each message id it processes in its own transaction
(schema/inbox/, installed alone with ``outboxpg migrate --inbox``; docs/how-to/inbox.md).

    with conn.transaction():
        if outboxpg.inbox.receive(conn, "billing", msg.headers["Nats-Msg-Id"]):
            ...  # the consumer's own writes, on the same connection
    await msg.ack()   # after the commit

``receive`` sends one statement (statements.INBOX_RECEIVE) and nothing else: it neither opens nor
commits a transaction. On an autocommit connection outside a transaction the id is committed at
once, before the side effect: that is at-most-once, not exactly-once.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, overload

from psycopg import AsyncConnection, Connection, errors

from outboxpg import statements

__all__ = ["InboxNotInstalled", "receive"]


class InboxNotInstalled(Exception):
    """outbox_inbox_receive is not in the database (or not on the connection's search_path)."""


def _not_installed(exc: errors.UndefinedFunction) -> InboxNotInstalled:
    return InboxNotInstalled("the inbox is not installed in this database (outbox_inbox_receive is missing): "
                             f"run outboxpg migrate --inbox --dsn ... ({exc.diag.message_primary})")


def _answer(row: tuple[Any, ...] | None) -> bool:
    assert row is not None and isinstance(row[0], bool)
    return row[0]


@overload
def receive(conn: Connection[Any], consumer: str, msg_id: str) -> bool: ...
@overload
def receive(conn: AsyncConnection[Any], consumer: str, msg_id: str) -> Awaitable[bool]: ...


def receive(conn: Connection[Any] | AsyncConnection[Any], consumer: str, msg_id: str) -> bool | Awaitable[bool]:
    """Record that ``consumer`` processes ``msg_id``, in the connection's current transaction.

    True the first time: process the message in this transaction. False when it was processed
    before (within the inbox's retention): skip it and ack. A concurrent duplicate waits for the
    first transaction, and answers False if it commits, True if it rolls back. On an
    ``AsyncConnection`` it returns an awaitable: ``await receive(aconn, ...)``.
    """
    if isinstance(conn, AsyncConnection):
        return _receive_async(conn, consumer, msg_id)
    try:
        return _answer(conn.execute(statements.INBOX_RECEIVE, (consumer, msg_id)).fetchone())
    except errors.UndefinedFunction as exc:
        raise _not_installed(exc) from exc


async def _receive_async(conn: AsyncConnection[Any], consumer: str, msg_id: str) -> bool:
    try:
        return _answer(await (await conn.execute(statements.INBOX_RECEIVE, (consumer, msg_id))).fetchone())
    except errors.UndefinedFunction as exc:
        raise _not_installed(exc) from exc
