-- outboxpg schema: waking idle workers, without making busy producers pay for it.
--
--   LISTEN outbox;                       -- a worker's own session: wakeups arrive here
--   SELECT outbox_worker_idle();         -- before sleeping; then claim once more
--   SELECT outbox_worker_busy();         -- on waking, then drain
--   SELECT outbox_next_wakeup();         -- when something becomes due by itself (NULL: nothing)
--   SELECT outbox_next_wakeup('1/4');    -- the same, for a worker that claims shard 1/4 only
--
-- NOTIFY takes a database-wide lock at COMMIT to keep the notification queue in commit order,
-- so producers that all NOTIFY are serialised on it. Notifications are only useful while some
-- worker is idle, so the trigger NOTIFYs only then. "Some worker is idle" is an advisory lock,
-- (1868724336, 1):
--
--   * A worker about to sleep calls outbox_worker_idle(), which takes the wakeup lock
--     exclusively, at session level. It waits while producers that skipped the NOTIFY are
--     still open; once it returns, all of their events are committed and visible, so the
--     worker claims once more and then sleeps until a notification arrives. One of them may
--     stay open for long while the others commit, so the worker waits with a lock_timeout (a
--     second) and claims once more each time the wait runs out, then queues again.
--   * A worker that wakes calls outbox_worker_busy() to let go of the lock, and drains.
--   * The trigger tries to take the lock *shared* until its transaction ends. That fails only
--     while a worker holds it or waits for it: then the trigger NOTIFYs. Otherwise every worker
--     is draining anyway; the shared lock makes the next worker that wants to sleep wait for
--     this transaction's commit, so its events are never missed.
--
-- A worker that never calls outbox_worker_idle() is never notified: it must poll. Channel:
-- 'outbox', empty payload (PostgreSQL folds identical notifications of a transaction into one).
-- The repairs that make events claimable without an insert (outbox_requeue, outbox_discard)
-- wake idle workers the same way.
--
-- Two things become claimable with time rather than with a NOTIFY: a retry whose backoff ends,
-- and an expired lease (its worker died or hung). Both are times on an aggregate's head:
-- outbox_next_wakeup() returns the earliest, so a worker can sleep exactly until then instead
-- of polling.
--
-- With shards, the worker that holds the wakeup lock claims its own shard only: a worker of
-- another shard queued behind it sleeps until its own shard's next wakeup (or its poll) and
-- claims then, still queued; the notifications reach every listening worker either way.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE OR REPLACE FUNCTION outbox_wake_workers() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock_shared(1868724336, 1) THEN
        PERFORM pg_notify('outbox', '');
    END IF;
    RETURN NULL;
END;
$$;

-- Once per statement (a COPY or a 10,000-row INSERT notifies at most once), after the insert.
CREATE OR REPLACE TRIGGER outbox_wake_workers
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_wake_workers();

-- Idempotent: advisory locks count re-acquisitions, and a worker that called this twice and
-- outbox_worker_busy() once must not stay "idle" for the producers.
CREATE OR REPLACE FUNCTION outbox_worker_idle() RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_locks
                    WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
                      AND classid = 1868724336 AND objid = 1 AND objsubid = 2) THEN
        PERFORM pg_advisory_lock(1868724336, 1);
    END IF;
END;
$$;

COMMENT ON FUNCTION outbox_worker_idle() IS
    'Call on a dedicated session before sleeping: from its return until outbox_worker_busy() every insert into outbox NOTIFYs channel outbox. Claim once more after it returns, and each time a lock_timeout ends its wait (an open producing transaction can hold it back for long).';

CREATE OR REPLACE FUNCTION outbox_worker_busy() RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    held boolean := false;
BEGIN
    -- Every hold this session has, so the lock is free whatever happened before (checked
    -- first: unlocking a lock not held logs a warning).
    WHILE EXISTS (SELECT 1 FROM pg_locks
                   WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted
                     AND classid = 1868724336 AND objid = 1 AND objsubid = 2) LOOP
        PERFORM pg_advisory_unlock(1868724336, 1);
        held := true;
    END LOOP;
    RETURN held;
END;
$$;

COMMENT ON FUNCTION outbox_worker_busy() IS
    'Call on the session that called outbox_worker_idle() when the worker wakes: producers stop notifying while workers drain.';

-- When each head can be claimed: ready_at, or, while a run holds it, leased_until; now while
-- another transaction holds the intake row. A head that came due within the last second counts
-- too (it is returned, in the past: claim now): it may have come due between the worker's last
-- claim and this call. Heads the commit-order guard holds back are left out: the producer's
-- commit wakes the workers, and claiming them now finds nothing. A parked head wakes nobody: its
-- time running out makes nothing due. Index lookups only, pinned like the claim's (a plan made
-- from statistics taken during a burst must not turn into scans of whole partitions later).
CREATE OR REPLACE FUNCTION outbox_next_wakeup(shard text DEFAULT NULL) RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
-- Runs as its owner: a worker has no rights on the tables.
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
SET jit = off
AS $$
DECLARE
    g record;
    floor_at timestamptz := to_timestamp(coalesce(pg_sequence_last_value('outbox_heads_floor_us'), 0) / 1000000.0);
    buckets integer[] := outbox_shard_buckets(shard);     -- NULL: every aggregate
BEGIN
    SELECT * INTO g FROM outbox_commit_guard();
    IF NOT (SELECT s.commit_order_guard FROM outbox_settings s) THEN
        g.settled := g.last_id;
    END IF;
    -- Another transaction holds the intake row: claim now. A claim left open in its transaction
    -- (psql after BEGIN, until the server ends it: outbox_claim) keeps every claim from taking
    -- new events in, and when it ends, nothing announces the events it kept back (their
    -- notification is spent). A claim that finds the row still held and nothing to hand out
    -- waits for it up to a second (outbox_intake_wait): an idle worker claims about once a second
    -- until it ends, not at its poll. Another worker's claim running at this moment costs one
    -- claim more. The row itself is not touched (outbox_intake_holders).
    IF EXISTS (SELECT 1 FROM outbox_intake_holders()) THEN
        RETURN now();
    END IF;
    -- Leased heads sit among the due ones (ready_at passed), at or above the floor: a walk over
    -- the runs in flight, which is short whenever a worker is idle.
    RETURN least(
        (SELECT min(h.ready_at)
           FROM outbox_heads h
          WHERE h.ready_at > now() - interval '1 second'
            AND (buckets IS NULL OR (h.lock_key & 63) = ANY (buckets))
            AND (h.leased_until IS NULL OR h.leased_until <= h.ready_at)
            AND (h.ready_at > now()
                 OR h.head_id <= g.settled
                 OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))),
        (SELECT min(h.leased_until)
           FROM outbox_heads h
          WHERE h.ready_at >= floor_at AND h.ready_at <= now()
            AND (buckets IS NULL OR (h.lock_key & 63) = ANY (buckets))
            AND h.leased_until > h.ready_at
            AND NOT h.parked
            AND h.leased_until > now() - interval '1 second'
            AND (h.leased_until > now()
                 OR h.head_id <= g.settled
                 OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))));
END;
$$;

COMMENT ON FUNCTION outbox_next_wakeup(text) IS
    'Earliest moment a retry becomes due or a lease expires, or now while another transaction holds the intake row (NULL if none; in the past if one just came due): how long an idle worker may sleep. shard ''I/N'': of that shard''s aggregates only.';
