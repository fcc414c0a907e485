-- outboxpg schema: a worker reports what became of the events it leased.
--
--   SELECT outbox_complete(ARRAY[1,2,3], '<lease_token>');          -- published: count marked
--   SELECT outbox_fail(4, '<lease_token>', 'broker said no');        -- 'pending' (retry) or 'dead'
--   SELECT outbox_fail(5, '<lease_token>', 'subject refused', true); -- dead at once
--   SELECT outbox_release(ARRAY[6,7], '<lease_token>');              -- back to pending, no attempt counted
--   SELECT outbox_extend(ARRAY[1,2,3], '<lease_token>', '30 seconds');  -- still publishing: keep the leases
--
-- Fencing: each of these changes only events that are still leased under the given token.
-- Once a lease has expired and the event was reclaimed (by any outbox_claim call), its old
-- token matches nothing: a worker that hung past its lease cannot overwrite the newer claim,
-- and the return value says so (a count lower than asked, or NULL from outbox_fail). A late
-- report on an expired lease that nobody reclaimed yet still counts: the work was done.
--
-- Runs: a caller that published only part of a run completes the published prefix, fails the
-- first event that failed, and releases the rest (in any order):
--   SELECT outbox_complete(ARRAY[11,12], '<token>');          -- published
--   SELECT outbox_fail(13, '<token>', 'no ack within 5 s');    -- failed: retried after a backoff
--   SELECT outbox_release(ARRAY[14,15], '<token>');           -- never sent: no attempt counted
-- Each of them then moves the aggregate's head (outbox_refresh_heads): its next claim starts at
-- the first unfinished event, here 13, once its backoff is over.
--
-- A lease ends at locked_until; after that any claim takes the run back (the worker counts as
-- dead or hung) and hands it to another worker, which publishes it again. A publisher that is
-- slow but working (an HTTP hook taking 50 ms an event: 25 s for a batch of 500) must not lose
-- its leases that way: a worker calls outbox_extend every third of the lease while a batch is
-- being published, and a lease ends only when its worker stops calling it (the process died or
-- hung, or it lost the database for longer than the rest of the lease). Extending costs one
-- statement every lease / 3, and only for batches that last that long; a deadline per batch
-- would throw away work that was going well and would have to fit the slowest publisher.
--
-- These run once per batch or event: like outbox_claim they use generic plans and pinned plan
-- shapes.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- Recompute the heads of the given aggregates from their first unfinished event, after a
-- report or a repair changed their events; drop the heads with none left, or park them (a busy
-- aggregate between two events, see 40_claim.sql). Heads are locked in one pass, in key order
-- (the intake's insert locks in the same order), in a statement of their own before the events
-- are looked at: a claim taking in a new event of the aggregate either holds the head's lock
-- first (and the statement after the lock, with a snapshot taken after it, sees the event), or
-- finds the head gone and creates it again.
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
    -- Announce the heads' ready_at this writes; none is below `at` (outbox_heads_floor).
    PERFORM outbox_heads_writing();
    at := clock_timestamp();
    -- Each head looked up by its key (LATERAL), in key order. A join lets the planner
    -- read all of outbox_heads_pkey instead, once ANALYZE has counted few live heads: under a
    -- held snapshot, every dead entry of every head, on every report (seen: 0.5 s a report).
    -- Their ctids: locked, they stay where they are, and the statement below reads them by
    -- ctid (a TID scan) rather than by key once more.
    SELECT array_agg(h.tid) INTO tids
      FROM (SELECT DISTINCT s.t COLLATE "C" AS t, s.i COLLATE "C" AS i
              FROM unnest(types, ids) AS s(t, i)
             ORDER BY 1, 2) s
     CROSS JOIN LATERAL (
           -- The key's entries from the newest down, to the first version this sees (LIMIT 1:
           -- a unique key has one). btree orders the entries of one key by heap position, and
           -- under a held snapshot a new version goes to the newest page: the first entry read
           -- is usually the live version's. The key is written as a range (the same thing in
           -- the "C" collation) so that the planner keeps the order asked for and scans the
           -- index backward; with an equality it would count the order as given.
           SELECT h.ctid AS tid FROM outbox_heads h
            WHERE h.aggregate_type = s.t
              AND h.aggregate_id >= s.i AND h.aggregate_id <= s.i
            ORDER BY h.aggregate_type DESC, h.aggregate_id DESC
            LIMIT 1
              FOR UPDATE) h;
    IF tids IS NULL THEN
        RETURN;
    END IF;
    -- Events not taken in yet may lie below a head_id (see outbox_take_in). The mark, at
    -- most the cursor, rather than a walk of the intake row's versions.
    upto := coalesce(pg_sequence_last_value('outbox_intake_mark'), 0);

    WITH firsts AS MATERIALIZED (
        SELECT h.aggregate_type, h.aggregate_id, h.tid, f.id,
               -- No event left, but the head was leased to the run this reports and has
               -- been moved on to a next event at least 3 times (moves): a busy aggregate between
               -- two events. It is parked for a second instead of dropped; the intake brings it
               -- back (outbox_take_in).
               f.id IS NULL AND h.leased_until IS NOT NULL AND h.leased_until >= at
                   AND h.moves >= 3 AS park,
               CASE
                    -- Its next event is due, and the head came due less than 250 ms ago:
                    -- it keeps its place (its turn), and this update is HOT (only head_id and
                    -- leased_until change, which no index holds). Its turn over, it goes behind.
                    WHEN f.state = 'pending' AND f.next_attempt_at <= at
                         AND h.ready_at <= at AND h.ready_at > at - interval '250 milliseconds'
                         THEN h.ready_at
                    -- Never below `at` (NULL stays NULL: a dead letter holds the head).
                    WHEN f.state = 'pending' THEN greatest(at, f.next_attempt_at)
                    WHEN f.state = 'processing' THEN greatest(at, f.locked_until)
               END AS ready_at
          FROM (SELECT h.aggregate_type, h.aggregate_id, h.head_id, h.moves, h.ready_at, h.leased_until,
                       h.ctid AS tid
                  FROM outbox_heads h
                 WHERE h.ctid = ANY (tids)) h                        -- locked above
          LEFT JOIN LATERAL (
                SELECT o.id, o.state, o.next_attempt_at, o.locked_until
                  FROM outbox o
                 WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                   AND o.unfinished
                   AND o.id >= least(h.head_id, upto + 1)
                 ORDER BY o.id
                 LIMIT 1) f ON true),
    -- By ctid (a TID scan), so that no plan reads all of outbox_heads_pkey; the heads
    -- were locked by the statement before this one.
    dropped AS (
        DELETE FROM outbox_heads h
         WHERE h.ctid = ANY (ARRAY(SELECT f.tid FROM firsts f WHERE f.id IS NULL AND NOT f.park)))
    UPDATE outbox_heads h
       SET head_id  = CASE WHEN f.park
                           -- No event of it is left, and none can come below the mark
                           -- (outbox_intake_mark: every id up to it has committed or never will)
                           THEN greatest(h.head_id, upto + 1)
                           ELSE f.id END,
           leased_until = CASE WHEN f.park THEN at + interval '1 second'
                               ELSE NULL END,          -- its events were looked at
           parked   = f.park,
           moves    = CASE WHEN f.park THEN h.moves ELSE h.moves + 1 END,   -- counted, never reset
           ready_at = CASE WHEN f.park THEN h.ready_at ELSE f.ready_at END   -- see firsts
      FROM firsts f
     WHERE h.ctid = ANY (ARRAY(SELECT f2.tid FROM firsts f2 WHERE f2.id IS NOT NULL OR f2.park))
       AND h.ctid = f.tid
       AND (f.park OR (h.head_id, h.ready_at, h.leased_until, h.parked) IS DISTINCT FROM (f.id, f.ready_at, NULL, false));
END;
$$;

COMMENT ON FUNCTION outbox_refresh_heads(text[], text[]) IS
    'Called by the report and repair functions: recompute (or drop) the heads of the given aggregates from their first unfinished event.';

-- Mark leased events published. created_min and created_max, when given, are the least and the
-- greatest created_at of the events, as the claim returned them: created_at is the partition
-- key, so the update then reads only the partitions that can hold them. Without them it reads
-- every partition (each partition's outbox_in_flow_idx, rows or not), and an install keeps a
-- week of partitions by default. A range that leaves an event out leaves it leased (it is not
-- counted), as a wrong token does; a range cut to milliseconds leaves none out.
CREATE OR REPLACE FUNCTION outbox_complete(ids bigint[], lease_token uuid,
                                           created_min timestamptz DEFAULT NULL,
                                           created_max timestamptz DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: a worker has no rights on the tables.
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
    done  integer;
    lo    bigint;
    hi    bigint;
    -- Parameters of the generic plans below: their partitions are pruned as each call starts.
    -- A millisecond wider on each side, for clients whose time type keeps only milliseconds
    -- (JavaScript's Date, for one): created_at has microseconds.
    since timestamptz := coalesce(created_min - interval '1 millisecond', '-infinity');
    until timestamptz := coalesce(created_max + interval '1 millisecond', 'infinity');
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
               AND o.created_at BETWEEN since AND until
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
               AND o.created_at BETWEEN since AND until
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

COMMENT ON FUNCTION outbox_complete(bigint[], uuid, timestamptz, timestamptz) IS
    'Mark leased events published; returns how many were still held by lease_token (the rest changed nothing). created_min and created_max, the least and greatest created_at of the events, let it read only their partitions.';

-- A failed attempt. The retry waits the backoff (outbox_retry_delay) or, when the destination said
-- how long to wait (an HTTP Retry-After, say), that long if it is longer: up to backoff_cap, so
-- that no answer can park an event for longer than the backoff ever would. Asked to wait, the
-- worker does not come back early to spend another attempt on an answer it already has.
CREATE OR REPLACE FUNCTION outbox_fail(id bigint, lease_token uuid, error text, permanent boolean DEFAULT false,
                                       retry_after interval DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql
-- Runs as its owner: a worker has no rights on the tables.
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
           next_attempt_at = t + greatest(outbox_retry_delay(o.attempts, cfg.backoff_base, cfg.backoff_cap),
                                          -- greatest ignores a NULL; least would not
                                          CASE WHEN retry_after IS NOT NULL THEN least(retry_after, cfg.backoff_cap) END),
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

COMMENT ON FUNCTION outbox_fail(bigint, uuid, text, boolean, interval) IS
    'Record a failed attempt: returns ''pending'' (retry scheduled with backoff, or after retry_after if longer, up to backoff_cap), ''dead'' (permanent or out of attempts), or NULL when lease_token no longer holds the event (nothing changed).';

CREATE OR REPLACE FUNCTION outbox_release(ids bigint[], lease_token uuid) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: a worker has no rights on the tables.
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

-- Fencing as for outbox_complete: only events still 'processing' under lease_token are
-- extended, and the count says how many. The events of a run share their lease token, so the
-- whole run is extended with the rest of the batch, and stays the one run of its aggregate in
-- flight. An expired lease that no claim has taken back yet is extended (the worker is still at
-- it). A lease is never shortened.
CREATE OR REPLACE FUNCTION outbox_extend(ids bigint[], lease_token uuid, lease interval DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: a worker has no rights on the tables.
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

-- A new session's first claim and first report compile their functions and plan each of their
-- statements: 15 to 20 ms of the server's CPU with events waiting, against 2 to 3 ms for the
-- same claim once warm (bench/first_claim.py). Paid where it hurts: a fleet that a burst wakes
-- pays it once per worker in the middle of the burst, and a pool pays it again for every
-- connection it opens or replaces under load. outbox_warm_up() pays it ahead of time: it writes
-- an event of its own, claims, completes what the claim handed out, and then undoes all of it
-- (a subtransaction rolled back). The session keeps the plans, and nothing else stays: no event,
-- no head, no lease, no cursor moved (outbox_intake_mark and the heads' floor are written only
-- with values that stay true after a rollback, as for any claim rolled back). For those few
-- milliseconds it holds what a claim holds (the intake row; the heads it claims, which other
-- claims skip) and what a producer announces (its own event's aggregate, for the commit-order
-- guard), and it uses up two ids. outboxpg-worker calls it on its claims' connection whenever
-- it opens one; other languages call it once on a connection made for claiming, before its
-- first claim. `shard`: the shard the connection's claims will name, so that the shard's own
-- statements are planned too.
CREATE OR REPLACE FUNCTION outbox_warm_up(shard text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
-- Runs as its owner: a worker may not write events.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    ids   bigint[];
    token uuid;
BEGIN
    -- Twice: PL/pgSQL compiles outbox_claim once for the calls that pass a text argument (its
    -- worker or shard, as outboxpg-worker does) and once more for those that pass none
    -- (outbox_claim(50)), since the collation of the call is part of what it compiles for. The
    -- second round plans only outbox_claim's own statements again.
    FOR round IN 1..2 LOOP
        BEGIN
            INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
            VALUES ('outboxpg', 'warm-up', 'outboxpg.warm_up', '{}');
            IF round = 1 THEN
                SELECT array_agg(c.id), (array_agg(c.lease_token))[1] INTO ids, token
                  FROM outbox_claim(50, NULL, 'outbox_warm_up', NULL, shard) c;
            ELSE
                SELECT array_agg(c.id), (array_agg(c.lease_token))[1] INTO ids, token
                  FROM outbox_claim(50) c;
            END IF;
            IF token IS NOT NULL THEN
                PERFORM outbox_complete(ids, token);
            END IF;
            RAISE EXCEPTION USING ERRCODE = 'OBXWU', MESSAGE = 'outbox_warm_up: undone';
        EXCEPTION WHEN SQLSTATE 'OBXWU' THEN
            NULL;   -- the event, its head, the claim and the report are undone; the plans stay
        END;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox_warm_up(text) IS
    'Plan a new session''s claim and report ahead of its first claim: claims and completes an event of its own, then undoes it all. Call once on a connection made for claiming.';
