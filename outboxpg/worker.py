"""Compatibility: the relay lives in outboxpg.relay (``from outboxpg.worker import Worker,
WorkerConfig`` keeps working)."""

from outboxpg.relay.worker import RawJsonLoader, Worker, WorkerConfig, WorkerStats, application_name, split_runs

__all__ = ["RawJsonLoader", "Worker", "WorkerConfig", "WorkerStats", "application_name", "split_runs"]
