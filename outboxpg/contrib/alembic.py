"""The outbox schema from an Alembic revision (docs/how-to/alembic.md)::

    from alembic import op
    from outboxpg.contrib import alembic as outboxpg_schema

    def upgrade():
        outboxpg_schema.upgrade(op, through="0017_schema_3")

    def downgrade():
        outboxpg_schema.downgrade(op)

The steps run on the revision's own connection, in its transaction, and are recorded in yoyo's
bookkeeping as ``outboxpg migrate`` records them: ``outboxpg migrate --status`` lists them as
applied, and either tool can take over later. The engine's driver is psycopg 3
(``postgresql+psycopg://``) or psycopg2.
"""

from __future__ import annotations

from typing import Any

from outboxpg import schema

__all__ = ["downgrade", "upgrade"]


def _dbapi_connection(op: Any) -> Any:
    if op.get_context().as_sql:
        raise RuntimeError("outboxpg's steps cannot be written as an offline (--sql) script: "
                           "`outboxpg sql` prints the schema as one psql script")
    return op.get_bind().connection.dbapi_connection


def upgrade(op: Any, through: str | None = None) -> list[str]:
    """Apply the steps not yet applied: every step this version of outboxpg ships, or those up to
    and including ``through`` (pin it, so that the revision does the same on every database).
    Returns the ids applied."""
    return schema.migrate_in(_dbapi_connection(op), through=through)


def downgrade(op: Any, to: str | None = None) -> list[str]:
    """Roll back every applied step after ``to`` (None: every step, the schema is gone).
    Returns the ids rolled back, newest first."""
    return schema.rollback_in(_dbapi_connection(op), to=to)
