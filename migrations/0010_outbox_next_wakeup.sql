-- outboxpg 0010: when an idle worker should look again, without any new insert.
--
--   SELECT outbox_next_wakeup();   -- NULL: nothing will become due by itself
--
-- Two things become claimable with time rather than with a NOTIFY: a retry whose backoff
-- ends, and an expired lease (its worker died or hung). Both are the ready_at of an
-- aggregate's head (0005): this returns the earliest one, one index probe, so a worker can
-- sleep exactly until then instead of polling. A head that came due within the last second
-- counts too (it is returned, in the past: claim now): it may have come due between the
-- worker's last claim and this call. Heads the commit-order guard holds back are left out:
-- the producer's commit wakes the workers (0003, 0013), and claiming them now finds nothing.
-- depends: 0005_outbox_claim
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- plpgsql rather than SQL: a SQL function with a SET clause is planned anew on every call.
CREATE FUNCTION outbox_next_wakeup() RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
-- With sequential scans off, any plan with one (outbox_settings, the id sequence) is costed
-- above jit_above_cost: JIT compiled it on every call (8 ms a call here, 84 ms the first).
SET jit = off
AS $$
DECLARE
    g record;
BEGIN
    SELECT * INTO g FROM outbox_commit_guard();
    IF NOT (SELECT s.commit_order_guard FROM outbox_settings s) THEN
        g.settled := g.last_id;
    END IF;
    RETURN (SELECT min(h.ready_at)
              FROM outbox_heads h
             WHERE h.ready_at > now() - interval '1 second'
               AND (h.ready_at > now()
                    OR h.head_id <= g.settled
                    OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys))));
END;
$$;

COMMENT ON FUNCTION outbox_next_wakeup() IS
    'Earliest moment a retry becomes due or a lease expires (NULL if none; in the past if one just came due): how long an idle worker may sleep.';
