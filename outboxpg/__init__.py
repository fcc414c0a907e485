"""outboxpg: a SQL-first transactional outbox for PostgreSQL."""

from outboxpg.producer import Enqueued, Event, NotInstalled, enqueue, enqueue_many
from outboxpg.replays import replay

__all__ = ["Enqueued", "Event", "NotInstalled", "enqueue", "enqueue_many", "replay"]
__version__ = "0.1.0"
