"""--shard-group NAME: the workers of one group split the shards among themselves, without a
leader or anything outside the database.

Each member holds a session advisory lock on a slot of its group, (group key, slot 0..63), on a
connection of its own: the lock lives exactly as long as the member's session. Every second a
member reads the group's held slots from pg_locks; with N slots held and its own the r-th of
them, it claims shard r/N (outbox_claim's 'I/N'). A member that joins or leaves (a worker that
stops, dies, or whose connection is cut: PostgreSQL drops its session's locks with it) changes N
for everyone at the next look.

Members may disagree for up to a second while N changes (one still claims r/3 while another
already claims r/2): a bucket is then claimed by two members or, for that second, by none. Both
are safe: shards only choose where a claim looks. Claims stay exclusive by their row locks, a
run in flight keeps its aggregate's head leased (so order per aggregate holds whoever claims
next), and a dead member's runs stay fenced by their lease tokens until the lease ends; the
member that now holds their bucket then reclaims them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import psycopg

from outboxpg.relay.wakeup import CONNECT_OPTIONS
from outboxpg.statements import SHARD_GROUP_KEY, SHARD_GROUP_MEMBERS, SHARD_GROUP_TAKE

__all__ = ["ShardGroup", "SLOTS"]

log = logging.getLogger("outboxpg.worker")

SLOTS = 64   # as many members as buckets: beyond that a shard would hold no bucket



class GroupFull(Exception):
    """Every slot of the group is held."""


class ShardGroup:
    """A member of a shard group: ``shard`` is the shard to claim now ('I/N'), kept current by
    ``run()``, which calls ``changed`` when it changes (the worker looks at its new shard at
    once, also while it is idle)."""

    def __init__(self, dsn: str, group: str, worker: str, interval: float = 1.0,
                 application_name: str = "outboxpg-worker (shard group)",
                 changed: Callable[[], None] | None = None) -> None:
        self.dsn, self.group, self.worker, self.interval = dsn, group, worker, interval
        self.changed = changed
        self.application_name = application_name
        self.conn: psycopg.AsyncConnection[Any] | None = None
        self.key = 0
        self.slot: int | None = None
        self.shard = ""          # until the first look (join): every aggregate

    async def join(self) -> None:
        """Connect and take the first free slot; GroupFull when none is."""
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True, **CONNECT_OPTIONS,
                                                     fallback_application_name=self.application_name)
        try:
            row = await (await conn.execute(SHARD_GROUP_KEY, (self.group,))).fetchone()
            assert row is not None
            self.key = int(row[0])
            for slot in range(SLOTS):
                row = await (await conn.execute(SHARD_GROUP_TAKE, (self.key, slot))).fetchone()
                if row and row[0]:
                    self.conn, self.slot = conn, slot
                    await self.look()
                    return
        except BaseException:
            await conn.close()
            raise
        await conn.close()
        raise GroupFull(f"shard group {self.group!r} has {SLOTS} members already")

    async def look(self) -> str:
        """Read the group's members; returns (and keeps) this member's shard."""
        assert self.conn is not None and self.slot is not None
        row = await (await self.conn.execute(SHARD_GROUP_MEMBERS, (self.key,))).fetchone()
        slots: list[int] = list(row[0]) if row else []
        if self.slot not in slots:         # not seen (cannot be while the session holds it)
            return self.shard
        shard = f"{slots.index(self.slot)}/{len(slots)}"
        if shard != self.shard:
            log.info("event=shard worker=%s group=%s shard=%s members=%d slot=%d", self.worker, self.group,
                     shard, len(slots), self.slot)
            first, self.shard = not self.shard, shard
            if self.changed is not None and not first:
                self.changed()
        return shard

    async def run(self, stop: asyncio.Event) -> None:
        """Look every ``interval`` seconds until ``stop``; rejoin after the session is lost."""
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
            if stop.is_set():
                break
            try:
                if self.conn is None or self.conn.closed:
                    await self.join()
                else:
                    await self.look()
            except psycopg.Error as exc:
                # The session, and with it the slot, may be gone: the others take its shard at
                # their next look; this member keeps claiming its last shard until it rejoins.
                log.warning("event=shard_group_lost worker=%s group=%s error=%r", self.worker, self.group,
                            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
                await self.leave()
            except GroupFull as exc:
                log.warning("event=shard_group_full worker=%s %s", self.worker, exc)

    async def leave(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                await self.conn.close()
        self.conn, self.slot = None, None
