-- outboxpg 0010: when an idle worker should look again, without any new insert.
--
--   SELECT outbox_next_wakeup();   -- NULL: nothing will become due by itself
--
-- Two things become claimable with time rather than with a NOTIFY: a retry whose backoff
-- ends, and an expired lease (its worker died or hung). This returns the earliest of those
-- moments, so a worker can sleep exactly until then instead of polling.
-- It walks the in-flight events (cheap while idle: only waiting retries, events held back
-- behind an earlier one of their aggregate, and running leases are in flight then).
-- depends: 0005_outbox_claim
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- plpgsql rather than SQL: a SQL function with a SET clause is planned anew on every call.
CREATE FUNCTION outbox_next_wakeup() RETURNS timestamptz
LANGUAGE plpgsql
STABLE
SET search_path FROM CURRENT
-- Statistics taken during a burst say "most rows are pending", and the planner then scans the
-- whole table in parallel (tens of ms). When a worker asks, the pending rows are few: walk the
-- partial indexes.
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
AS $$
BEGIN
    RETURN (SELECT min(CASE WHEN o.state = 'processing' THEN o.locked_until
                            WHEN o.next_attempt_at > now() THEN o.next_attempt_at END)
              FROM outbox o
             WHERE o.in_flow);
END;
$$;

COMMENT ON FUNCTION outbox_next_wakeup() IS
    'Earliest future moment a retry becomes due or a lease expires (NULL if none): how long an idle worker may sleep.';
