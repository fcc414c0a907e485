"""The operation of this app's migrations: ``OutboxSteps(through=..., back_to=...)`` applies the
outbox steps up to ``through`` on the migration's connection, in its transaction, recorded in
yoyo's bookkeeping (``outboxpg.schema.migrate_in``); reversed, it rolls back every step after
``back_to``.

Each outboxpg release that ships a new step adds a migration here with
``OutboxSteps(through=<the new step>, back_to=<the previous migration's through>)``."""

from __future__ import annotations

from typing import Any

from django.db import migrations

from outboxpg import schema


def _dbapi_connection(schema_editor: Any) -> Any:
    schema_editor.connection.ensure_connection()
    return schema_editor.connection.connection


def OutboxSteps(through: str, back_to: str | None) -> migrations.RunPython:  # noqa: N802 - reads as an operation
    def forward(apps: Any, schema_editor: Any) -> None:
        schema.migrate_in(_dbapi_connection(schema_editor), through=through)

    def backward(apps: Any, schema_editor: Any) -> None:
        schema.rollback_in(_dbapi_connection(schema_editor), to=back_to)

    return migrations.RunPython(forward, backward, atomic=True, elidable=False)
