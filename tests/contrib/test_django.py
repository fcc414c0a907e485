"""The Django app outboxpg.contrib.django: a fresh Django project, built here, installs the
schema with `manage.py migrate`; `outboxpg migrate` then finds every step applied; an event
written through the ORM's connection in a transaction is delivered by drain(); migrating the
app to zero takes the schema away. Django runs in subprocesses (its settings are per process)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outboxpg import schema
from outboxpg.sql_files import step_ids
from outboxpg.testing import InMemoryPublisher, drain

BIN = Path(sys.executable).parent
APP_MIGRATIONS = Path(schema.__file__).parent / "contrib" / "django" / "migrations"

SETTINGS = '''
SECRET_KEY = "test"
USE_TZ = True
INSTALLED_APPS = ["outboxpg.contrib.django"]
DATABASES = {{"default": {{"ENGINE": "django.db.backends.postgresql", "NAME": {dbname!r}, "USER": {user!r},
                          "PASSWORD": {password!r}, "HOST": {host!r}, "PORT": {port!r}}}}}
'''

ENQUEUE = '''
import django
django.setup()
from django.db import connection, transaction

with transaction.atomic(), connection.cursor() as cur:
    for event in ("OrderPlaced", "OrderPaid"):
        cur.execute("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) "
                    "VALUES ('order', '1', %s, '{{}}')", [event])
'''


def django(tmp_path: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "DJANGO_SETTINGS_MODULE": "settings"}
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{args}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_django_app_installs_and_reverses(tmp_path: Path, empty_dsn: str) -> None:
    p = conninfo_to_dict(empty_dsn)
    (tmp_path / "settings.py").write_text(SETTINGS.format(
        dbname=p["dbname"], user=p.get("user", ""), password=p.get("password", ""), host=p.get("host", ""),
        port=str(p.get("port", ""))))
    (tmp_path / "enqueue.py").write_text(ENQUEUE.format())

    django(tmp_path, "-m", "django", "migrate", "outboxpg")
    assert all(s.applied for s in schema.pending(empty_dsn))
    assert schema.migrate(empty_dsn) == []            # `outboxpg migrate`: up to date
    # The app defines no models: nothing for makemigrations to write.
    django(tmp_path, "-m", "django", "makemigrations", "outboxpg", "--check", "--dry-run")

    django(tmp_path, "enqueue.py")
    published = InMemoryPublisher()
    assert [e.event_type for e in drain(empty_dsn, published)] == ["OrderPlaced", "OrderPaid"]

    django(tmp_path, "-m", "django", "migrate", "outboxpg", "zero")
    assert not any(s.applied for s in schema.pending(empty_dsn))
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT to_regclass('outbox_settings')").fetchone() == (None,)


def test_the_newest_migration_applies_every_step() -> None:
    """A new outbox step needs a migration of the Django app (OutboxSteps(through=<it>, back_to=
    <the step before>)): without one, `manage.py migrate` would never apply it."""
    newest = sorted(APP_MIGRATIONS.glob("[0-9]*.py"))[-1]
    calls = [n for n in ast.walk(ast.parse(newest.read_text())) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "OutboxSteps"]
    through = {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords}["through"]
    assert through == step_ids()[-1], f"{newest.name} applies through {through}; add a migration through {step_ids()[-1]}"
