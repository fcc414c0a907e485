"""The worker's look at the xmin horizon: who keeps VACUUM from removing the outbox's dead row
versions (migration 0017, ``outbox_xmin_holders()``). A REPEATABLE READ transaction left idle, an
undecided prepared transaction or an abandoned replication slot makes every claim step over more
dead versions the longer it holds; the relay slows down with no error anywhere. The oldest holder
past ``outbox_settings.xmin_warn_after`` is logged once (event=xmin_held, WARNING), again only when
another holder takes its place, and the end of it once (event=xmin_horizon_clear)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg

from outboxpg.relay.gateway import Gateway
from outboxpg.text import age, first_line

__all__ = ["XminHolder", "XminWatch", "watch_xmin_every"]

log = logging.getLogger("outboxpg.worker")



def sql_literal(text: str) -> str:
    """``text`` as a SQL string literal (PostgreSQL's quote_literal with standard_conforming_strings
    on): safe to paste into psql whatever the name holds."""
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class XminHolder:
    kind: str                   # session, prepared transaction, replication slot
    pid: int | None
    name: str | None            # the prepared transaction's gid, the slot's name
    since: datetime | None      # its transaction's start, its PREPARE; None for a slot
    age_seconds: float | None
    xmin_age: int | None        # transactions since its xmin
    state: str | None
    role: str | None            # the role a session or walsender logged in as (never its query)
    application_name: str | None

    @property
    def identity(self) -> tuple[Any, ...]:
        """The same holder from one look to the next: a session's next transaction is another one."""
        return self.kind, self.pid, self.name, self.since

    def text(self) -> str:
        """For people: "session pid 4242 of role 'shop_app' (application 'report'), idle in
        transaction, for 2 min 05 s"."""
        who = self.kind if self.pid is None else f"{self.kind} pid {self.pid}"
        if self.name is not None:
            who += f" {self.name!r}"
        if self.role:
            who += f" of role {self.role!r}"
        if self.application_name:
            who += f" (application {self.application_name!r})"
        parts = [who]
        if self.state:
            parts.append(self.state)
        if self.age_seconds is not None:
            parts.append(f"for {age(timedelta(seconds=self.age_seconds))}")
        if self.xmin_age is not None:
            parts.append(f"{self.xmin_age} transactions ago")
        return ", ".join(parts)

    def advice(self) -> str:
        if self.kind == "session":
            return (f"VACUUM can remove no dead row version of the outbox while it holds, and claims slow down: "
                    f"end the transaction in its application, or SELECT pg_terminate_backend({self.pid})")
        if self.kind == "prepared transaction":
            return (f"VACUUM can remove no dead row version while it holds: COMMIT PREPARED or "
                    f"ROLLBACK PREPARED {sql_literal(self.name or '')}")
        return (f"VACUUM can remove no dead row version while it holds: bring its standby back, or "
                f"SELECT pg_drop_replication_slot({sql_literal(self.name or '')}) if nothing uses it any more")


class XminWatch:
    """Remembers which holder it has logged."""

    def __init__(self) -> None:
        self.logged: tuple[Any, ...] | None = None
        self.failing = False

    def saw(self, holder: XminHolder | None) -> None:
        """One look's result: log a holder not logged before, or the end of the last one."""
        if holder is None:
            if self.logged is not None:
                log.info("event=xmin_horizon_clear note=%r", "no holder of the xmin horizon past xmin_warn_after")
                self.logged = None
            return
        if holder.identity == self.logged:
            return
        self.logged = holder.identity
        log.warning("event=xmin_held kind=%r pid=%s name=%r age_s=%s xmin_age=%s state=%r role=%r application=%r "
                    "note=%r", holder.kind, holder.pid, holder.name,
                    "unknown" if holder.age_seconds is None else f"{holder.age_seconds:.0f}", holder.xmin_age,
                    holder.state, holder.role, holder.application_name, holder.advice())

    def failed(self, exc: psycopg.Error) -> None:
        """The look failed: said once, until one succeeds again (delivery does not depend on it)."""
        if not self.failing:
            log.warning("event=xmin_check_failed error=%r", first_line(exc))
        self.failing = True


async def look(gateway: Gateway, watch: XminWatch) -> None:
    try:
        row = await gateway.oldest_xmin_holder()
    except psycopg.Error as exc:
        watch.failed(exc)
        return
    watch.failing = False
    watch.saw(None if row is None else XminHolder(*row))


async def watch_xmin_every(gateway: Gateway, interval: float) -> None:
    """Look now and every ``interval`` seconds, until cancelled."""
    watch = XminWatch()
    while True:
        await look(gateway, watch)
        await asyncio.sleep(interval)
