"""Installing and upgrading the outbox schema from the migration tool an application already
runs: ``outboxpg.contrib.alembic`` (call it in a revision) and the Django app
``outboxpg.contrib.django``. Both apply the steps of ``migrations/`` in the tool's own
transaction and record them in yoyo's bookkeeping, as ``outboxpg migrate`` does
(``outboxpg.schema.migrate_in``)."""
