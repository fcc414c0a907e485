"""outboxpg with Django (docs/how-to/produce-stacks.md): django.db.connection inside
transaction.atomic(). A real project has these settings in settings.py.

    python examples/stacks/django_app.py      # PGHOST, PGPORT, PGUSER, PGDATABASE say where
"""

import os

import django
from django.conf import settings

settings.configure(DATABASES={"default": {"ENGINE": "django.db.backends.postgresql",
                                          "NAME": os.environ["PGDATABASE"]}}, USE_TZ=True)
django.setup()

from django.db import connection, transaction  # noqa: E402  (after settings, as Django wants)

import outboxpg  # noqa: E402


def place_order(order_id: str) -> None:
    with transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("INSERT INTO orders (id, total) VALUES (%s, %s)", [order_id, 42])
        outboxpg.enqueue(connection, "order", order_id, "placed", {"total": 42})


with connection.cursor() as cur:
    cur.execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY, total int)")
place_order("o-1")
try:
    with transaction.atomic():
        outboxpg.enqueue(connection, "order", "o-2", "placed", {"total": 7})
        raise RuntimeError("payment refused")             # the event rolls back with the block
except RuntimeError as exc:
    print(f"o-2: {exc}")
with connection.cursor() as cur:
    cur.execute("SELECT aggregate_id FROM outbox")
    print("events for:", [row[0] for row in cur.fetchall()])
