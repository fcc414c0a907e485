"""outboxpg: a SQL-first transactional outbox for PostgreSQL."""

from outboxpg.producer import Event, enqueue, enqueue_many

__all__ = ["Event", "enqueue", "enqueue_many"]
__version__ = "0.1.0"
