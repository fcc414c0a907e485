-- Back to 0029: a report looks its heads up by key from the oldest index entry.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- 0029's head refresh.
CREATE OR REPLACE FUNCTION outbox_refresh_heads(types text[], ids text[]) RETURNS void
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
    upto bigint;
    at   timestamptz;
    tids tid[];
BEGIN
    -- 0026: announce the heads' ready_at this writes; none is below `at` (outbox_heads_floor).
    PERFORM outbox_heads_writing();
    at := clock_timestamp();
    -- 0026: each head looked up by its key (LATERAL), in key order. A join let the planner
    -- read all of outbox_heads_pkey instead, once ANALYZE had counted few live heads: under a
    -- held snapshot, every dead entry of every head, on every report (seen: 0.5 s a report).
    -- Their ctids: locked, they stay where they are, and the statement below reads them by
    -- ctid (a TID scan) rather than by key once more.
    SELECT array_agg(h.tid) INTO tids
      FROM (SELECT DISTINCT s.t COLLATE "C" AS t, s.i COLLATE "C" AS i
              FROM unnest(types, ids) AS s(t, i)
             ORDER BY 1, 2) s
     CROSS JOIN LATERAL (
           SELECT h.ctid AS tid FROM outbox_heads h
            WHERE h.aggregate_type = s.t AND h.aggregate_id = s.i
              FOR UPDATE) h;
    IF tids IS NULL THEN
        RETURN;
    END IF;
    -- Events not taken in yet may lie below a head_id (see outbox_take_in). 0027: the mark, at
    -- most the cursor, rather than a walk of the intake row's versions.
    upto := coalesce(pg_sequence_last_value('outbox_intake_mark'), 0);

    WITH firsts AS MATERIALIZED (
        SELECT h.aggregate_type, h.aggregate_id, h.tid, f.id,
               CASE
                    -- 0029: its next event is due, and the head came due less than 250 ms ago:
                    -- it keeps its place (its turn), and this update is HOT (only head_id and
                    -- leased_until change, which no index holds). Its turn over, it goes behind.
                    WHEN f.state = 'pending' AND f.next_attempt_at <= at
                         AND h.ready_at <= at AND h.ready_at > at - interval '250 milliseconds'
                         THEN h.ready_at
                    -- 0026: never below `at` (NULL stays NULL: a dead letter holds the head)
                    WHEN f.state = 'pending' THEN greatest(at, f.next_attempt_at)
                    WHEN f.state = 'processing' THEN greatest(at, f.locked_until)
               END AS ready_at
          FROM (SELECT h.aggregate_type, h.aggregate_id, h.head_id, h.ready_at, h.ctid AS tid
                  FROM outbox_heads h
                 WHERE h.ctid = ANY (tids)) h                        -- 0026: locked above
          LEFT JOIN LATERAL (
                SELECT o.id, o.state, o.next_attempt_at, o.locked_until
                  FROM outbox o
                 WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                   AND o.unfinished
                   AND o.id >= least(h.head_id, upto + 1)
                 ORDER BY o.id
                 LIMIT 1) f ON true),
    -- 0026: by ctid (a TID scan), so that no plan reads all of outbox_heads_pkey; the heads
    -- were locked by the statement before this one.
    dropped AS (
        DELETE FROM outbox_heads h
         WHERE h.ctid = ANY (ARRAY(SELECT f.tid FROM firsts f WHERE f.id IS NULL)))
    UPDATE outbox_heads h
       SET head_id  = f.id,
           leased_until = NULL,                                -- 0028: its events were looked at
           ready_at = f.ready_at                               -- 0029: see firsts
      FROM firsts f
     WHERE h.ctid = ANY (ARRAY(SELECT f2.tid FROM firsts f2 WHERE f2.id IS NOT NULL))
       AND h.ctid = f.tid
       AND (h.head_id, h.ready_at, h.leased_until) IS DISTINCT FROM (f.id, f.ready_at, NULL);
END;
$$;
