-- outboxpg 0003: waking idle workers, without making busy producers pay for it.
--
-- NOTIFY takes a database-wide lock at COMMIT to keep the notification queue in commit order,
-- so producers that all NOTIFY are serialised on it. Notifications are only useful while some
-- worker is idle, so the trigger NOTIFYs only then. "Some worker is idle" is an advisory lock:
--
--   * A worker about to sleep calls outbox_worker_idle(), which takes the wakeup lock
--     exclusively, at session level. It waits while producers that skipped the NOTIFY are
--     still open; once it returns, all of their events are committed and visible, so the
--     worker claims once more and then sleeps until a notification arrives.
--   * A worker that wakes calls outbox_worker_busy() to let go of the lock, and drains.
--   * The trigger tries to take the lock *shared* until its transaction ends. That fails only
--     while a worker holds it or waits for it: then the trigger NOTIFYs. Otherwise every worker
--     is draining anyway; the shared lock makes the next worker that wants to sleep wait for
--     this transaction's commit, so its events are never missed.
--
-- A worker that never calls outbox_worker_idle() is never notified: it must poll.
-- Channel: 'outbox', empty payload (PostgreSQL folds identical notifications of a transaction
-- into one). The lock is the advisory lock with keys (1868724336, 1); 1868724336 is 'obxp'.
-- depends: 0002_outbox_table
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE FUNCTION outbox_wake_workers() RETURNS trigger
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
CREATE TRIGGER outbox_wake_workers
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_wake_workers();

-- Idempotent: advisory locks count re-acquisitions, and a worker that called this twice and
-- outbox_worker_busy() once must not stay "idle" for the producers.
CREATE FUNCTION outbox_worker_idle() RETURNS void
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
    'Call on a dedicated session before sleeping: from its return until outbox_worker_busy() every insert into outbox NOTIFYs channel outbox. Claim once more after it returns.';

CREATE FUNCTION outbox_worker_busy() RETURNS boolean
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
