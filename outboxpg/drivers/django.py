"""Django: ``django.db.connection`` or ``connections[alias]`` with the PostgreSQL backend (psycopg 3
or psycopg2). The statements run on its DB-API connection: inside ``transaction.atomic()`` they
join that transaction; outside it Django is in autocommit mode and each one commits alone."""

from __future__ import annotations

from typing import Any

from outboxpg.drivers.protocol import loaded


def accepts(conn: object) -> bool:
    base, proxy = loaded("django.db.backends.base.base"), loaded("django.utils.connection")
    return ((base is not None and isinstance(conn, base.BaseDatabaseWrapper))
            or (proxy is not None and isinstance(conn, proxy.ConnectionProxy)))


def driver_connection(conn: Any) -> Any:
    """The DB-API connection under a Django connection, opened if need be."""
    if conn.vendor != "postgresql":
        raise TypeError(f"a Django connection to {conn.vendor}: outboxpg writes to PostgreSQL only")
    conn.ensure_connection()
    conn.validate_no_broken_transaction()   # as Django's own cursors do inside a broken atomic block
    return conn.connection
