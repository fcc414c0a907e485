"""Telling a transaction pooler (PgBouncer ``pool_mode = transaction`` or ``statement``) from a
real session, before the worker relies on session state.

The worker without ``--poll-only`` keeps state in its sessions: a LISTEN connection, and the
wakeup lock, a session advisory lock held while it sleeps. Behind a transaction pooler neither
works: the LISTEN is on whatever server connection ran that statement (notifications never
come back), and the lock stays held by a pooled server connection after the worker let go or
stopped, so every producer NOTIFYs on every insert until the pooler recycles it.

The probe (no state left anywhere, four short statements on two connections):

  1. on connection A, ``SELECT pg_backend_pid()``: the backend that ran it (pA1);
  2. on connection B, ``BEGIN; SELECT pg_backend_pid()``, kept open: B's backend (pB);
  3. on connection A again, ``SELECT pg_backend_pid()`` (pA2); then B rolls back.

Connected to PostgreSQL itself (or through a session pooler), A keeps one backend for its
whole life and B has another of its own: pB != pA1 and pA2 == pA1, always. Behind a transaction
pooler A holds no server connection between its statements: B's transaction is handed a server
connection from the idle pool, which is A's former one whenever the pooler reuses the most
recently used connection first (PgBouncer's default, ``server_round_robin = 0``), so pB == pA1;
and while B holds it, A's next statement runs on another backend, so pA2 != pA1. Either sign is
enough. A statement pooler refuses B's ``BEGIN``: that is a pooler too.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outboxpg import statements
from outboxpg.relay.wakeup import CONNECT_OPTIONS

__all__ = ["POOLER_HINT", "behind_transaction_pooler"]

POOLER_HINT = ("the database connection goes through a transaction pooler (e.g. PgBouncer pool_mode=transaction), "
               "which drops the LISTEN and leaks the wakeup lock: run the worker with --poll-only "
               "(or connect it to PostgreSQL directly or through a session pool)")

async def behind_transaction_pooler(dsn: str) -> bool:
    """True when connections to ``dsn`` do not keep one server session across transactions.

    Opens two short-lived connections of its own. Nothing is prepared (``prepare_threshold``
    None) and nothing is left behind: both connections only read their backend's pid.
    """
    kwargs: dict[str, Any] = {**CONNECT_OPTIONS, "autocommit": True, "prepare_threshold": None}
    async with await psycopg.AsyncConnection.connect(dsn, **kwargs) as a, \
            await psycopg.AsyncConnection.connect(dsn, **kwargs) as b:
        pid_a1 = await _pid(a)
        try:
            async with b.transaction():
                pid_b = await _pid(b)
                pid_a2 = await _pid(a)
                # It only read a pid; roll it back all the same (psycopg swallows Rollback).
                raise psycopg.Rollback()
        except psycopg.Error as exc:
            # PgBouncer in statement mode: "transaction blocks not allowed in statement pooling mode".
            if "pooling mode" in str(exc):
                return True
            raise
    return pid_b == pid_a1 or pid_a2 != pid_a1


async def _pid(conn: psycopg.AsyncConnection[Any]) -> int:
    row = await (await conn.execute(statements.BACKEND_PID)).fetchone()
    assert row is not None
    return int(row[0])
