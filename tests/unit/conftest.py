"""The unit tier: pure functions, in this process, with no PostgreSQL and no nats-server; the
whole folder runs in seconds (bin/test tests/unit). A test here that asks for a server fixture
(directly or through another fixture) is refused at collection: it belongs to another folder."""

from __future__ import annotations

from pathlib import Path

import pytest

# Every fixture that starts or reaches a server depends on one of these.
SERVER_FIXTURES = frozenset({"pg_server", "nats_server", "own_nats_server", "pgbouncer"})
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.resolve().parents:
            servers = SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
            if servers:
                raise pytest.UsageError(f"{item.nodeid}: a unit test starts no server, but this one uses "
                                        f"{', '.join(sorted(servers))}")
