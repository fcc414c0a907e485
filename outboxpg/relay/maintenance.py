"""The worker's scheduled outbox_maintain(): partitions created ahead, expired ones dropped; and
outbox_idempotency_forget(): idempotency keys of finished events forgotten, a batch a run.
Workers take turns through the advisory lock inside outbox_maintain() (MAINTENANCE_LOCK in
tests/locks.py): one of many does the work, the others' runs skip."""

from __future__ import annotations

import asyncio
import logging

import psycopg

from outboxpg.relay.gateway import Gateway
from outboxpg.relay.stats import Recorder
from outboxpg.text import first_line

__all__ = ["maintain_every"]

log = logging.getLogger("outboxpg.worker")


async def maintain_every(gateway: Gateway, interval: float, recorder: Recorder) -> None:
    """outbox_maintain() now and every ``interval`` seconds, until cancelled. A failure is logged
    and the next run tries again; delivery never depends on it (inserts fall back to the default
    partition)."""
    while True:
        try:
            for action, partition, detail in await gateway.maintain():
                if action == "skip" and partition is None:
                    log.debug("event=maintenance_skipped reason=%r", detail)
                else:
                    log.info("event=maintenance action=%s partition=%s detail=%r", action, partition, detail)
            forgotten = await gateway.forget_keys()
            if forgotten:
                log.debug("event=idempotency_keys_forgotten keys=%d", forgotten)
        except psycopg.Error as exc:
            log.warning("event=maintenance_failed error=%r retry_in=%gs", first_line(exc), interval)
            recorder.maintenance_failed()
        await asyncio.sleep(interval)
