"""Login roles of a test's own, members of the outbox group roles (schema/90_privileges.sql). Roles belong to
the cluster, not to a test database: each has a unique name and is dropped at the end."""

from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo


@dataclass
class Login:
    name: str
    dsn: str

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True, **kwargs)


def drop_roles(admin_dsn: str, names: list[str]) -> None:
    """End the roles' sessions, drop what they own in this database, drop them."""
    if not names:
        return
    with psycopg.connect(admin_dsn, autocommit=True) as c:
        c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY(%s)", (names,))
        deadline = time.monotonic() + 10
        while c.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = ANY(%s)", (names,)).fetchone()[0]:
            assert time.monotonic() < deadline, f"sessions of {names} did not end"
            time.sleep(0.02)
        idents = sql.SQL(", ").join(map(sql.Identifier, names))
        c.execute(sql.SQL("DROP OWNED BY {}").format(idents))
        c.execute(sql.SQL("DROP ROLE {}").format(idents))


@contextlib.contextmanager
def login_roles(admin_dsn: str, **members_of: str | None) -> Iterator[dict[str, Login]]:
    """``login_roles(dsn, worker="outbox_worker")``: a LOGIN role per keyword, with a unique name
    and a password (so that it also works where the server asks for one), member of the given
    group role; all of them dropped on exit."""
    tag = uuid.uuid4().hex[:8]
    password = secrets.token_hex(12)
    made: dict[str, Login] = {}
    try:
        with psycopg.connect(admin_dsn, autocommit=True) as c:
            for key, group in members_of.items():
                name = f"outboxpg_test_{key}_{tag}"
                c.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(name), sql.Literal(password)))
                made[key] = Login(name, make_conninfo(admin_dsn, user=name, password=password))
                if group:
                    c.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(group), sql.Identifier(name)))
        yield made
    finally:
        drop_roles(admin_dsn, [login.name for login in made.values()])


Denied = psycopg.errors.InsufficientPrivilege


def denied(c: psycopg.Connection[Any], *statements: str) -> None:
    for stmt in statements:
        with pytest.raises(Denied):
            c.execute(stmt)
