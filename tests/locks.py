"""The advisory locks of outboxpg's SQL, by name, for the tests. The SQL spells the keys out (a
function cannot read Python) and the package never takes them itself;
tests/sql/test_sql_files.py checks that every key the SQL takes or looks for is one of them.

Two-key locks are (classid, objid) in pg_locks, with objsubid = 2; 1868724336 is 'obxp'.
"""

from __future__ import annotations

__all__ = ["AGGREGATE_LOCK_CLASS", "ALL_AGGREGATES_LOCK", "HEADS_WRITER_LOCK_CLASS", "LOCK_CLASS", "MAINTENANCE_LOCK",
           "PRODUCING_LOCK", "WAKEUP_LOCK"]

LOCK_CLASS = 1868724336             # the first key of outboxpg's own two-key locks

# Held (or queued for) by an idle worker through outbox_worker_idle(), on a session of its own:
# producers NOTIFY only while some session holds or waits for it (0003).
WAKEUP_LOCK = (LOCK_CLASS, 1)

# outbox_maintain(): one maintenance run at a time, however many workers call it (0008).
MAINTENANCE_LOCK = (LOCK_CLASS, 2)

# Shared by every transaction that inserts into outbox: "a producing transaction is open" (0013).
PRODUCING_LOCK = (LOCK_CLASS, 3)

# Taken by a producing transaction that wrote too many aggregates to name each one (0013).
ALL_AGGREGATES_LOCK = (LOCK_CLASS, 4)

# (AGGREGATE_LOCK_CLASS, outbox_aggregate_key(aggregate_type, aggregate_id)): a producing
# transaction's lock on each aggregate it wrote (0013); claims look for them in pg_locks.
AGGREGATE_LOCK_CLASS = 1868724337

# (HEADS_WRITER_LOCK_CLASS, its clock in centiseconds modulo 2^32): a transaction that writes
# outbox_heads.ready_at (a claim, a report, a repair) announces since when (0026); the claims
# raise the floor under the due heads no higher than the oldest of them.
HEADS_WRITER_LOCK_CLASS = 1868724338
