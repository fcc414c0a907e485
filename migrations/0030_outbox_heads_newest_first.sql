-- outboxpg 0030: a report finds its heads from the newest entry of their key down.
--
-- Why. Under a held snapshot (a REPEATABLE READ transaction or a session idle in a transaction)
-- no row version of outbox_heads made since its snapshot can be removed. A busy aggregate's head
-- is written twice a run (the claim's lease, the report), HOT while its page has room; once the
-- page is full, the next version goes to another page and adds an entry of its key to
-- outbox_heads_pkey, and so does each new head when the head was dropped (its line ran empty)
-- and made again by the intake. Every report locks its aggregates' heads by key (outbox_refresh_heads),
-- and that lookup read every entry of the key from the oldest, and the versions each points at,
-- to find the one live version at the end. Measured with 10 busy aggregates at 2,000 events/s
-- and a snapshot held 120 s (BENCHMARKS.md, seventh session): the lock took 1.74 and 1.95 ms a
-- report in two runs (1,243 and 1,078 buffers), outbox_complete 2.50 and 2.79 ms.
--
-- What. The lookup reads the key's entries from the newest down and stops at the first version
-- its snapshot sees (LIMIT 1: a unique key has one). btree orders the entries of one key by
-- heap position (PostgreSQL 12+), and a new version goes to a page with free space, under a held
-- snapshot the newest page: the first entry read is usually the live version's. That is only
-- where the scan starts; whatever the order, the row found is the same. The key is written as a
-- range (aggregate_id >= i AND aggregate_id <= i: the same thing in the "C" collation of the
-- key) so that the planner keeps the order asked for and scans the index backward; with an
-- equality it would count the order as given and scan forward.
--
-- Left as it was: the intake's INSERT ... ON CONFLICT. It also makes heads anew (an aggregate
-- whose line ran empty had its head dropped), and then no version of the key is live: a look
-- from the newest entry would read all of them, and the insert's uniqueness check again (tried:
-- in one run of the case above the intake's two statements took 1.32 + 0.75 ms a claim, where
-- 0029's insert had taken 1.20 ms in the run before).
-- depends: 0029_outbox_heads_turn
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- 0029's head refresh: the heads locked from the newest entry of their key down (marked 0030).
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
           -- 0030: the key's entries from the newest down, to the first version this sees.
           SELECT h.ctid AS tid FROM outbox_heads h
            WHERE h.aggregate_type = s.t
              AND h.aggregate_id >= s.i AND h.aggregate_id <= s.i
            ORDER BY h.aggregate_type DESC, h.aggregate_id DESC
            LIMIT 1
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
