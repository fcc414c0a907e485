-- outboxpg 0005: handing out events to workers.
--
--   SELECT * FROM outbox_claim(100);                    -- 100 events, default lease
--   SELECT * FROM outbox_claim(100, '2 minutes', 'w1');
--
-- Each call leases up to batch_size due events under one fresh lease_token, which the caller
-- passes back to outbox_complete / outbox_fail / outbox_release. The lease is committed with
-- the caller's statement: claim in its own short transaction, publish outside any transaction.
--
-- Rules kept here:
--   * Exclusive: FOR UPDATE SKIP LOCKED, so concurrent claimers never get the same event and
--     never wait on each other.
--   * Head of line per aggregate: an event is handed out only when no earlier event (lower id)
--     of its (aggregate_type, aggregate_id) is unfinished: pending (including waiting for a
--     retry), processing or dead. So at most one event per aggregate is in flight, and a dead
--     event holds back its own aggregate only. This stays correct under concurrency because an
--     event never goes from finished back to unfinished: a claimer that sees every earlier event
--     finished in its snapshot is right, and one that sees an earlier event unfinished (even one
--     a concurrent claimer is taking) skips the later one.
--   * Commit order: an event is handed out only once no open transaction can still commit an
--     earlier id (outbox_commit_horizon), so "earlier" means earlier in id order AND nothing
--     earlier is still on its way.
--   * Expired leases are reclaimed here, so no separate reaper is needed. An expired lease is a
--     failed attempt (the worker died or hung): retried after a backoff, or dead once
--     max_attempts is reached. The claim finds them where it finds due events, in id order
--     among the in-flight events; no index on the lease columns is needed (see 0002).
--   * A claim is a HOT update (state and lease columns are in no index): it adds no index
--     entries, which is most of what it would otherwise cost.
--
-- batch_size below 1 or NULL is an error; above outbox_settings.max_claim_batch it is clamped.
-- depends: 0002_outbox_table 0004_outbox_retry_delay
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- The largest id that no open transaction can still precede. Producers mark "this transaction
-- may still commit ids above L" with a shared advisory lock keyed -(L + 1), and hold the shared
-- lock (1868724336, 3) while they do (see 0013_outbox_commit_order.sql). Order matters:
--   1. the last id assigned so far: every id assigned later is above it, so nothing that starts
--      inserting from now on can precede an id up to it;
--   2. if no producing transaction is open (the exclusive try-lock succeeds), that id is the
--      horizon; otherwise the lowest L among the open ones bounds it too.
-- outbox_claim calls this before taking the snapshot it claims from: a transaction that commits
-- in between was still counted here, so its events are either visible or above the horizon.
CREATE FUNCTION outbox_commit_horizon() RETURNS bigint
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    last_id bigint;
    lowest  bigint;
BEGIN
    -- On a sequence never used yet, last_value is the next id, not the last one.
    SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END INTO last_id FROM outbox_id_seq;
    IF pg_try_advisory_lock(1868724336, 3) THEN
        PERFORM pg_advisory_unlock(1868724336, 3);
        RETURN last_id;
    END IF;
    SELECT min(-((l.classid::bigint << 32) | l.objid::bigint) - 1)
      INTO lowest
      FROM pg_locks l
     WHERE l.locktype = 'advisory'
       AND l.objsubid = 1                    -- one-bigint keys
       AND l.classid >= 2147483648           -- negative ones: outboxpg's
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND l.pid <> pg_backend_pid();
    RETURN least(last_id, lowest);
END;
$$;

COMMENT ON FUNCTION outbox_commit_horizon() IS
    'Largest outbox id that no open producing transaction can still precede; outbox_claim hands out ids up to it.';

CREATE FUNCTION outbox_claim(batch_size integer, lease interval DEFAULT NULL, worker text DEFAULT NULL)
RETURNS TABLE (
    id             bigint,
    subject        text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb,
    msg_id         text,
    attempts       integer,
    created_at     timestamptz,
    lease_token    uuid,
    locked_until   timestamptz
)
LANGUAGE plpgsql
SET search_path FROM CURRENT
-- Generic plans: a custom plan would re-plan every statement below on each call, over every
-- partition (milliseconds), for plans that do not depend on the arguments.
SET plan_cache_mode = force_generic_plan
-- Pinned plan shape. These run with generic plans (planned once per session), and a plan made
-- while the table was small must not turn into scans of the whole backlog after a burst (seen:
-- seconds per claim until the next ANALYZE). Index probes and nested loops are the right plan
-- at every size here, so the planner is not given the choice.
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    cfg    outbox_settings;
    token  uuid := gen_random_uuid();
    -- The lease runs from the moment of the claim, not from the start of the caller's transaction.
    t      timestamptz := clock_timestamp();
    owner  text;
    n      integer;
    horizon bigint;
    -- The batch, accumulated over the passes of the loop below.
    ids    bigint[] := '{}';
    tids   tid[] := '{}';
    oldest timestamptz;
    newest timestamptz;
    -- One pass.
    pass_ids     bigint[];
    pass_tids    tid[];
    expired_ids  bigint[];
    expired_tids tid[];
    pass_oldest  timestamptz;
    pass_newest  timestamptz;
BEGIN
    IF batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'outbox_claim: batch_size must be 1 or more, got %', coalesce(batch_size::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO STRICT cfg FROM outbox_settings;
    n := least(batch_size, cfg.max_claim_batch);
    lease := coalesce(lease, cfg.default_lease);
    IF lease <= interval '0' THEN
        RAISE EXCEPTION 'outbox_claim: lease must be positive, got %', lease
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    owner := coalesce(worker, nullif(current_setting('application_name'), ''), 'backend ' || pg_backend_pid());

    LOOP
        -- Commit order: see outbox_commit_horizon(). Read before the snapshot of the next statement.
        horizon := outbox_commit_horizon();

        -- Lock the candidates first and update them afterwards by their tuple ids (ctid): a
        -- row locked here stays where it is until this transaction updates it, and fetching
        -- it by ctid costs no index probe at all (joining the update to the candidate query
        -- instead lets the planner hash the whole table). A candidate is a due event or an
        -- expired lease, at the head of its aggregate's line; SKIP LOCKED: one being claimed
        -- or reported right now is left alone.
        SELECT array_agg(c.id) FILTER (WHERE NOT c.expired),
               array_agg(c.ctid) FILTER (WHERE NOT c.expired),
               array_agg(c.id) FILTER (WHERE c.expired),
               array_agg(c.ctid) FILTER (WHERE c.expired),
               min(c.created_at), max(c.created_at)
          INTO pass_ids, pass_tids, expired_ids, expired_tids, pass_oldest, pass_newest
          FROM (SELECT o.id, o.ctid, o.created_at, o.state = 'processing' AS expired
                  FROM outbox o
                 WHERE o.in_flow
                   AND (o.state = 'pending' AND o.next_attempt_at <= t
                        OR o.state = 'processing' AND o.locked_until < t)
                   AND o.id <= horizon
                   AND o.id <> ALL (ids)      -- locked by an earlier pass (empty at first)
                   AND NOT EXISTS (
                         SELECT 1
                           FROM outbox earlier
                          WHERE earlier.aggregate_type = o.aggregate_type
                            AND earlier.aggregate_id = o.aggregate_id
                            AND earlier.id < o.id
                            AND earlier.unfinished)
                 ORDER BY o.id
                 LIMIT n - cardinality(ids)
                   FOR UPDATE SKIP LOCKED) c;
        ids    := ids || pass_ids;            -- || and least/greatest ignore NULLs
        tids   := tids || pass_tids;
        oldest := least(oldest, pass_oldest);
        newest := greatest(newest, pass_newest);
        EXIT WHEN expired_ids IS NULL;

        -- Reclaim the expired leases among them: retried after a backoff, or dead. Their old
        -- token matches nothing from now on (fencing).
        UPDATE outbox o
           SET state           = CASE WHEN o.attempts >= cfg.max_attempts THEN 'dead' ELSE 'pending' END::outbox_state,
               next_attempt_at = t + outbox_retry_delay(o.attempts, cfg.backoff_base, cfg.backoff_cap),
               dead_at         = CASE WHEN o.attempts >= cfg.max_attempts THEN t END,
               last_error      = format('lease expired at %s (held by %s)', o.locked_until, o.locked_by),
               locked_until    = NULL,
               lease_token     = NULL
         WHERE o.ctid = ANY (expired_tids)                -- locked above
           AND (o.id = ANY (expired_ids)) IS TRUE         -- as below
           AND o.created_at BETWEEN pass_oldest AND pass_newest;
        -- Look again for the rest of the batch: a worker's crash must not cost the next claim
        -- its batch (a short claim tells a worker that the backlog is drained).
        EXIT WHEN cardinality(ids) >= n;
    END LOOP;
    IF cardinality(ids) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY
    WITH claimed AS (
        UPDATE outbox o
           SET state        = 'processing',
               attempts     = o.attempts + 1,
               locked_by    = owner,
               claimed_at   = t,
               locked_until = t + lease,
               lease_token  = token
         WHERE o.ctid = ANY (tids)                       -- locked above: still due
           -- A ctid from another partition may name a row here. IS TRUE: a filter, not an
           -- index condition (an index probe per id is what the ctids save).
           AND (o.id = ANY (ids)) IS TRUE
           AND o.created_at BETWEEN oldest AND newest
     RETURNING o.id,
               coalesce(o.subject, cfg.subject_prefix || '.' || o.aggregate_type || '.' || o.event_type),
               -- The columns' domains (0002), as their base types.
               o.aggregate_type::text, o.aggregate_id::text, o.event_type::text, o.payload,
               o.headers::jsonb, o.msg_id::text,
               o.attempts, o.created_at, o.lease_token, o.locked_until
    )
    SELECT * FROM claimed ORDER BY 1;
END;
$$;

COMMENT ON FUNCTION outbox_claim(integer, interval, text) IS
    'Lease up to batch_size due events (one per aggregate, oldest first) under a new lease_token; reclaims the expired leases it meets (a failed attempt each).';
