-- outboxpg 0013: per-aggregate order in commit order, not only in id order.
--
-- Ids come from a sequence when a row is inserted, not when its transaction commits: a
-- transaction that inserted event 10 of an aggregate can still be open while event 11 of the
-- same aggregate is committed and visible. Without a guard, event 11 would be handed out
-- first and event 10 after it.
--
-- The guard is a horizon. Before each insert statement into outbox, the producer's transaction
-- takes a shared advisory lock (transaction level) keyed by the sequence's current value L: "this
-- transaction may still commit ids above L". outbox_claim reads the smallest such L among open
-- transactions (outbox_commit_horizon(), in 0005_outbox_claim.sql) BEFORE it takes its
-- snapshot, and hands out only ids <= L. An event
-- below the horizon can no longer gain an earlier, still-invisible neighbour; an event above it
-- waits until the transactions below it end.
--
-- Cost: producers pay two advisory locks per insert statement. A claim reads the sequence and
-- tries one lock; only while producing transactions are open does it also read pg_locks. And
-- an open transaction that has inserted into outbox holds back delivery of every newer event
-- (of all aggregates) until it commits or rolls back: keep producing transactions short. A
-- deployment that never writes one aggregate from two concurrent transactions can switch the
-- guard off: UPDATE outbox_settings SET commit_order_guard = false (producers then skip the lock
-- too).
--
-- Lock keys: outboxpg uses the negative half of the one-bigint advisory lock space, -(L + 1),
-- and (1868724336, 3) for "a producer is open".
-- depends: 0005_outbox_claim 0010_outbox_next_wakeup
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

ALTER TABLE outbox_settings ADD COLUMN commit_order_guard boolean NOT NULL DEFAULT true;

CREATE FUNCTION outbox_hold_horizon() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF (SELECT commit_order_guard FROM outbox_settings) THEN
        -- "A producing transaction is open": lets a claim skip reading pg_locks when none is.
        PERFORM pg_advisory_xact_lock_shared(1868724336, 3);
        -- Every id this statement assigns is above L, the last id handed out before it (on a
        -- sequence never used yet, last_value is the next id, not the last one).
        PERFORM pg_advisory_xact_lock_shared(
            -(SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM outbox_id_seq) - 1);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_hold_horizon
    BEFORE INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_hold_horizon();
