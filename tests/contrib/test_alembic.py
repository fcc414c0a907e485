"""outboxpg.contrib.alembic: a fresh Alembic project, built here, installs the schema in a
revision; `outboxpg migrate` then finds every step applied; events enqueued in a transaction are
delivered by drain(); the downgrade takes the schema away."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL

import outboxpg
from outboxpg import schema
from outboxpg.sql_files import step_ids
from outboxpg.testing import InMemoryPublisher, drain

BIN = Path(sys.executable).parent

REVISION = '''
from alembic import op
import sqlalchemy as sa

from outboxpg.contrib import alembic as outboxpg_schema

revision = "0001_outbox"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table("orders", sa.Column("id", sa.Integer, primary_key=True), sa.Column("total", sa.Integer))
    outboxpg_schema.upgrade(op, through="{through}")


def downgrade():
    outboxpg_schema.downgrade(op)
    op.drop_table("orders")
'''


def sqlalchemy_url(dsn: str) -> str:
    p = conninfo_to_dict(dsn)
    return URL.create("postgresql+psycopg", username=p.get("user"), password=p.get("password"),
                      host=p.get("host"), port=int(p["port"]) if p.get("port") else None,
                      database=p.get("dbname")).render_as_string(hide_password=False)


def run(*args: str, cwd: Path) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_alembic_installs_upgrades_and_downgrades(tmp_path: Path, empty_dsn: str) -> None:
    run(str(BIN / "alembic"), "init", "migrations", cwd=tmp_path)
    ini = tmp_path / "alembic.ini"
    ini.write_text(ini.read_text().replace("sqlalchemy.url = driver://user:pass@localhost/dbname",
                                           "sqlalchemy.url = " + sqlalchemy_url(empty_dsn).replace("%", "%%")))
    (tmp_path / "migrations" / "versions" / "0001_outbox.py").write_text(REVISION.format(through=step_ids()[-1]))

    run(str(BIN / "alembic"), "upgrade", "head", cwd=tmp_path)

    status = run(str(BIN / "outboxpg"), "migrate", "--status", "--dsn", empty_dsn, cwd=tmp_path)
    for step in step_ids():
        assert step in status
    assert all(s.applied for s in schema.pending(empty_dsn))
    assert "up to date" in run(str(BIN / "outboxpg"), "migrate", "--dsn", empty_dsn, cwd=tmp_path)

    with psycopg.connect(empty_dsn) as conn:     # one transaction: the order and its events
        conn.execute("INSERT INTO orders VALUES (1, 42)")
        outboxpg.enqueue(conn, "order", "1", "OrderPlaced", {"total": 42})
        outboxpg.enqueue(conn, "order", "1", "OrderPaid", {"total": 42})
    published = InMemoryPublisher()
    assert [(e.event_type, e.json()) for e in drain(empty_dsn, published)] == [
        ("OrderPlaced", {"total": 42}), ("OrderPaid", {"total": 42})]
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox WHERE state = 'published'").fetchone() == (2,)

    run(str(BIN / "alembic"), "downgrade", "base", cwd=tmp_path)
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT to_regclass('outbox_settings'), to_regclass('orders')").fetchone() == (None, None)
    assert not any(s.applied for s in schema.pending(empty_dsn))
    # And `outboxpg migrate` takes over from there.
    assert schema.migrate(empty_dsn) == step_ids()
