"""outboxpg.schema.migrate_in / rollback_in: the steps applied in the caller's transaction and
recorded in yoyo's bookkeeping, so that `outboxpg migrate` finds them applied."""

from __future__ import annotations

import psycopg
import pytest

from outboxpg import schema
from outboxpg.sql_files import step_ids


def test_applies_in_the_callers_transaction_and_records_them(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as conn:
        assert schema.migrate_in(conn) == step_ids()
        conn.rollback()           # nothing was committed: the rollback takes everything back
    assert schema.pending(empty_dsn) == [schema.MigrationStep(s, False) for s in step_ids()]
    with psycopg.connect(empty_dsn) as conn:
        assert schema.migrate_in(conn, through=step_ids()[0]) == step_ids()[:1]
        assert schema.migrate_in(conn) == step_ids()[1:]
        assert schema.migrate_in(conn) == []
    assert all(s.applied for s in schema.pending(empty_dsn))
    assert schema.migrate(empty_dsn) == []
    with psycopg.connect(empty_dsn) as conn:
        assert schema.rollback_in(conn, to=step_ids()[-2]) == step_ids()[-1:]
    assert schema.migrate(empty_dsn) == step_ids()[-1:]
    with psycopg.connect(empty_dsn) as conn:
        assert schema.rollback_in(conn) == step_ids()[::-1]
        assert conn.execute("SELECT to_regclass('outbox_settings')").fetchone() == (None,)


def test_unknown_step_is_refused(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as conn, pytest.raises(ValueError, match="not a step"):
        schema.migrate_in(conn, through="0099_nothing")
