-- outboxpg 0014: a worker keeps the leases of a batch while it is still publishing it.
--
--   SELECT outbox_extend(ARRAY[1,2,3], '<lease_token>', '30 seconds');   -- how many it still holds
--
-- A lease ends at locked_until; after that any claim takes the run back (the worker counts as
-- dead or hung) and hands it to another worker, which publishes it again. A publisher that is
-- slow but working (an HTTP hook taking 50 ms an event: 25 s for a batch of 500) must not lose
-- its leases that way. So a worker calls this while a batch is being published, every third of
-- the lease (outboxpg-worker does; docs: README "The worker"), and a lease ends only when its
-- worker stops calling it: the process died or hung, or it lost the database for longer than
-- the rest of the lease. Why this and not "bound each batch by a deadline below the lease and
-- release the rest": a batch publisher cannot always stop in the middle of a run, a deadline
-- throws away work that was going well, and the deadline would have to fit the slowest
-- publisher; extending costs one statement every lease / 3, and only for batches that last
-- that long.
--
-- Fencing, as for outbox_complete: only events still 'processing' under lease_token are
-- extended. An event whose run was reclaimed has another token, or none: it is left alone, and
-- the count returned is lower than asked. The events of a run share their lease token, so the
-- whole run is extended with the rest of the batch, and stays the one run of its aggregate in
-- flight. An expired lease that no claim has taken back yet is extended (the worker is still at
-- it; a late outbox_complete counts too). A lease is never shortened.
-- The heads of the aggregates follow (outbox_refresh_heads, 0005): a head in flight is ready
-- at the end of its run's lease, so no claim looks at the run before the new end.
-- depends: 0006_outbox_report 0012_outbox_privileges
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE FUNCTION outbox_extend(ids bigint[], lease_token uuid, lease interval DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner, like the other functions a worker calls (0012): a worker has no rights on the table.
SECURITY DEFINER
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
    -- From the moment of the call, as a claim's lease runs from the claim.
    t        timestamptz := clock_timestamp();
    extended integer;
    types    text[];
    aggs     text[];
BEGIN
    IF ids IS NULL OR lease_token IS NULL THEN
        RAISE EXCEPTION 'outbox_extend: ids and lease_token must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    lease := coalesce(lease, (SELECT s.default_lease FROM outbox_settings s));
    IF lease <= interval '0' THEN
        RAISE EXCEPTION 'outbox_extend: lease must be positive, got %', lease
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- locked_until is in no index: a HOT update. The row locks taken here make a claim that
    -- reads these events meanwhile skip them (SKIP LOCKED), as it skips events being reported.
    WITH done AS (
        UPDATE outbox o
           SET locked_until = greatest(o.locked_until, t + lease)
         WHERE o.in_flow                -- found by id in outbox_in_flow_idx
           AND o.id = ANY (ids)
           AND o.state = 'processing'
           AND o.lease_token = outbox_extend.lease_token
     RETURNING o.aggregate_type, o.aggregate_id)
    SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO extended, types, aggs FROM done d;
    IF extended > 0 THEN
        PERFORM outbox_refresh_heads(types, aggs);
    END IF;
    RETURN extended;
END;
$$;

COMMENT ON FUNCTION outbox_extend(bigint[], uuid, interval) IS
    'Extend the lease of events still being published to now + lease (NULL: default_lease), never shorter; returns how many were still held by lease_token (the rest changed nothing).';

-- As 0012 does for the other functions: nobody by default, the workers by their group role.
REVOKE EXECUTE ON FUNCTION outbox_extend(bigint[], uuid, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_extend(bigint[], uuid, interval) TO outbox_worker;
