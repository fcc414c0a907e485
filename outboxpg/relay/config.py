"""The worker's options, each declared once: a field of WorkerConfig with its type, default and
help (outboxpg.option). ``outboxpg-worker`` builds its flags (``batch_size``: --batch-size) and
environment variables (OUTBOXPG_BATCH_SIZE) from these fields (outboxpg.cli.options), and
WorkerConfig from what it parsed; its own options (NATS, metrics, logging) are declared the same
way beside it. Import WorkerConfig from outboxpg.relay.worker."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from outboxpg.option import option

__all__ = ["WorkerConfig", "shard_range"]


def _default_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# outbox_shard_buckets (schema/40_claim.sql) reads the same form, and says the same when it is not.
_SHARD = re.compile(r"\s*([0-9]{1,4})\s*/\s*([0-9]{1,4})\s*")


def shard_range(shard: str) -> tuple[int, int] | None:
    """(I, N) of a shard 'I/N' as outbox_claim takes it, or None when it is not one."""
    m = _SHARD.fullmatch(shard)
    if m is None:
        return None
    i, n = int(m[1]), int(m[2])
    return (i, n) if 0 <= i < n <= 64 else None


@dataclass
class WorkerConfig:
    # The command takes --dsn repeated (one WorkerConfig per database, outboxpg.cli.databases).
    dsn: str = option("PostgreSQL connection string or URI; repeat it to serve several databases from one process "
                      "(OUTBOXPG_DSN holds one); empty: libpq's PG* variables", command_default="", repeat=True)
    batch_size: int = option("events per claim", 500)
    claim_bytes: int | None = option("bytes of events (payload and headers) per claim at most, one event at least: "
                                     "what a batch holds in memory; default: outbox_settings.max_claim_bytes (64 MiB)",
                                     None, metavar="N")
    shard: str = option("claim only the aggregates of shard I of N (0 <= I < N <= 64): each aggregate is in one "
                        "of 64 buckets by a hash of its key, shard I holds about 64/N of them; '' every aggregate. "
                        "Every shard needs a worker; the schema owner first runs SELECT outbox_shards_enable() "
                        "(docs/how-to/shards.md)", "", metavar="I/N")
    shard_group: str = option("split the shards with the other workers of this group (same name, same database): "
                              "each holds a session advisory lock on a slot of the group and claims shard r/N, "
                              "N the members, r its rank; a member that leaves or dies is taken over within a "
                              "second, its runs in flight once their leases end; not with --shard or --poll-only",
                              "", metavar="NAME")
    concurrency: int = option("batches in flight at once (per database)", 4)
    report_connections: int = option("connections the reports keep open while the worker is idle (per database), "
                                     "each planned as it opens (outbox_warm_up): a burst's first reports need no "
                                     "new server session; 0: opened when reports come, closed after 10 idle minutes "
                                     "(fewer idle connections for a process serving many databases)", 2)
    lease: float = option("seconds a claimed batch is leased; at least twice --publish-timeout", 30.0)
    poll_interval: float = option("fallback poll when no notification comes, seconds", 30.0)
    poll_only: bool = option("no LISTEN and no session locks: poll every --poll-interval (for PgBouncer in "
                             "transaction mode)", False)
    publish_timeout: float = option("seconds a batch has for its publishes (JetStream acks): a run's event still "
                                    "unacked then fails, the rest of its run is released", 10.0)
    name: str = option("worker name recorded in locked_by", default_factory=_default_name)
    summary_interval: float = option("seconds between summary log lines", 60.0)
    # Workers take turns through the advisory lock inside outbox_maintain(): one of many does the work.
    maintenance_interval: float = option("run outbox_maintain() at start and every this many seconds; 0: never "
                                         "(one worker of many does it, under an advisory lock)", 3600.0)
    xmin_check_interval: float = option("look every this many seconds for a session, prepared transaction or "
                                        "replication slot holding back VACUUM (the xmin horizon) longer than "
                                        "outbox_settings.xmin_warn_after, and log the oldest once (event=xmin_held); "
                                        "0: never", 30.0)

    standby_flushed: str = option("publish only events a standby has already flushed (written to its disk), so "
                                  "that an asynchronous failover cannot lose a published event: 'any' (any "
                                  "standby) or a standby's application_name; '' off. The worker's role needs "
                                  "pg_read_all_stats (docs/how-to/failover.md)", "", metavar="any|NAME")

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch size must be at least 1")
        if self.shard and shard_range(self.shard) is None:
            raise ValueError(f"--shard must be I/N with 0 <= I < N <= 64 (0/2, 1/2), got {self.shard!r}")
        if self.shard_group and (self.shard or self.poll_only):
            raise ValueError("--shard-group takes no --shard (it picks its own) and no --poll-only (it holds a "
                             "session lock)")
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if not 0 <= self.report_connections <= 100:
            raise ValueError(f"report connections must be 0 to 100, got {self.report_connections}")
        if self.claim_bytes is not None and self.claim_bytes < 1:
            raise ValueError(f"claim bytes must be at least 1, got {self.claim_bytes}")
        if self.poll_interval <= 0:
            raise ValueError("poll interval must be positive")
        if self.xmin_check_interval < 0:
            raise ValueError("xmin check interval must be 0 (never) or positive")
        if self.publish_timeout <= 0:
            raise ValueError("publish timeout must be positive")
        if self.standby_flushed != self.standby_flushed.strip():
            raise ValueError(f"standby name {self.standby_flushed!r} has leading or trailing blanks")
        if self.lease < 2 * self.publish_timeout:
            # A batch's leases are extended while it is published, but one publish (one event,
            # or a whole NATS batch) is bounded by the publish timeout only: a lease shorter than
            # twice that leaves no room for the extension and the report around it.
            raise ValueError(
                f"lease ({self.lease:g}s) must be at least twice the publish timeout ({self.publish_timeout:g}s): "
                "a batch has to be reported before its lease can expire")
