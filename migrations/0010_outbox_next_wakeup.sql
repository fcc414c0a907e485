-- outboxpg 0010: when an idle worker should look again, without any new insert.
--
--   SELECT outbox_next_wakeup();   -- NULL: nothing will become due by itself
--
-- Two things become claimable with time rather than with a NOTIFY: a retry whose backoff
-- ends, and an expired lease (its worker died or hung). Both are the ready_at of an
-- aggregate's head (0005): this returns the earliest one still to come, one index probe, so a
-- worker can sleep exactly until then instead of polling. (Heads that are due but held back
-- by an open producing transaction are not in it: the producer's commit wakes the workers,
-- see 0003 and 0013.)
-- depends: 0005_outbox_claim
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- plpgsql rather than SQL: a SQL function with a SET clause is planned anew on every call.
CREATE FUNCTION outbox_next_wakeup() RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
AS $$
BEGIN
    RETURN (SELECT min(h.ready_at) FROM outbox_heads h WHERE h.ready_at > now());
END;
$$;

COMMENT ON FUNCTION outbox_next_wakeup() IS
    'Earliest future moment a retry becomes due or a lease expires (NULL if none): how long an idle worker may sleep.';
