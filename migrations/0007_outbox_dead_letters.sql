-- outboxpg 0007: dead letters, for operators.
--
--   SELECT * FROM outbox_dead_letters;                      -- what is dead, and why
--   SELECT outbox_requeue(ARRAY[42]);                       -- try again from attempt 1
--   SELECT outbox_discard(ARRAY[43], 'superseded by #44');   -- give up on it, keeping the reason
--
-- A dead event holds back the later events of its aggregate (order beats liveness for one
-- aggregate) until it is requeued or discarded; other aggregates are not affected.
--
-- Both make events claimable without an insert, so nothing else would wake an idle worker: it
-- would find them only at its fallback poll (30 s by default). They wake idle workers as the
-- insert trigger does (0003): NOTIFY channel 'outbox' while some worker is idle, otherwise take
-- the wakeup lock shared until commit, so a worker about to go idle waits for this transaction
-- and then claims once more.
-- depends: 0002_outbox_table 0003_outbox_wakeup 0005_outbox_claim
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE VIEW outbox_dead_letters AS
SELECT id, aggregate_type, aggregate_id, event_type, subject, attempts, last_error, dead_at, created_at, msg_id
  FROM outbox
 WHERE state = 'dead';

COMMENT ON VIEW outbox_dead_letters IS
    'Dead events (out of attempts or failed permanently), with the last error. Repair with outbox_requeue(ids) or outbox_discard(ids, reason).';

CREATE FUNCTION outbox_requeue(ids bigint[]) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    requeued integer;
    types    text[];
    aggs     text[];
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION 'outbox_requeue: ids must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- last_error is kept: it says why the event died the last time.
    WITH done AS (
        UPDATE outbox o
           SET state = 'pending', attempts = 0, next_attempt_at = clock_timestamp(), dead_at = NULL
         WHERE o.state = 'dead' AND o.id = ANY (ids)
     RETURNING o.aggregate_type, o.aggregate_id)
    SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO requeued, types, aggs FROM done d;
    IF requeued > 0 THEN
        -- The aggregate's head was held (ready_at NULL): it comes due now.
        PERFORM outbox_refresh_heads(types, aggs);
        IF NOT pg_try_advisory_xact_lock_shared(1868724336, 1) THEN   -- as outbox_wake_workers (0003)
            PERFORM pg_notify('outbox', '');
        END IF;
    END IF;
    RETURN requeued;
END;
$$;

COMMENT ON FUNCTION outbox_requeue(bigint[]) IS
    'Send dead events back to pending with attempts reset; returns how many were dead (other ids are left alone).';

CREATE FUNCTION outbox_discard(ids bigint[], reason text) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    discarded integer;
    types     text[];
    aggs      text[];
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION 'outbox_discard: ids must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF reason IS NULL OR reason !~ '[^[:space:]]' THEN  -- blank: empty or only whitespace
        RAISE EXCEPTION 'outbox_discard: a reason is required (it is kept with the event)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Dead events, and pending ones an operator wants out of the way; never a leased one,
    -- whose worker may be publishing it right now.
    WITH done AS (
        UPDATE outbox o
           SET state = 'discarded', discarded_at = clock_timestamp(), discard_reason = left(reason, 8000)
         WHERE o.state IN ('dead', 'pending') AND o.id = ANY (ids)
     RETURNING o.aggregate_type, o.aggregate_id)
    SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO discarded, types, aggs FROM done d;
    IF discarded > 0 THEN
        -- Discarding a head releases the next event of its aggregate.
        PERFORM outbox_refresh_heads(types, aggs);
        IF NOT pg_try_advisory_xact_lock_shared(1868724336, 1) THEN   -- as outbox_wake_workers (0003)
            PERFORM pg_notify('outbox', '');
        END IF;
    END IF;
    RETURN discarded;
END;
$$;

COMMENT ON FUNCTION outbox_discard(bigint[], text) IS
    'Take dead (or pending) events out of the flow for good, keeping the reason; returns how many changed. Leased events are left alone.';
