-- outboxpg release schema-2, rolled back: takes a database of release schema-2 back to schema-1.
--
-- Produced by tools/schema_step.py (bin/schema-step) from schema/ and migrations/next/: do not
-- edit it. schema/ holds each object's definition and why; docs/migrations.md says how a
-- release is made. Once released (migrations/RELEASED) it is frozen.
-- depends: 0013_outbox_commit_order 0014_outbox_extend 0015_outbox_subjects
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- Back to the last release, by hand: what the next release added goes, and the tables are put
-- back. The released definitions of the functions, views and triggers follow (tools/schema_step.py).

DROP VIEW outbox_failing;
-- Views that lose columns (CREATE OR REPLACE VIEW cannot drop one): made again below.
DROP VIEW outbox_health;
DROP VIEW outbox_dead_letters;
DROP FUNCTION outbox_xmin_holders();
DROP FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean);
DROP FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz);
DROP FUNCTION outbox_cancel(bigint[]);
DROP FUNCTION outbox_idempotency_take(text, bigint);
DROP FUNCTION outbox_idempotency_event(text);
DROP FUNCTION outbox_idempotency_forget(integer);
DROP FUNCTION outbox_heads_floor();
DROP FUNCTION outbox_heads_writing();
DROP TABLE outbox_idempotency;
DROP SEQUENCE outbox_heads_floor_us;
DROP SEQUENCE outbox_intake_mark;

-- Runs in flight keep their place: their heads are ready when the lease ends, as the release
-- has them. Parked heads have no event left (one that came since is taken in again by the
-- intake, which makes its head anew).
UPDATE outbox_heads SET ready_at = leased_until WHERE leased_until > ready_at;
DELETE FROM outbox_heads WHERE parked;
DROP INDEX outbox_heads_ready_idx;
CREATE INDEX outbox_heads_ready_idx ON outbox_heads (ready_at, head_id) WHERE ready_at IS NOT NULL;
ALTER TABLE outbox_heads SET (fillfactor = 50);
ALTER TABLE outbox_heads DROP COLUMN leased_until, DROP COLUMN opened_id, DROP COLUMN parked, DROP COLUMN moves;

-- A dropped column keeps its grants (and its roles' dependencies on them): revoked first.
REVOKE INSERT (deliver_at, idempotency_key, expires_at) ON outbox FROM outbox_producer;
REVOKE SELECT (deliver_at, idempotency_key, expires_at) ON outbox FROM outbox_operator;
ALTER TABLE outbox DROP COLUMN deliver_at, DROP COLUMN idempotency_key, DROP COLUMN expires_at;
ALTER TABLE outbox_settings DROP COLUMN xmin_warn_after;

COMMENT ON FUNCTION outbox_aggregate_key(text, text) IS
    'Second key of the advisory lock (1868724337, key) a producing transaction holds on each aggregate it wrote (0013). Hash collisions only hold back more, never less.';

-- Take newly committed events into outbox_heads: up to `chunk` in-flow events above the intake
-- cursor, oldest first. Returns the cursor afterwards, or NULL when another claim is taking in
-- right now (one at a time: the others skip it rather than wait).
CREATE OR REPLACE FUNCTION outbox_take_in(settled bigint, last_id bigint, chunk integer) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
-- Group the new events by aggregate in a hash table, not by sorting all of them.
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    upto    bigint;
    types   text[];
    ids     text[];
    firsts  bigint[];
    seen    bigint;
    top     bigint;
BEGIN
    SELECT i.intake_id INTO upto FROM outbox_intake i FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF upto >= last_id THEN
        RETURN upto;
    END IF;

    -- One row per aggregate among the new events, with its first event.
    SELECT array_agg(a.aggregate_type ORDER BY a.aggregate_type, a.aggregate_id),
           array_agg(a.aggregate_id ORDER BY a.aggregate_type, a.aggregate_id),
           array_agg(a.first_id ORDER BY a.aggregate_type, a.aggregate_id),
           sum(a.n), max(a.top)
      INTO types, ids, firsts, seen, top
      FROM (SELECT e.aggregate_type, e.aggregate_id, min(e.id) AS first_id, count(*) AS n, max(e.id) AS top
              FROM (SELECT o.id, o.aggregate_type, o.aggregate_id
                      FROM outbox o
                     WHERE o.in_flow
                       AND o.id > upto AND o.id <= last_id
                     ORDER BY o.id
                     LIMIT chunk) e
             GROUP BY e.aggregate_type, e.aggregate_id) a;

    IF types IS NOT NULL THEN
        -- New heads are inserted; a head that exists is locked (in key order, as reports lock
        -- them), so that a report about to drop it because it saw no more events of its
        -- aggregate waits for this transaction and then sees these events
        -- (outbox_refresh_heads). An event that committed late below its aggregate's head (it
        -- was held back by the commit-order guard meanwhile) moves the head back to it.
        -- A new head is due now, whatever this statement's snapshot said of its event: while
        -- the cursor is held back, events read here may have been claimed, or even published
        -- and their head dropped, since (a run reads its aggregate's line beyond the cursor).
        -- The claim that takes the head finds the truth (a lease running: it waits for its end;
        -- no event left: the head is dropped).
        INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at)
        SELECT s.t, s.i, outbox_aggregate_key(s.t, s.i), s.f, now()   -- not after the claim's own time
          FROM unnest(types, ids, firsts) AS s(t, i, f)
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
           SET head_id = excluded.head_id
         WHERE h.head_id > excluded.head_id;
    END IF;

    -- Past everything read (all of it when fewer than chunk came back), never past the horizon.
    top := least(CASE WHEN coalesce(seen, 0) < chunk THEN last_id ELSE top END, settled);
    IF top > upto THEN
        UPDATE outbox_intake SET intake_id = top;
        upto := top;
    END IF;
    RETURN upto;
END;
$$;

-- Recompute the heads of the given aggregates from their first unfinished event, after a
-- report or a repair changed their events; drop the heads with none left. A head is dropped
-- only under FOR UPDATE, taken in a statement of its own before the events are looked at:
-- a claim taking in a new event of the aggregate either holds its KEY SHARE lock first (and
-- this statement, with a snapshot taken after it, sees the event), or finds the head gone and
-- creates it again.
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
BEGIN
    PERFORM 1
       FROM (SELECT DISTINCT s.t, s.i FROM unnest(types, ids) AS s(t, i)) s
       JOIN outbox_heads h ON h.aggregate_type = s.t COLLATE "C" AND h.aggregate_id = s.i COLLATE "C"
      ORDER BY h.aggregate_type, h.aggregate_id
        FOR UPDATE OF h;
    -- Events not taken in yet may lie below a head_id (see outbox_take_in).
    SELECT i.intake_id INTO upto FROM outbox_intake i;

    WITH firsts AS MATERIALIZED (
        SELECT h.aggregate_type, h.aggregate_id, f.id, f.state, f.next_attempt_at, f.locked_until
          FROM (SELECT DISTINCT s.t, s.i FROM unnest(types, ids) AS s(t, i)) s
          JOIN outbox_heads h ON h.aggregate_type = s.t COLLATE "C" AND h.aggregate_id = s.i COLLATE "C"
          LEFT JOIN LATERAL (
                SELECT o.id, o.state, o.next_attempt_at, o.locked_until
                  FROM outbox o
                 WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                   AND o.unfinished
                   AND o.id >= least(h.head_id, upto + 1)
                 ORDER BY o.id
                 LIMIT 1) f ON true),
    dropped AS (
        DELETE FROM outbox_heads h
         USING firsts f
         WHERE f.id IS NULL
           AND h.aggregate_type = f.aggregate_type AND h.aggregate_id = f.aggregate_id)
    UPDATE outbox_heads h
       SET head_id  = f.id,
           ready_at = CASE f.state WHEN 'pending' THEN f.next_attempt_at
                                   WHEN 'processing' THEN f.locked_until END
      FROM firsts f
     WHERE f.id IS NOT NULL
       AND h.aggregate_type = f.aggregate_type AND h.aggregate_id = f.aggregate_id
       AND (h.head_id, h.ready_at) IS DISTINCT FROM
           (f.id, CASE f.state WHEN 'pending' THEN f.next_attempt_at WHEN 'processing' THEN f.locked_until END);
END;
$$;

CREATE OR REPLACE FUNCTION outbox_claim(batch_size integer, lease interval DEFAULT NULL, worker text DEFAULT NULL)
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
-- at every size here (a hash join would read all of outbox_heads), so the planner is not given
-- the choice.
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    cfg     outbox_settings;
    token   uuid := gen_random_uuid();
    -- The lease runs from the moment of the claim, not from the start of the caller's transaction.
    t       timestamptz := clock_timestamp();
    owner   text;
    n       integer;
    g       record;
    upto    bigint;
    took_in boolean;
    remaining  integer;
    empty_types text[] := '{}';
    empty_ids   text[] := '{}';
    pass_empty_types text[];
    pass_empty_ids   text[];
    seen_heads bigint;
    -- What to do with the events read (parallel arrays).
    c_ids   bigint[] := '{}';
    c_tids  tid[] := '{}';
    pass_ids  bigint[];
    pass_tids tid[];
    pass_lo   timestamptz;
    pass_hi   timestamptz;
    r_ids   bigint[];
    r_tids  tid[];
    r_first boolean[];
    r_retry timestamptz[];
    lo      timestamptz;
    hi      timestamptz;
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

    -- Commit order: read before the snapshots of the statements below.
    SELECT * INTO g FROM outbox_commit_guard();
    upto := outbox_take_in(g.settled, g.last_id, least(greatest(2 * n, 500), 10000));
    IF NOT cfg.commit_order_guard THEN
        -- Switched off (0013): whatever is visible, in id order per aggregate.
        g.settled := g.last_id;
        g.open_below := g.last_id;
        g.held_keys := '{}';
    END IF;
    took_in := upto IS NOT NULL;
    IF NOT took_in THEN
        SELECT i.intake_id INTO upto FROM outbox_intake i;
    END IF;

    -- Passes: a pass that reclaimed expired runs looks again for the rest of the batch, so a
    -- worker's crash does not cost the next claim its batch (a short claim tells a worker that
    -- nothing more is claimable right now).
    FOR pass IN 1..8 LOOP
        remaining := n - cardinality(c_ids);
        -- One statement a pass. `cand`: the heads whose time has come, oldest first, leaving out
        -- those the guard holds back (head_id is a lower bound of the first event's id; each
        -- event is checked below), each with its line: its first max_run unfinished events, read
        -- twice, as they are (`line`) and locked, SKIP LOCKED (`e`). An event someone else is
        -- changing right now is missing from the second read, and the run ends before it
        -- (`matched`). The nested loop is lazy: it stops after `remaining` events, so heads and
        -- events past them are neither read nor locked.
        WITH cand AS MATERIALIZED (
            SELECT h.aggregate_type, h.aggregate_id, h.head_id AS old_head_id, h.ready_at AS old_ready,
                   h.lock_key, line.ids AS line_ids,
                   e.id, e.ctid, e.created_at, e.state, e.attempts, e.next_attempt_at, e.locked_until, e.lease_token
              FROM (SELECT h.aggregate_type, h.aggregate_id, h.lock_key, h.head_id, h.ready_at
                      FROM outbox_heads h
                     WHERE h.ready_at <= t
                       AND (h.head_id <= g.settled
                            OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))
                     ORDER BY h.ready_at, h.head_id
                     LIMIT remaining
                       FOR NO KEY UPDATE SKIP LOCKED) h
             CROSS JOIN LATERAL (
                   SELECT array(SELECT o.id FROM outbox o
                                 WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                                   AND o.unfinished AND o.id >= least(h.head_id, upto + 1)
                                 ORDER BY o.id LIMIT least(cfg.max_run, remaining)) AS ids
                    OFFSET 0) line   -- once per head, not once per row of the join below
              LEFT JOIN LATERAL (
                   SELECT o.id, o.ctid, o.created_at, o.state, o.attempts, o.next_attempt_at, o.locked_until,
                          o.lease_token
                     FROM outbox o
                    WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                      AND o.unfinished AND o.id >= least(h.head_id, upto + 1)
                    ORDER BY o.id
                    LIMIT least(cfg.max_run, remaining)
                      FOR UPDATE SKIP LOCKED) e ON true
             LIMIT remaining),
        numbered AS (
            SELECT c.*, row_number() OVER w AS rn, c.id = c.line_ids[row_number() OVER w] AS matched
              FROM cand c
            WINDOW w AS (PARTITION BY c.old_head_id ORDER BY c.id)),
        marked AS MATERIALIZED (
            SELECT m.*,
                   first_value(m.state) OVER w AS first_state,
                   first_value(m.lease_token) OVER w AS first_token,
                   first_value(m.locked_until) OVER w AS first_until,
                   first_value(m.matched) OVER w AS first_matched,
                   -- The run: the prefix of events that are pending, due and not held back.
                   bool_and(m.matched AND m.state = 'pending' AND m.next_attempt_at <= t
                            AND (m.id <= g.settled
                                 OR (m.id <= g.open_below AND m.lock_key <> ALL (g.held_keys)))) OVER w AS in_run,
                   -- A run whose lease ran out: its first event's retry (random jitter, drawn once).
                   CASE WHEN m.rn = 1 AND m.matched AND m.state = 'processing' AND m.locked_until < t
                        THEN t + outbox_retry_delay(m.attempts, cfg.backoff_base, cfg.backoff_cap) END AS retry_at
              FROM numbered m
            WINDOW w AS (PARTITION BY m.old_head_id ORDER BY m.id)),
        -- The events still leased under an expired run's token go back.
        expired AS MATERIALIZED (
            SELECT m.id, m.ctid, m.created_at, m.rn = 1 AS is_first,
                   CASE WHEN m.rn = 1 AND m.attempts < cfg.max_attempts THEN m.retry_at END AS retry_at
              FROM marked m
             WHERE m.first_state = 'processing' AND m.first_until < t AND m.first_matched
               AND m.matched AND m.state = 'processing' AND m.lease_token = m.first_token),
        -- What each head becomes: read off its first row.
        head_next AS (
            SELECT m.aggregate_type, m.aggregate_id, m.old_head_id, m.old_ready,
                   cardinality(m.line_ids) AS line_length,
                   -- Moved up only to a run's first event: that one passed the guard, so no
                   -- earlier event of its aggregate can still appear. Any other event read here
                   -- may have a late-committing predecessor this snapshot cannot see, which the
                   -- intake is about to move the head back to.
                   CASE WHEN m.in_run THEN m.id ELSE m.old_head_id END AS new_head_id,
                   CASE WHEN m.in_run THEN t + lease
                        WHEN m.retry_at IS NOT NULL
                             THEN CASE WHEN m.attempts >= cfg.max_attempts THEN NULL ELSE m.retry_at END
                        -- No unfinished event seen (a head the intake made from an old view):
                        -- dropped below by outbox_refresh_heads, which looks again first.
                        WHEN cardinality(m.line_ids) = 0 THEN m.old_ready
                        WHEN m.id IS NULL OR NOT m.matched THEN m.old_ready  -- being reported right now
                        WHEN m.state = 'dead' THEN NULL
                        WHEN m.state = 'pending' AND m.next_attempt_at > t THEN m.next_attempt_at
                        WHEN m.state = 'processing' AND m.locked_until >= t THEN m.locked_until
                        ELSE m.old_ready                               -- held back by the guard
                   END AS new_ready
              FROM marked m
             WHERE m.rn = 1),
        moved_heads AS (
            UPDATE outbox_heads oh
               SET head_id = hn.new_head_id,
                   ready_at = hn.new_ready
              FROM head_next hn
             WHERE oh.aggregate_type = hn.aggregate_type AND oh.aggregate_id = hn.aggregate_id
               AND (hn.old_head_id, hn.old_ready) IS DISTINCT FROM (hn.new_head_id, hn.new_ready))
        SELECT (SELECT array_agg(m.id ORDER BY m.id) FROM marked m WHERE m.in_run),
               (SELECT array_agg(m.ctid ORDER BY m.id) FROM marked m WHERE m.in_run),
               (SELECT array_agg(x.id ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.ctid ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.is_first ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.retry_at ORDER BY x.id) FROM expired x),
               (SELECT count(*) FROM head_next),
               (SELECT array_agg(hn.aggregate_type) FROM head_next hn WHERE hn.line_length = 0),
               (SELECT array_agg(hn.aggregate_id) FROM head_next hn WHERE hn.line_length = 0),
               (SELECT min(m.created_at) FROM marked m WHERE m.in_run OR m.id IN (SELECT x.id FROM expired x)),
               (SELECT max(m.created_at) FROM marked m WHERE m.in_run OR m.id IN (SELECT x.id FROM expired x))
          INTO pass_ids, pass_tids, r_ids, r_tids, r_first, r_retry, seen_heads, pass_empty_types,
               pass_empty_ids, pass_lo, pass_hi;
        empty_types := empty_types || pass_empty_types;
        empty_ids := empty_ids || pass_empty_ids;
        EXIT WHEN seen_heads = 0;
        c_ids  := c_ids || pass_ids;          -- || and least/greatest ignore NULLs
        c_tids := c_tids || pass_tids;
        lo := least(lo, pass_lo);
        hi := greatest(hi, pass_hi);

        IF r_ids IS NOT NULL THEN
            -- Reclaim expired runs: the first event failed an attempt (retried after a backoff,
            -- or dead: retry_at NULL), the rest go back unattempted. Their old token matches
            -- nothing from now on (fencing). The heads were moved above, to the retry time.
            UPDATE outbox o
               SET state           = CASE WHEN NOT r.is_first THEN 'pending'
                                          WHEN r.retry_at IS NULL THEN 'dead' ELSE 'pending' END::outbox_state,
                   attempts        = CASE WHEN r.is_first THEN o.attempts ELSE greatest(o.attempts - 1, 0) END,
                   next_attempt_at = CASE WHEN r.is_first THEN coalesce(r.retry_at, t) ELSE t END,
                   dead_at         = CASE WHEN r.is_first AND r.retry_at IS NULL THEN t END,
                   last_error      = CASE WHEN r.is_first
                                          THEN format('lease expired at %s (held by %s)', o.locked_until, o.locked_by)
                                          ELSE o.last_error END,
                   locked_until    = NULL,
                   lease_token     = NULL
              FROM unnest(r_ids, r_first, r_retry) AS r(id, is_first, retry_at)
             WHERE o.ctid = ANY (r_tids)                -- locked above
               AND (o.id = ANY (r_ids)) IS TRUE         -- a ctid from another partition may name a row here
               AND o.created_at BETWEEN pass_lo AND pass_hi
               AND o.id = r.id;
        END IF;
        EXIT WHEN r_ids IS NULL OR cardinality(c_ids) >= n;
    END LOOP;

    IF cardinality(empty_types) > 0 THEN
        -- Heads with no unfinished event in sight: dropped, or set right, under the protocol
        -- that keeps a new event from losing its head (the claim holds them already).
        PERFORM outbox_refresh_heads(empty_types, empty_ids);
    END IF;
    IF took_in THEN
        -- Monitors ask "is a worker claiming?": to the second, so that a busy worker does not
        -- write this row on every claim.
        UPDATE outbox_intake SET last_claim_at = t
         WHERE last_claim_at IS NULL OR last_claim_at < t - interval '1 second';
    END IF;
    IF cardinality(c_ids) = 0 THEN
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
         WHERE o.ctid = ANY (c_tids)                     -- locked above: still due
           -- A ctid from another partition may name a row here. IS TRUE: a filter, not an
           -- index condition (an index probe per id is what the ctids save).
           AND (o.id = ANY (c_ids)) IS TRUE
           AND o.created_at BETWEEN lo AND hi
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
ALTER FUNCTION outbox_claim(integer, interval, text) SECURITY DEFINER;

CREATE OR REPLACE VIEW outbox_dead_letters AS
SELECT id, aggregate_type, aggregate_id, event_type, subject, attempts, last_error, dead_at, created_at, msg_id
  FROM outbox
 WHERE state = 'dead';

COMMENT ON VIEW outbox_dead_letters IS
    'Dead events (out of attempts or failed permanently), with the last error. Repair with outbox_requeue(ids) or outbox_discard(ids, reason).';

CREATE OR REPLACE FUNCTION outbox_requeue(ids bigint[]) RETURNS integer
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
ALTER FUNCTION outbox_requeue(bigint[]) SECURITY DEFINER;

CREATE OR REPLACE FUNCTION outbox_discard(ids bigint[], reason text) RETURNS integer
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
ALTER FUNCTION outbox_discard(bigint[], text) SECURITY DEFINER;

CREATE OR REPLACE FUNCTION outbox_maintain(dry_run boolean DEFAULT false)
RETURNS TABLE (action text, partition text, range_start timestamptz, range_end timestamptz, detail text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
-- Scopes the lock_timeout set below (from outbox_settings) to this call: without a SET clause
-- of its own it would last for the rest of the caller's transaction.
SET lock_timeout = '1s'
AS $$
#variable_conflict use_column
DECLARE
    cfg        outbox_settings;
    t          timestamptz := clock_timestamp();
    origin     constant timestamptz := '2000-01-01 00:00:00+00';
    width      interval;
    lo         timestamptz;
    hi         timestamptz;
    edge       timestamptz;
    name       text;
    stray      bigint;
    unfinished bigint;
    p          record;
    -- New partitions get outbox_default's storage parameters (its fillfactor, see 0002).
    storage    text;
    -- Every column but the generated ones, which are computed, never copied.
    columns    text;
BEGIN
    SELECT * INTO STRICT cfg FROM outbox_settings;
    width := cfg.partition_width;
    SELECT coalesce(' WITH (' || array_to_string(c.reloptions, ', ') || ')', '')
      INTO storage FROM pg_class c WHERE c.oid = 'outbox_default'::regclass;
    SELECT string_agg(quote_ident(a.attname), ', ' ORDER BY a.attnum)
      INTO columns FROM pg_attribute a
     WHERE a.attrelid = 'outbox'::regclass AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = '';

    -- One maintainer at a time: every worker runs this on a schedule. A dry run changes nothing
    -- and does not take the lock, so an operator's look never makes a scheduled run skip.
    IF NOT dry_run AND NOT pg_try_advisory_xact_lock(1868724336, 2) THEN
        RETURN QUERY SELECT 'skip', NULL::text, NULL::timestamptz, NULL::timestamptz,
                            'another outbox_maintain() is running';
        RETURN;
    END IF;

    -- A DDL lock request that has to wait makes every claim and insert queue behind it: wait at
    -- most maintenance_lock_timeout, then skip that partition until the next run.
    PERFORM set_config('lock_timeout',
                       (extract(epoch FROM cfg.maintenance_lock_timeout) * 1000)::bigint::text, true);

    -- 1. Create: the current range, partitions_ahead ranges beyond it, and the range of every
    --    row that fell into the default partition.
    FOR lo IN
        SELECT b FROM generate_series(date_bin(width, t, origin),
                                      date_bin(width, t, origin) + width * cfg.partitions_ahead,
                                      width) AS b
        UNION
        SELECT DISTINCT date_bin(width, d.created_at, origin) FROM outbox_default d
        ORDER BY 1
    LOOP
        hi := lo + width;
        -- Fit between existing partitions (partition_width may have changed since they were made):
        -- step past every partition that covers lo (the end of one can be the start of the next),
        -- then stop at the start of the next one.
        LOOP
            SELECT max(ep.range_end) INTO edge FROM outbox_partitions ep
             WHERE NOT ep.is_default AND ep.range_start <= lo AND ep.range_end > lo;
            EXIT WHEN edge IS NULL OR lo >= hi;
            lo := edge;
        END LOOP;
        SELECT min(ep.range_start) INTO edge FROM outbox_partitions ep
         WHERE NOT ep.is_default AND ep.range_start > lo AND ep.range_start < hi;
        hi := coalesce(edge, hi);
        CONTINUE WHEN lo >= hi;

        name := 'outbox_p' || to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"T"HH24MISS');
        SELECT count(*) INTO stray FROM outbox_default d WHERE d.created_at >= lo AND d.created_at < hi;
        IF dry_run THEN
            RETURN QUERY SELECT 'create', name, lo, hi,
                                CASE WHEN stray > 0 THEN format('would move %s rows from outbox_default', stray) END;
            CONTINUE;
        END IF;
        BEGIN
            IF stray = 0 THEN
                EXECUTE format('CREATE TABLE %I PARTITION OF outbox FOR VALUES FROM (%L) TO (%L)', name, lo, hi) || storage;
            ELSE
                -- Rows already in the default partition would violate the new partition's range:
                -- move them into a fresh table first, then attach it.
                LOCK TABLE outbox_default IN ACCESS EXCLUSIVE MODE;
                EXECUTE format('CREATE TABLE %I (LIKE outbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED)',
                               name) || storage;
                EXECUTE format('WITH moved AS (DELETE FROM outbox_default WHERE created_at >= %L AND created_at < %L RETURNING *)
                                INSERT INTO %I (%s) SELECT %s FROM moved', lo, hi, name, columns, columns);
                GET DIAGNOSTICS stray = ROW_COUNT;
                EXECUTE format('ALTER TABLE outbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', name, lo, hi);
            END IF;
            RETURN QUERY SELECT 'create', name, lo, hi,
                                CASE WHEN stray > 0 THEN format('moved %s rows from outbox_default', stray) END;
        EXCEPTION
            WHEN lock_not_available THEN
                RETURN QUERY SELECT 'skip', name, lo, hi, 'lock not granted within maintenance_lock_timeout; next run';
            WHEN check_violation THEN
                RETURN QUERY SELECT 'skip', name, lo, hi, 'rows arrived in outbox_default meanwhile; next run moves them';
        END;
    END LOOP;

    -- 2. Drop: partitions whose whole range is past retention and hold only finished events.
    FOR p IN
        SELECT * FROM outbox_partitions ep
         WHERE NOT ep.is_default AND ep.range_end <= t - cfg.retention
         ORDER BY ep.range_start
    LOOP
        BEGIN
            IF NOT dry_run THEN
                -- Parent first, then the partition: the order every query on outbox takes them,
                -- and the order DROP TABLE would take them anyway. Holding both, nothing can
                -- change the partition between the check below and the drop.
                LOCK TABLE ONLY outbox IN ACCESS EXCLUSIVE MODE;
                EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE', p.partition);
            END IF;
            EXECUTE format('SELECT count(*) FROM %I WHERE unfinished',
                           p.partition) INTO unfinished;
            IF unfinished > 0 THEN
                RETURN QUERY SELECT 'keep', p.partition, p.range_start, p.range_end,
                                    format('%s unfinished events (pending, leased or dead)', unfinished);
            ELSE
                IF NOT dry_run THEN
                    EXECUTE format('DROP TABLE %I', p.partition);
                END IF;
                RETURN QUERY SELECT 'drop', p.partition, p.range_start, p.range_end,
                                    format('%s freed', p.total_size);
            END IF;
        EXCEPTION
            WHEN lock_not_available THEN
                RETURN QUERY SELECT 'skip', p.partition, p.range_start, p.range_end,
                                    'lock not granted within maintenance_lock_timeout; next run';
        END;
    END LOOP;
END;
$$;
ALTER FUNCTION outbox_maintain(boolean) SECURITY DEFINER;

-- plpgsql rather than SQL: a SQL function with a SET clause is planned anew on every call.
CREATE OR REPLACE FUNCTION outbox_next_wakeup() RETURNS timestamptz
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
ALTER FUNCTION outbox_next_wakeup() SECURITY DEFINER;

CREATE OR REPLACE VIEW outbox_health AS
SELECT * FROM outbox_health_row();

COMMENT ON VIEW outbox_health IS
    'One row, cheap (reads unfinished events, the intake row and the lock table, never the bulk of published ones): backlog, oldest pending age, dead letters, expired leases, last claim and whether a worker claimed within the last minute, open producing transactions and what they hold back.';

COMMENT ON COLUMN outbox_health.backlog IS 'Events pending (incl. waiting for a retry or held back) or leased.';

COMMENT ON COLUMN outbox_health.oldest_pending_age IS 'now() - created_at of the oldest pending or leased event; NULL when there is none.';

COMMENT ON COLUMN outbox_health.dead IS 'Dead letters: each holds back the later events of its aggregate until requeued or discarded.';

COMMENT ON COLUMN outbox_health.expired_leases IS 'Leases past locked_until (worker died or hung); the next outbox_claim() retries them.';

COMMENT ON COLUMN outbox_health.last_claim_at IS 'When a worker last called outbox_claim (outbox_intake, to the second), whatever it found; NULL: never.';

COMMENT ON COLUMN outbox_health.worker_claimed_last_minute IS 'last_claim_at within the last minute. With a backlog, false means no worker is claiming.';

COMMENT ON COLUMN outbox_health.open_producers IS 'Open transactions that have inserted into outbox (outbox_open_producers()).';

COMMENT ON COLUMN outbox_health.oldest_producer_pid IS 'Backend pid of the producing transaction open longest; NULL when none is open.';

COMMENT ON COLUMN outbox_health.oldest_producer_age IS 'How long that transaction has been open; NULL when none is, or when the owner may not see its session.';

COMMENT ON COLUMN outbox_health.held_by_open_transactions IS 'Pending events the commit-order guard holds back until open producing transactions end.';

CREATE OR REPLACE FUNCTION outbox_hold_horizon() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    cfg outbox_settings;
BEGIN
    SELECT * INTO cfg FROM outbox_settings;
    -- Taken with the guard off too: the claims' intake cursor (0005) must not pass ids that an
    -- open transaction may still commit, or their events would never be taken in.
    -- "A producing transaction is open": lets a claim skip reading pg_locks when none is.
    PERFORM pg_advisory_xact_lock_shared(1868724336, 3);
    -- Every id this statement assigns is above L, the last id handed out before it (on a
    -- sequence never used yet, last_value is the next id, not the last one).
    PERFORM pg_advisory_xact_lock_shared(
        -(SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM outbox_id_seq) - 1);
    IF cfg.commit_order_guard THEN
        -- For outbox_assign_id, row by row: how many aggregates to name (a transaction-local setting).
        PERFORM set_config('outboxpg.name_aggregates', cfg.commit_order_max_aggregates::text, true);
    ELSE
        PERFORM set_config('outboxpg.name_aggregates', 'off', true);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER outbox_hold_horizon
    BEFORE INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_hold_horizon();

-- The id, assigned after the aggregate's lock. outboxpg.held_aggregates lists the keys this
-- transaction holds (',k1,k2,'), or says 'all' once it holds (1868724336, 4); like the locks,
-- it ends with the transaction (and a rolled-back savepoint takes back both).
CREATE OR REPLACE FUNCTION outbox_assign_id() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    most   text;
    held   text;
    key    text;
    n_held integer;
BEGIN
    -- A row that has its id already is being moved, not produced (outbox_maintain).
    IF NEW.id IS NOT NULL THEN
        RETURN NEW;
    END IF;
    most := current_setting('outboxpg.name_aggregates', true);
    IF most IS DISTINCT FROM 'off' THEN
        held := coalesce(current_setting('outboxpg.held_aggregates', true), '');
        IF held <> 'all' THEN
            key := outbox_aggregate_key(NEW.aggregate_type, NEW.aggregate_id)::text;
            IF strpos(held, ',' || key || ',') = 0 THEN
                -- Keys held so far: the commas, less one ('' holds none).
                n_held := length(held) - length(replace(held, ',', ''));
                IF greatest(n_held - 1, 0) < coalesce(most, '16')::integer THEN
                    PERFORM pg_advisory_xact_lock_shared(1868724337, key::integer);
                    PERFORM set_config('outboxpg.held_aggregates',
                                       CASE WHEN held = '' THEN ',' ELSE held END || key || ',', true);
                ELSE
                    PERFORM pg_advisory_xact_lock_shared(1868724336, 4);
                    PERFORM set_config('outboxpg.held_aggregates', 'all', true);
                END IF;
            END IF;
        END IF;
    END IF;
    NEW.id := nextval('outbox_id_seq');
    RETURN NEW;
END;
$$;

GRANT SELECT ON outbox_health TO outbox_worker;

-- 7. Operators: the views, the settings (read only), the repairs, and the events' metadata
--    for the inspection queries of sql/ (which events wait, on what, who holds a lease, why one
--    died) - but not payload and headers, the application's data.
GRANT SELECT ON outbox_stats, outbox_dead_letters, outbox_partitions, outbox_health, outbox_settings
    TO outbox_operator;
