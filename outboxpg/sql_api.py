"""The SQL API as Python sees it: every ``outbox_*`` function of a fresh install, once.

Each function is listed with its exact argument types (as ``regprocedure`` prints them, which is
what ``to_regprocedure()`` reads), who may call it (the group roles, schema/90_privileges.sql), whether it runs as
its owner (SECURITY DEFINER) and its SET clauses. tests/sql/test_sql_api.py checks the list against
``pg_proc`` of a fresh install, both ways: a change to schema/ that adds a function, drops one or
changes its arguments fails there until the function is listed here. Whatever else needs a list of
signatures takes it from here: the worker's start-up check (``WORKER_CALLS``), the command
line's schema check (``OPERATOR_CALLS``), the privilege and released-schema tests.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SqlFunction", "FUNCTIONS", "WORKER_CALLS", "IDLE_CALLS", "XMIN_CALLS", "OPERATOR_CALLS", "by_signature",
           "PRODUCER", "WORKER", "OPERATOR"]

# The group roles (schema/90_privileges.sql).
PRODUCER, WORKER, OPERATOR = "outbox_producer", "outbox_worker", "outbox_operator"

# SET clauses as pg_proc.proconfig holds them; <schema> stands for the install schema.
PATH = ("search_path=<schema>, pg_temp",)     # SET search_path FROM CURRENT: this schema, pg_temp last
# The claim path's plans, pinned (schema/40_claim.sql, outbox_claim says why each).
PLANNER = ("plan_cache_mode=force_generic_plan", "enable_seqscan=off", "enable_bitmapscan=off",
           "enable_hashjoin=off", "enable_mergejoin=off", "enable_material=off", "jit=off")
# Index lookups of the idle path and the health row (outbox_next_wakeup, outbox_health_row).
LOOKUP = ("enable_seqscan=off", "max_parallel_workers_per_gather=0", "jit=off")


@dataclass(frozen=True)
class SqlFunction:
    name: str
    args: tuple[str, ...] = ()
    callers: frozenset[str] = frozenset()   # group roles granted EXECUTE (nobody else may call it)
    definer: bool = False                   # SECURITY DEFINER: runs as the owner of the schema
    settings: tuple[str, ...] = ()          # its SET clauses
    trigger: bool = False                   # a trigger function: fires, is never called

    @property
    def signature(self) -> str:
        """'outbox_claim(integer,interval,text)': as regprocedure prints it and to_regprocedure reads it."""
        return f"{self.name}({','.join(self.args)})"

    def __str__(self) -> str:
        return self.signature


def _f(name: str, *args: str, callers: tuple[str, ...] = (), definer: bool = False,
       settings: tuple[str, ...] = PATH, trigger: bool = False) -> SqlFunction:
    return SqlFunction(name, args, frozenset(callers), definer, settings, trigger)


# -- what the worker calls (as the owner: a worker has no rights on the tables) -----------------
CLAIM = _f("outbox_claim", "integer", "interval", "text", "bigint", "text", "boolean", callers=(WORKER,), definer=True,
           settings=(*PLANNER, "enable_indexscan=on", *PATH))   # its updates by ctid turn index scans off
COMPLETE = _f("outbox_complete", "bigint[]", "uuid", "timestamp with time zone", "timestamp with time zone",
              callers=(WORKER,), definer=True, settings=(*PLANNER, *PATH))
FAIL = _f("outbox_fail", "bigint", "uuid", "text", "boolean", "interval", callers=(WORKER,), definer=True,
          settings=(*PLANNER, *PATH))
RELEASE = _f("outbox_release", "bigint[]", "uuid", callers=(WORKER,), definer=True, settings=(*PLANNER, *PATH))
EXTEND = _f("outbox_extend", "bigint[]", "uuid", "interval", callers=(WORKER,), definer=True,
            settings=(*PLANNER, *PATH))
# a new claims connection's plans, made ahead of its first claim (then undone)
WARM_UP = _f("outbox_warm_up", "text", callers=(WORKER,), definer=True)
NEXT_WAKEUP = _f("outbox_next_wakeup", "text", callers=(WORKER,), definer=True, settings=(*LOOKUP, *PATH))
# the worker's start-up stream check and outboxpg status --nats-url
UNFINISHED_SUBJECTS = _f("outbox_unfinished_subjects", "integer", callers=(WORKER, OPERATOR), definer=True,
                         settings=("jit=off", *PATH))
# the wakeup protocol: advisory locks and LISTEN only, no table
WORKER_IDLE = _f("outbox_worker_idle", callers=(WORKER,))
WORKER_BUSY = _f("outbox_worker_busy", callers=(WORKER,))
# -- workers and operators ----------------------------------------------------------------------
MAINTAIN = _f("outbox_maintain", "boolean", callers=(WORKER, OPERATOR), definer=True,
              settings=("lock_timeout=1s", *PATH))
HEALTH_ROW = _f("outbox_health_row", callers=(WORKER, OPERATOR), definer=True,   # behind the outbox_health view
                settings=(*LOOKUP, *PATH))
# status, sql/health.sql (reads other roles' sessions in pg_stat_activity)
OPEN_PRODUCERS = _f("outbox_open_producers", callers=(WORKER, OPERATOR), definer=True)
# status: claims left open, which keep every claim from taking new events in
OPEN_CLAIMS = _f("outbox_open_claims", callers=(OPERATOR,), definer=True)
# behind outbox_health's xmin holder columns; the worker's xmin_held log line (reads other
# roles' sessions in pg_stat_activity)
XMIN_HOLDERS = _f("outbox_xmin_holders", callers=(WORKER, OPERATOR), definer=True, settings=("jit=off", *PATH))
# who may create objects in the install schema besides its owners: the worker refuses to start while any may
UNTRUSTED_CREATORS = _f("outbox_untrusted_creators", callers=(WORKER, OPERATOR))
# -- operators: the repairs ---------------------------------------------------------------------
REQUEUE = _f("outbox_requeue", "bigint[]", callers=(OPERATOR,), definer=True)
DISCARD = _f("outbox_discard", "bigint[]", "text", callers=(OPERATOR,), definer=True)
# re-send published events (operators only); the candidates are its dry run
TS = "timestamp with time zone"
REPLAY = _f("outbox_replay", "bigint[]", "text", "text", "text", TS, TS, "boolean", "integer", "boolean",
            callers=(OPERATOR,), definer=True)
REPLAY_CANDIDATES = _f("outbox_replay_candidates", "bigint[]", "text", "text", "text", TS, TS, "boolean",
                       callers=(OPERATOR,), definer=True, settings=("plan_cache_mode=force_custom_plan", *PATH))
# -- producers and operators --------------------------------------------------------------------
CANCEL = _f("outbox_cancel", "bigint[]", callers=(PRODUCER, OPERATOR), definer=True)   # scheduled events
# idempotent enqueue. The insert trigger calls the first as the producer; enqueue the second.
IDEMPOTENCY_EVENT = _f("outbox_idempotency_event", "text", callers=(PRODUCER, OPERATOR), definer=True)
# the worker calls it with outbox_maintain()
IDEMPOTENCY_FORGET = _f("outbox_idempotency_forget", "integer", callers=(WORKER, OPERATOR), definer=True)
# -- inlined SQL functions: schema-qualified or built-ins only, no search_path ------------------
# the insert trigger names each aggregate by it; sql/health.sql matches producers' locks with it
AGGREGATE_KEY = _f("outbox_aggregate_key", "text", "text", callers=(PRODUCER, OPERATOR), settings=())
RETRY_DELAY = _f("outbox_retry_delay", "integer", "interval", "interval", settings=())   # inside claim / fail
# -- shards: which bucket an aggregate is in, which buckets a shard holds; the index they need ----
AGGREGATE_BUCKET = _f("outbox_aggregate_bucket", "text", "text", callers=(WORKER, OPERATOR))
SHARD_BUCKETS = _f("outbox_shard_buckets", "text", callers=(WORKER, OPERATOR))
SHARDS_ENABLE = _f("outbox_shards_enable")      # the schema owner's
SHARDS_DISABLE = _f("outbox_shards_disable")
# -- helpers only the SECURITY DEFINER functions call (PUBLIC's EXECUTE revoked) ----------------
COMMIT_GUARD = _f("outbox_commit_guard")            # inside claim and outbox_health_row
# the filters outbox_replay and outbox_replay_candidates refuse
REPLAY_CHECK = _f("outbox_replay_check", "bigint[]", "text", "text", "text", TS, TS, "boolean")
COMMIT_HORIZON = _f("outbox_commit_horizon")        # inside claim
TAKE_IN = _f("outbox_take_in", "bigint", "bigint", "integer", settings=(*PLANNER, "enable_sort=off", *PATH))
# a claim that found the intake row held and nothing due waits for its holder (1 s at most)
INTAKE_WAIT = _f("outbox_intake_wait", settings=(*PATH, "lock_timeout=1s"))
# where the intake row's version lies, for the next intake (inside outbox_take_in)
INTAKE_REMEMBER = _f("outbox_intake_remember", "tid", settings=PATH)
# who holds the intake row (inside outbox_next_wakeup and outbox_open_claims)
INTAKE_HOLDERS = _f("outbox_intake_holders", settings=PATH)
REFRESH_HEADS = _f("outbox_refresh_heads", "text[]", "text[]",   # inside the report and repair functions
                   settings=(*PLANNER, *PATH))
# the floor under the due heads (inside claim) and the writers' announcement (claim, refresh)
HEADS_FLOOR = _f("outbox_heads_floor", settings=("plan_cache_mode=force_generic_plan", "enable_seqscan=off",
                                                  "enable_bitmapscan=off", "jit=off", *PATH))
HEADS_WRITING = _f("outbox_heads_writing")
# -- triggers: they fire as the role that writes the table, without any EXECUTE grant -----------
WAKE_WORKERS = _f("outbox_wake_workers", trigger=True)        # NOTIFY idle workers
FORGET_DELETED = _f("outbox_forget_deleted", trigger=True)    # rows deleted by hand take their heads along
# the commit-order locks (the aggregate's, and the transaction's horizon) before the event's id
ASSIGN_ID = _f("outbox_assign_id", trigger=True)
# a producer's idempotency key, taken as the owner (producers may not read the keys)
TAKE_IDEMPOTENCY_KEY = _f("outbox_take_idempotency_key", definer=True, trigger=True)

FUNCTIONS: tuple[SqlFunction, ...] = (
    CLAIM, COMPLETE, FAIL, RELEASE, EXTEND, WARM_UP, NEXT_WAKEUP, UNFINISHED_SUBJECTS, WORKER_IDLE, WORKER_BUSY,
    MAINTAIN, HEALTH_ROW, OPEN_PRODUCERS, OPEN_CLAIMS, XMIN_HOLDERS, UNTRUSTED_CREATORS, REQUEUE, DISCARD, REPLAY,
    REPLAY_CANDIDATES, CANCEL, IDEMPOTENCY_EVENT, IDEMPOTENCY_FORGET,
    AGGREGATE_KEY, RETRY_DELAY, AGGREGATE_BUCKET, SHARD_BUCKETS, SHARDS_ENABLE, SHARDS_DISABLE,
    COMMIT_GUARD, REPLAY_CHECK, COMMIT_HORIZON, TAKE_IN, INTAKE_WAIT, INTAKE_REMEMBER, INTAKE_HOLDERS, REFRESH_HEADS,
    HEADS_FLOOR, HEADS_WRITING, WAKE_WORKERS, FORGET_DELETED, ASSIGN_ID, TAKE_IDEMPOTENCY_KEY,
)

# What outboxpg-worker checks at start (exists, and this login may execute it), in this order:
# the first one missing is named. IDLE_CALLS only without --poll-only.
WORKER_CALLS = (CLAIM, COMPLETE, FAIL, RELEASE, EXTEND, WARM_UP, NEXT_WAKEUP, UNFINISHED_SUBJECTS, IDEMPOTENCY_FORGET,
                UNTRUSTED_CREATORS)
IDLE_CALLS = (WORKER_IDLE, WORKER_BUSY)
XMIN_CALLS = (XMIN_HOLDERS,)   # not with --xmin-check-interval 0
# What the outboxpg command line calls (its schema check on a database installed with psql).
OPERATOR_CALLS = (REPLAY, MAINTAIN, DISCARD, REQUEUE)


def by_signature() -> dict[str, SqlFunction]:
    return {f.signature: f for f in FUNCTIONS}
