-- outboxpg 0006: a worker reports what became of the events it leased.
--
--   SELECT outbox_complete(ARRAY[1,2,3], '<lease_token>');          -- published: count marked
--   SELECT outbox_fail(4, '<lease_token>', 'broker said no');        -- 'pending' (retry) or 'dead'
--   SELECT outbox_fail(5, '<lease_token>', 'subject refused', true); -- dead at once
--   SELECT outbox_release(ARRAY[6,7], '<lease_token>');              -- back to pending, no attempt counted
--
-- Fencing: each of these changes only events that are still leased under the given token.
-- Once a lease has expired and the event was reclaimed (by any outbox_claim call), its old
-- token matches nothing: a worker that hung past its lease cannot overwrite the newer claim,
-- and the return value says so (a count lower than asked, or NULL from outbox_fail). A late
-- report on an expired lease that nobody reclaimed yet still counts: the work was done.
-- Runs: a caller that published only part of a run completes the published prefix, fails the
-- first event that failed, and releases the rest (in any order):
--   SELECT outbox_complete(ARRAY[11,12], '<token>');          -- published
--   SELECT outbox_fail(13, '<token>', 'no ack within 5 s');    -- failed: retried after a backoff
--   SELECT outbox_release(ARRAY[14,15], '<token>');           -- never sent: no attempt counted
-- Each of them then moves the aggregate's head (outbox_refresh_heads, 0005): its next claim
-- starts at the first unfinished event, here 13, once its backoff is over.
-- These run once per batch or event: like outbox_claim they use generic plans.
-- depends: 0005_outbox_claim
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE FUNCTION outbox_complete(ids bigint[], lease_token uuid) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    done  integer;
    lo    bigint;
    hi    bigint;
    types text[];
    aggs  text[];
BEGIN
    IF ids IS NULL OR lease_token IS NULL THEN
        RAISE EXCEPTION 'outbox_complete: ids and lease_token must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT min(i), max(i) INTO lo, hi FROM unnest(ids) i;
    IF hi - lo < 2 * cardinality(ids) THEN
        -- (Nearly) consecutive ids, as a claim from a backlog hands out: one range scan of
        -- outbox_in_flow_idx per partition, where "id = ANY" probes every partition for every
        -- id. "IS TRUE" keeps the list out of the index condition.
        WITH done AS (
            UPDATE outbox o
               SET state = 'published', published_at = clock_timestamp(), locked_until = NULL
             WHERE o.in_flow
               AND o.id BETWEEN lo AND hi
               AND (o.id = ANY (ids)) IS TRUE
               AND o.state = 'processing'
               AND o.lease_token = outbox_complete.lease_token
         RETURNING o.aggregate_type, o.aggregate_id)
        SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO done, types, aggs FROM done d;
    ELSE
        WITH done AS (
            UPDATE outbox o
               SET state = 'published', published_at = clock_timestamp(), locked_until = NULL
             WHERE o.in_flow                -- found by id in outbox_in_flow_idx
               AND o.id = ANY (ids)
               AND o.state = 'processing'
               AND o.lease_token = outbox_complete.lease_token
         RETURNING o.aggregate_type, o.aggregate_id)
        SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO done, types, aggs FROM done d;
    END IF;
    IF done > 0 THEN
        PERFORM outbox_refresh_heads(types, aggs);
    END IF;
    RETURN done;
END;
$$;

COMMENT ON FUNCTION outbox_complete(bigint[], uuid) IS
    'Mark leased events published; returns how many were still held by lease_token (the rest changed nothing).';

CREATE FUNCTION outbox_fail(id bigint, lease_token uuid, error text, permanent boolean DEFAULT false)
RETURNS text
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    cfg       outbox_settings;
    t         timestamptz := clock_timestamp();
    new_state outbox_state;
    agg_type  text;
    agg_id    text;
BEGIN
    IF id IS NULL OR lease_token IS NULL THEN
        RAISE EXCEPTION 'outbox_fail: id and lease_token must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT * INTO STRICT cfg FROM outbox_settings;
    UPDATE outbox o
       SET state           = CASE WHEN coalesce(permanent, false) OR o.attempts >= cfg.max_attempts
                                  THEN 'dead' ELSE 'pending' END::outbox_state,
           next_attempt_at = t + outbox_retry_delay(o.attempts, cfg.backoff_base, cfg.backoff_cap),
           dead_at         = CASE WHEN coalesce(permanent, false) OR o.attempts >= cfg.max_attempts THEN t END,
           -- Bounded, so that a runaway error text cannot bloat the table.
           last_error      = left(coalesce(error, 'unknown error (outbox_fail was given no text)'), 8000),
           locked_until    = NULL,
           lease_token     = NULL
     WHERE o.in_flow                -- found by id in outbox_in_flow_idx
       AND o.state = 'processing'
       AND o.lease_token = outbox_fail.lease_token
       AND o.id = outbox_fail.id
    RETURNING o.state, o.aggregate_type, o.aggregate_id INTO new_state, agg_type, agg_id;
    -- NULL: the token no longer holds this event's lease; nothing changed.
    IF new_state IS NOT NULL THEN
        PERFORM outbox_refresh_heads(ARRAY[agg_type], ARRAY[agg_id]);
    END IF;
    RETURN new_state::text;
END;
$$;

COMMENT ON FUNCTION outbox_fail(bigint, uuid, text, boolean) IS
    'Record a failed attempt: returns ''pending'' (retry scheduled with backoff), ''dead'' (permanent or out of attempts), or NULL when lease_token no longer holds the event (nothing changed).';

CREATE FUNCTION outbox_release(ids bigint[], lease_token uuid) RETURNS integer
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    released integer;
    types    text[];
    aggs     text[];
BEGIN
    IF ids IS NULL OR lease_token IS NULL THEN
        RAISE EXCEPTION 'outbox_release: ids and lease_token must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    WITH done AS (
        UPDATE outbox o
           SET state           = 'pending',
               -- Handed back unattempted (graceful shutdown, the rest of a run): this lease does not count.
               attempts        = greatest(o.attempts - 1, 0),
               next_attempt_at = clock_timestamp(),
               locked_until    = NULL,
               lease_token     = NULL
         WHERE o.in_flow                -- found by id in outbox_in_flow_idx
           AND o.state = 'processing'
           AND o.lease_token = outbox_release.lease_token
           AND o.id = ANY (ids)
     RETURNING o.aggregate_type, o.aggregate_id)
    SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO released, types, aggs FROM done d;
    IF released > 0 THEN
        PERFORM outbox_refresh_heads(types, aggs);
    END IF;
    RETURN released;
END;
$$;

COMMENT ON FUNCTION outbox_release(bigint[], uuid) IS
    'Hand leased events back unattempted (e.g. on shutdown); returns how many were still held by lease_token.';
