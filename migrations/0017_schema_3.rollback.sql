-- outboxpg release schema-3, rolled back: takes a database of release schema-3 back to schema-2.
--
-- Produced by tools/schema_step.py (bin/schema-step) from schema/ and migrations/next/: do not
-- edit it. schema/ holds each object's definition and why; docs/migrations.md says how a
-- release is made. Once released (migrations/RELEASED) it is frozen.
-- depends: 0016_schema_2
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- Back to the last release, by hand: what the next release added goes, and the tables are put
-- back. The released definitions of the functions, views and triggers the release replaced
-- follow (tools/schema_step.py, docs/migrations.md). Emptied when a release is made.

DROP TRIGGER outbox_take_idempotency_key ON outbox;
DROP FUNCTION outbox_take_idempotency_key();
DROP FUNCTION outbox_untrusted_creators();
DROP VIEW outbox_health;
DROP FUNCTION outbox_xmin_holders();
DROP FUNCTION outbox_open_claims();
DROP FUNCTION outbox_warm_up(text);
DROP FUNCTION outbox_claim(integer, interval, text, bigint, text, boolean);
DROP FUNCTION outbox_intake_wait();
DROP FUNCTION outbox_intake_remember(tid);
DROP FUNCTION outbox_intake_holders();
DROP FUNCTION outbox_fail(bigint, uuid, text, boolean, interval);
DROP FUNCTION outbox_next_wakeup(text);
DROP FUNCTION outbox_complete(bigint[], uuid, timestamptz, timestamptz);
DROP FUNCTION outbox_shards_disable();
DROP FUNCTION outbox_shards_enable();
DROP FUNCTION outbox_shard_buckets(text);
DROP FUNCTION outbox_aggregate_bucket(text, text);
DROP INDEX IF EXISTS outbox_heads_bucket_idx;
DROP FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean, integer, boolean);
DROP FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz, boolean);
DROP FUNCTION outbox_replay_check(bigint[], text, text, text, timestamptz, timestamptz, boolean);
DROP VIEW outbox_stats;
DROP FUNCTION outbox_health_row();
DROP SEQUENCE outbox_intake_tid;

-- Back to one namespace of keys: where two producers hold one key, the earlier event keeps it.
DELETE FROM outbox_idempotency k
 USING outbox_idempotency other
 WHERE other.idempotency_key = k.idempotency_key AND other.event_id < k.event_id;
ALTER TABLE outbox_idempotency DROP CONSTRAINT outbox_idempotency_pkey, DROP COLUMN produced_by,
    ADD CONSTRAINT outbox_idempotency_pkey PRIMARY KEY (idempotency_key);

-- A dropped column keeps its grants (and its roles' dependencies on them): revoked first.
REVOKE SELECT (produced_by, size_bytes, replay_of) ON outbox FROM outbox_operator;
GRANT SELECT (lease_token) ON outbox TO outbox_operator;
ALTER TABLE outbox DROP COLUMN produced_by, DROP COLUMN size_bytes, DROP COLUMN replay_of;
REVOKE SELECT (allowed_subject_prefixes) ON outbox_settings FROM outbox_worker;
ALTER TABLE outbox_settings DROP COLUMN allowed_subject_prefixes, DROP COLUMN max_event_bytes,
    DROP COLUMN max_deliver_delay, DROP COLUMN max_claim_bytes;
GRANT EXECUTE ON FUNCTION outbox_forget_deleted() TO PUBLIC;
ALTER TABLE outbox_intake DROP COLUMN newest_id;

-- The commit-order guard, read once per claim. Ids come from a sequence when a row is
-- inserted, not when its transaction commits, so a lower id can become visible after a higher
-- one. Producing transactions announce themselves with shared advisory locks (0013):
--   (1868724336, 3)    "a producing transaction is open" (lets this skip pg_locks when none is);
--   -(L + 1)           (one bigint) "this transaction may still commit ids above L", per statement;
--   (1868724337, key)  per aggregate written (key: outbox_aggregate_key), taken before the id;
--   (1868724336, 4)    "this transaction wrote too many aggregates to name them all": it holds
--                      back every event above its L.
-- Returns, in this order of reading:
--   last_id     the last id assigned before the call: every id assigned later is above it;
--   settled     no open transaction can still commit an id up to it;
--   open_below  ids up to it can be handed out unless their aggregate's key is in held_keys.
-- The caller takes its snapshot after this returns: a transaction that commits in between was
-- still counted here, so its events are either visible or held back.
CREATE OR REPLACE FUNCTION outbox_commit_guard(OUT last_id bigint, OUT settled bigint, OUT open_below bigint,
                                    OUT held_keys integer[])
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
BEGIN
    -- On a sequence never used yet, last_value is the next id, not the last one.
    SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END INTO last_id FROM outbox_id_seq;
    settled := last_id;
    open_below := last_id;
    held_keys := '{}';
    IF pg_try_advisory_lock(1868724336, 3) THEN
        PERFORM pg_advisory_unlock(1868724336, 3);
        RETURN;
    END IF;
    WITH l AS MATERIALIZED (
        SELECT l.pid, l.classid, l.objid, l.objsubid
          FROM pg_locks l
         WHERE l.locktype = 'advisory'
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.pid <> pg_backend_pid()),
    horizon AS (
        SELECT l.pid, -((l.classid::bigint << 32) | l.objid::bigint) - 1 AS below
          FROM l
         WHERE l.objsubid = 1 AND l.classid >= 2147483648)   -- negative one-bigint keys
    SELECT least(last_id, (SELECT min(h.below) FROM horizon h)),
           least(last_id, (SELECT min(h.below) FROM horizon h
                             WHERE h.pid IN (SELECT w.pid FROM l w
                                              WHERE w.objsubid = 2 AND w.classid = 1868724336 AND w.objid = 4))),
           coalesce((SELECT array_agg(DISTINCT (a.objid::bigint - CASE WHEN a.objid::bigint >= 2147483648
                                                                     THEN 4294967296 ELSE 0 END)::integer)
                       FROM l a WHERE a.objsubid = 2 AND a.classid = 1868724337), '{}')
      INTO settled, open_below, held_keys;
END;
$$;

CREATE OR REPLACE FUNCTION outbox_complete(ids bigint[], lease_token uuid) RETURNS integer
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
ALTER FUNCTION outbox_complete(bigint[], uuid) SECURITY DEFINER;

CREATE OR REPLACE FUNCTION outbox_fail(id bigint, lease_token uuid, error text, permanent boolean DEFAULT false)
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
ALTER FUNCTION outbox_fail(bigint, uuid, text, boolean) SECURITY DEFINER;

CREATE OR REPLACE FUNCTION outbox_health_row()
RETURNS TABLE (
    backlog                    bigint,
    pending                    bigint,
    processing                 bigint,
    waiting_retry              bigint,
    dead                       bigint,
    expired_leases             bigint,
    oldest_pending_age         interval,
    last_claim_at              timestamptz,
    worker_claimed_last_minute boolean,
    open_producers             integer,
    oldest_producer_pid        integer,
    oldest_producer_age        interval,
    held_by_open_transactions  bigint
)
LANGUAGE plpgsql
STABLE
ROWS 1
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
-- With sequential scans off, any plan with one (outbox_settings, the id sequence) is costed
-- above jit_above_cost: JIT compiled it on every call (8 ms a call here, 84 ms the first).
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    n_pending    bigint;
    n_processing bigint;
    n_waiting    bigint;
    n_dead       bigint;
    n_expired    bigint;
    n_held       bigint;
    oldest       timestamptz;
    last_claim   timestamptz;
    n_producers  integer := 0;
    p_pid        integer;
    p_age        interval;
    guard_on     boolean;
    -- What the claim holds back (outbox_commit_guard): ids above settled, unless at or below
    -- open_below and of an aggregate whose key is not in held_keys. NULL settled: nothing.
    settled      bigint;
    open_below   bigint;
    held_keys    integer[];
BEGIN
    SELECT i.last_claim_at INTO last_claim FROM outbox_intake i;

    IF to_regprocedure('outbox_open_producers()') IS NOT NULL THEN
        SELECT count(*)::integer,
               (array_agg(p.pid ORDER BY p.xact_age DESC NULLS LAST, p.held_above))[1],
               (array_agg(p.xact_age ORDER BY p.xact_age DESC NULLS LAST, p.held_above))[1]
          INTO n_producers, p_pid, p_age
          FROM outbox_open_producers() p;
    END IF;
    IF n_producers > 0 THEN
        SELECT s.commit_order_guard INTO guard_on FROM outbox_settings s;
        IF guard_on THEN
            SELECT g.settled, g.open_below, g.held_keys INTO settled, open_below, held_keys
              FROM outbox_commit_guard() g;
        END IF;
    END IF;

    -- One pass over the unfinished events (the partial index outbox_unfinished_by_aggregate_idx).
    SELECT count(*) FILTER (WHERE o.state = 'pending'),
           count(*) FILTER (WHERE o.state = 'processing'),
           count(*) FILTER (WHERE o.state = 'pending' AND o.next_attempt_at > now()),
           count(*) FILTER (WHERE o.state = 'dead'),
           count(*) FILTER (WHERE o.state = 'processing' AND o.locked_until < now()),
           count(*) FILTER (WHERE o.state = 'pending' AND o.id > settled
                              AND (o.id > open_below
                                   OR outbox_aggregate_key(o.aggregate_type, o.aggregate_id) = ANY (held_keys))),
           min(o.created_at) FILTER (WHERE o.state IN ('pending', 'processing'))
      INTO n_pending, n_processing, n_waiting, n_dead, n_expired, n_held, oldest
      FROM outbox o
     WHERE o.unfinished;

    RETURN QUERY SELECT n_pending + n_processing, n_pending, n_processing, n_waiting, n_dead, n_expired,
                        now() - oldest, last_claim,
                        coalesce(last_claim >= now() - interval '1 minute', false),
                        n_producers, p_pid, p_age, n_held;
END;
$$;
ALTER FUNCTION outbox_health_row() SECURITY DEFINER;

-- The row trigger of every insert. In order:
--   * deliver_at: written into next_attempt_at, the column every claim waits on for retries, so
--     a scheduled event is a pending event whose first attempt is not due yet: its head is
--     ready at that time, outbox_next_wakeup() says when, and nothing else changes;
--   * trace context: outboxpg.traceparent (and outboxpg.tracestate), set for the transaction
--     by a producer that cannot build headers itself (a trigger, a stored procedure), goes into
--     the event's headers unless they hold a traceparent already (any case); a malformed one
--     fails the insert, naming the setting, since a consumer would drop it;
--   * the commit-order locks (above), then the id, so that the lock comes before the id;
--   * the idempotency key: a row whose key an unfinished event holds is not inserted.
-- outboxpg.held_aggregates is the trigger's own transaction-local setting: the keys the
-- transaction holds (',k1,k2,'), 'all' once it holds (1868724336, 4), or 'off'. Like the locks
-- it ends with the transaction, and a rolled-back savepoint takes back both. PL/pgSQL sets up
-- every expression it evaluates once per transaction, and a one-event transaction pays for all
-- of them: the settings are read only when a transaction writes a second aggregate, and the
-- first event's locks go in one statement (bench/producer_instructions.py counts the cost).
CREATE OR REPLACE FUNCTION outbox_assign_id() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    held  text;       -- outboxpg.held_aggregates: ',k1,k2,' named so far; 'all'; 'off'
    key   text;
    trace text;
    guard boolean;
    most  integer;
BEGIN
    -- A row that has its id already is being moved, not produced (outbox_maintain).
    IF NEW.id IS NOT NULL THEN
        RETURN NEW;
    END IF;
    IF NEW.deliver_at IS NOT NULL THEN
        NEW.next_attempt_at := NEW.deliver_at;
    END IF;
    IF current_setting('outboxpg.traceparent', true) <> '' THEN
        trace := current_setting('outboxpg.traceparent', true);
        IF NOT EXISTS (SELECT 1 FROM jsonb_object_keys(NEW.headers) k WHERE lower(k) = 'traceparent') THEN
            IF trace !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' THEN
                RAISE EXCEPTION 'outbox: outboxpg.traceparent is not a W3C traceparent: %', left(trace, 80)
                    USING ERRCODE = 'invalid_parameter_value',
                          HINT = 'version-traceid-parentid-flags in lower-case hex, e.g. '
                                 '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
            END IF;
            NEW.headers := NEW.headers || jsonb_build_object('traceparent', trace);
            trace := nullif(current_setting('outboxpg.tracestate', true), '');
            IF trace IS NOT NULL THEN
                NEW.headers := NEW.headers || jsonb_build_object('tracestate', trace);
            END IF;
        END IF;
    END IF;

    key := outbox_aggregate_key(NEW.aggregate_type, NEW.aggregate_id)::text;
    held := current_setting('outboxpg.held_aggregates', true);
    IF held IS NULL OR held = '' THEN
        -- The transaction's first event. Before it takes any id, it says that a producing
        -- transaction is open, (1868724336, 3); that it may commit ids above L, the last id
        -- handed out so far, -(L + 1) (NULL: none since the sequence was made or reset; 0 then
        -- holds back every id); and which aggregate it writes, (1868724337, key). Its later
        -- events' ids are above L too, so once is enough: a claim reads the lowest L of each open
        -- transaction. The horizon is taken with the guard off too (the claims' intake cursor
        -- must not pass ids that an open transaction may still commit), and so is the first
        -- aggregate's name: the settings are read only for a second aggregate, and claims with
        -- the guard off ignore names.
        PERFORM pg_advisory_xact_lock_shared(1868724336, 3),
                pg_advisory_xact_lock_shared(-coalesce(pg_sequence_last_value('outbox_id_seq'), 0) - 1),
                pg_advisory_xact_lock_shared(1868724337, key::integer),
                set_config('outboxpg.held_aggregates', ',' || key || ',', true);
    ELSIF held <> 'all' AND held <> 'off' AND strpos(held, ',' || key || ',') = 0 THEN
        -- Another aggregate: named while the transaction names at most
        -- commit_order_max_aggregates (the lock table is shared and finite); past that it holds
        -- (1868724336, 4), which holds back every event above its horizon, and names no more.
        SELECT s.commit_order_guard, s.commit_order_max_aggregates INTO guard, most FROM outbox_settings s;
        IF NOT guard THEN
            PERFORM set_config('outboxpg.held_aggregates', 'off', true);
        ELSIF length(held) - length(replace(held, ',', '')) - 1 < most THEN     -- keys named so far
            PERFORM pg_advisory_xact_lock_shared(1868724337, key::integer),
                    set_config('outboxpg.held_aggregates', held || key || ',', true);
        ELSE
            PERFORM pg_advisory_xact_lock_shared(1868724336, 4),
                    set_config('outboxpg.held_aggregates', 'all', true);
        END IF;
    END IF;
    NEW.id := nextval('outbox_id_seq');
    IF NEW.idempotency_key IS NOT NULL AND NOT outbox_idempotency_take(NEW.idempotency_key, NEW.id) THEN
        RETURN NULL;    -- a duplicate: no row
    END IF;
    RETURN NEW;
END;
$$;

-- Idempotent enqueue. An event written with an idempotency_key while an earlier event with the
-- same key is not finished (pending, processing or dead) is not inserted: the INSERT succeeds
-- and writes no row (INSERT ... RETURNING returns none, COPY counts it out), from any language,
-- whatever partition the earlier event is in. Once the earlier event is finished the key is free
-- again. Two transactions inserting one key at once: the second waits on the first's key row
-- (the primary key's uniqueness check), then sees it committed (a duplicate) or rolled back (it
-- takes the key). Under REPEATABLE READ or SERIALIZABLE the second fails with a serialization
-- error instead of waiting it out: retry the transaction. A row without a key pays one IS NULL
-- test; one with a key pays the key table's insert and, for a key seen before, a look at the
-- earlier event by id (one index probe per partition).
CREATE OR REPLACE FUNCTION outbox_idempotency_take(key text, event_id bigint) RETURNS boolean
LANGUAGE plpgsql
-- Runs as its owner: producers may neither read the table nor see other events.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    holder bigint;
BEGIN
    IF octet_length(key) > 255 OR key !~ '[^[:space:]]' THEN
        RAISE EXCEPTION 'outbox: idempotency_key must be 1 to 255 bytes and not blank, got %', left(key, 40)
            USING ERRCODE = 'check_violation';
    END IF;
    LOOP
        -- Waits for a transaction that inserted the key and has not ended.
        INSERT INTO outbox_idempotency (idempotency_key, event_id) VALUES (key, event_id)
        ON CONFLICT (idempotency_key) DO NOTHING;
        IF FOUND THEN
            RETURN true;
        END IF;
        -- Taken. Each statement below sees what committed before it began.
        SELECT k.event_id INTO holder FROM outbox_idempotency k WHERE k.idempotency_key = key FOR UPDATE;
        CONTINUE WHEN NOT FOUND;            -- forgotten meanwhile: try again
        IF EXISTS (SELECT 1 FROM outbox o WHERE o.id = holder AND o.unfinished) THEN
            RETURN false;                   -- a duplicate
        END IF;
        UPDATE outbox_idempotency k
           SET event_id = outbox_idempotency_take.event_id, looked_at = now()
         WHERE k.idempotency_key = key;
        RETURN true;
    END LOOP;
END;
$$;

-- Which event holds a key: outboxpg.enqueue returns the earlier event's id and says that the
-- insert was a duplicate.
CREATE OR REPLACE FUNCTION outbox_idempotency_event(key text) RETURNS bigint
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    SELECT k.event_id FROM outbox_idempotency k WHERE k.idempotency_key = key
$$;

-- Take events that no worker holds out of the flow: pending (scheduled or not) and dead ones
-- become discarded with reason 'cancelled', and the next event of their aggregate becomes
-- claimable (outbox_discard does the work, 60_dead_letters_replay.sql). An event a worker has
-- claimed (processing) is not cancelled, it may be on the wire already: the count says how many
-- were. A claim and a cancel of one event are ordered by its row lock: the loser sees the
-- other's result and leaves the event alone.
CREATE OR REPLACE FUNCTION outbox_cancel(ids bigint[]) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner, like outbox_discard: producers may not update the table.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION 'outbox_cancel: ids must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    RETURN outbox_discard(ids, 'cancelled');
END;
$$;

-- When each head can be claimed: ready_at, or, while a run holds it, leased_until. A head that
-- came due within the last second counts too (it is returned, in the past: claim now): it may
-- have come due between the worker's last claim and this call. Heads the commit-order guard
-- holds back are left out: the producer's commit wakes the workers, and claiming them now finds
-- nothing. A parked head wakes nobody: its time running out makes nothing due. Index lookups
-- only, pinned like the claim's (a plan made from statistics taken during a burst must not turn
-- into scans of whole partitions later).
CREATE OR REPLACE FUNCTION outbox_next_wakeup() RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
-- Runs as its owner: a worker has no rights on the tables.
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
SET jit = off
AS $$
DECLARE
    g record;
    floor_at timestamptz := to_timestamp(coalesce(pg_sequence_last_value('outbox_heads_floor_us'), 0) / 1000000.0);
BEGIN
    SELECT * INTO g FROM outbox_commit_guard();
    IF NOT (SELECT s.commit_order_guard FROM outbox_settings s) THEN
        g.settled := g.last_id;
    END IF;
    -- Leased heads sit among the due ones (ready_at passed), at or above the floor: a walk over
    -- the runs in flight, which is short whenever a worker is idle.
    RETURN least(
        (SELECT min(h.ready_at)
           FROM outbox_heads h
          WHERE h.ready_at > now() - interval '1 second'
            AND (h.leased_until IS NULL OR h.leased_until <= h.ready_at)
            AND (h.ready_at > now()
                 OR h.head_id <= g.settled
                 OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))),
        (SELECT min(h.leased_until)
           FROM outbox_heads h
          WHERE h.ready_at >= floor_at AND h.ready_at <= now()
            AND h.leased_until > h.ready_at
            AND NOT h.parked
            AND h.leased_until > now() - interval '1 second'
            AND (h.leased_until > now()
                 OR h.head_id <= g.settled
                 OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))));
END;
$$;

-- The floor, raised first if it is more than 20 ms old.
CREATE OR REPLACE FUNCTION outbox_heads_floor() RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    floor_at    timestamptz := to_timestamp(coalesce(pg_sequence_last_value('outbox_heads_floor_us'), 0) / 1000000.0);
    at          timestamptz := clock_timestamp();
    at_cs       bigint := floor(extract(epoch FROM at) * 100)::bigint;     -- `at` in the writers' unit
    writers     timestamptz;
    first_ready timestamptz;
    raised      timestamptz;
BEGIN
    IF floor_at > at THEN
        -- The clock went back: no floor until the next call raises one from the start.
        PERFORM setval('outbox_heads_floor_us', 0);
        RETURN '-infinity';
    END IF;
    IF floor_at > at - interval '20 milliseconds'
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN floor_at;
    END IF;
    -- First the writers at work (the caller's own lock among them), then, in a snapshot taken
    -- after that, the first head: a writer that ends in between is seen by one or the other.
    -- Ages are taken modulo 2^32 centiseconds (a lock newer than `at` has a negative age).
    -- The result is the lock's own centisecond, at or before the moment it was taken.
    SELECT to_timestamp((at_cs - max(CASE WHEN a.age >= 2147483648 THEN a.age - 4294967296 ELSE a.age END)) / 100.0)
      INTO writers
      FROM (SELECT ((at_cs - l.objid::bigint) % 4294967296 + 4294967296) % 4294967296 AS age
              FROM pg_locks l
             WHERE l.locktype = 'advisory' AND l.classid = 1868724338 AND l.objsubid = 2
               AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) a;
    SELECT h.ready_at INTO first_ready
      FROM outbox_heads h
     WHERE h.ready_at >= floor_at
     ORDER BY h.ready_at
     LIMIT 1;
    raised := least(at, writers, first_ready);      -- least ignores NULLs
    IF raised > floor_at THEN
        PERFORM setval('outbox_heads_floor_us', floor(extract(epoch FROM raised) * 1000000)::bigint);
        RETURN raised;
    END IF;
    RETURN floor_at;
END;
$$;

-- Take newly committed events into outbox_heads: up to `chunk` in-flow events above the intake
-- cursor, oldest first. Returns the cursor afterwards, or NULL when another claim is taking in
-- right now (one at a time: the others skip it rather than wait).
--
-- The intake row is locked once per claim and written by the ctid it locked (a TID scan reads
-- that version only): the cursor and last_claim_at in one update. Readers that do not move the
-- cursor (a report; a claim whose intake found the row locked) read outbox_intake_mark instead:
-- the intake sets it to the cursor it locked, which is committed, before moving the cursor in
-- its own transaction, so the mark is never above the cursor, whatever commits or rolls back.
-- A mark below the cursor is safe where it is used: it only lowers where a reader starts
-- looking along an aggregate's line, least(head_id, mark + 1), and no unfinished event of an
-- aggregate lies below its head_id at or under the cursor (the intake moved the head back to
-- it). Such a reader may read a few index entries more; it finds the same first event.
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
    row_tid tid;                                -- the version of the intake row locked
    noted   timestamptz;                        -- its last_claim_at
    types   text[];
    ids     text[];
    firsts  bigint[];
    busy      bigint[] := '{}';                 -- places in types / ids / firsts of busy aggregates
    live_tids tid[];                            -- their heads, found and locked
    live_ns   bigint[];                         -- their places
    held_from bigint;                           -- the first event of one whose head another holds
    seen    bigint;
    top     bigint;
    at      timestamptz := clock_timestamp();   -- one time for all the heads made here
BEGIN
    SELECT i.intake_id, i.ctid, i.last_claim_at INTO upto, row_tid, noted
      FROM outbox_intake i FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- The cursor as locked is committed: the mark may go up to it.
    IF upto > coalesce(pg_sequence_last_value('outbox_intake_mark'), 0) THEN
        PERFORM setval('outbox_intake_mark', upto);
    END IF;
    -- Monitors ask "is a worker claiming?" (outbox_health): to the second, so that a busy
    -- worker does not write the row for that alone. Written with the cursor below, by ctid.
    noted := CASE WHEN noted IS NULL OR noted < at - interval '1 second' THEN at END;
    IF upto >= last_id THEN
        IF noted IS NOT NULL THEN
            UPDATE outbox_intake i SET last_claim_at = noted WHERE i.ctid = row_tid;
        END IF;
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
        -- A busy aggregate's head is kept, parked, between two of its events
        -- (outbox_refresh_heads). Its key then has a live version at the newest of its entries,
        -- where INSERT ... ON CONFLICT reads every entry of the key from the oldest before it
        -- reaches it: the heads of busy aggregates are looked up from the newest entry of their
        -- key down (as outbox_refresh_heads finds them). Busy: an event among the ones just
        -- below the cursor (twice as many as this intake read, 50 to 500), looked for only when
        -- this intake read fewer than a chunk: one catching up on a backlog reads chunks of
        -- thousands, and its insert brings parked heads back as well. Not every key: for a key
        -- with no live head (dropped, to be made again) that look reads all of its entries, and
        -- the insert's check then reads them again.
        IF seen < chunk THEN
            busy := ARRAY(SELECT s.n
                            FROM unnest(types, ids) WITH ORDINALITY AS s(t, i, n)
                           WHERE outbox_aggregate_key(s.t, s.i) = ANY (         -- a collision: one look more
                                 ARRAY(SELECT outbox_aggregate_key(o.aggregate_type, o.aggregate_id)
                                         FROM outbox o
                                        WHERE o.id > upto - least(greatest(2 * seen, 50), 500)
                                          AND o.id <= upto)));
        END IF;

        -- Lock order. Reports lock heads in one pass in key order, and wait. The intake may wait
        -- only in a pass of the same kind, holding no head yet: the other aggregates first, all
        -- in key order in the insert below (new heads made, the others locked by its conflict
        -- update, waiting for a report that holds them). The busy ones after that never wait
        -- (SKIP LOCKED, ON CONFLICT DO NOTHING): holding the first pass's heads, a wait there
        -- could close a circle with a report that holds a busy head and waits for one of those.
        -- opened_id, the first event's id, orders the heads made here among themselves.
        INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at, opened_id)
        -- The clock, not now(): a head's ready_at is never below the time its writer
        -- announced (outbox_heads_writing); the claim reads its own time after this.
        SELECT s.t, s.i, outbox_aggregate_key(s.t, s.i), s.f, at, s.f
          FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
         WHERE s.n <> ALL (busy)
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
           SET head_id = least(h.head_id, excluded.head_id),
               -- a parked head (an aggregate whose events paused) comes back here too
               leased_until = CASE WHEN h.parked THEN NULL ELSE h.leased_until END,
               parked = false
         WHERE h.parked OR h.head_id > excluded.head_id;

        IF cardinality(busy) > 0 THEN
            -- The busy aggregates' heads, each from the newest entry of its key down to the
            -- first version this sees, locked unless another transaction holds it.
            SELECT array_agg(h.tid), array_agg(s.n)
              INTO live_tids, live_ns
              FROM (SELECT s.t COLLATE "C" AS t, s.i COLLATE "C" AS i, s.n
                      FROM unnest(types, ids) WITH ORDINALITY AS s(t, i, n)
                     WHERE s.n = ANY (busy)
                     ORDER BY 1, 2) s
             CROSS JOIN LATERAL (
                   SELECT h.ctid AS tid FROM outbox_heads h
                    WHERE h.aggregate_type = s.t
                      AND h.aggregate_id >= s.i AND h.aggregate_id <= s.i
                    ORDER BY h.aggregate_type DESC, h.aggregate_id DESC
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED) h;
            IF live_tids IS NOT NULL THEN
                -- A parked head comes back: due again at the ready_at it kept, no longer leased.
                -- Only columns in no index change (head_id, leased_until, parked): a HOT update,
                -- no new index entry. By ctid, in a statement of its own: it sees the versions
                -- locked above.
                UPDATE outbox_heads h
                   SET head_id = least(h.head_id, firsts[l.n]),
                       leased_until = CASE WHEN h.parked THEN NULL ELSE h.leased_until END,
                       parked = false
                  FROM unnest(live_tids, live_ns) AS l(tid, n)
                 WHERE h.ctid = ANY (live_tids)
                   AND h.ctid = l.tid
                   AND (h.parked OR h.head_id > firsts[l.n]);
            END IF;
            IF coalesce(cardinality(live_ns), 0) < cardinality(busy) THEN
                -- The busy aggregates whose head was not found: made when there is none (no other
                -- transaction makes heads: the intake row is locked). One that exists is held by
                -- another transaction (SKIP LOCKED passed it): DO NOTHING neither waits for it nor
                -- locks it, and the cursor stays below the aggregate's first event here, for the
                -- next intake to take it in again. Its holder may be a report about to park or drop
                -- it from a view that missed the event.
                WITH made AS (
                    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at, opened_id)
                    SELECT s.t, s.i, outbox_aggregate_key(s.t, s.i), s.f, at, s.f
                      FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
                     WHERE s.n = ANY (busy) AND s.n <> ALL (coalesce(live_ns, '{}'))
                    ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING
                    RETURNING h.aggregate_type, h.aggregate_id)
                SELECT min(s.f) INTO held_from
                  FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
                 WHERE s.n = ANY (busy) AND s.n <> ALL (coalesce(live_ns, '{}'))
                   AND NOT EXISTS (SELECT FROM made m WHERE m.aggregate_type = s.t AND m.aggregate_id = s.i);
            END IF;
        END IF;
    END IF;

    -- Past everything read (all of it when fewer than chunk came back), never past the horizon.
    top := least(CASE WHEN coalesce(seen, 0) < chunk THEN last_id ELSE top END, settled);
    -- Below a busy aggregate whose head another transaction held (see above).
    top := least(top, held_from - 1);
    IF top > upto OR noted IS NOT NULL THEN
        -- By ctid (a TID scan): the version locked above, not a walk of all of them.
        UPDATE outbox_intake i
           SET intake_id = greatest(top, upto),
               last_claim_at = coalesce(noted, i.last_claim_at)
         WHERE i.ctid = row_tid;
        upto := greatest(top, upto);
    END IF;
    RETURN upto;
END;
$$;

-- The claim: the intake first, then passes over the due heads (a pass that reclaimed expired
-- runs or discarded expired events looks again for the rest of the batch), then one UPDATE that
-- leases the runs found, by the ctids locked on the way.
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
-- Runs as its owner: a worker has no rights on the tables.
SECURITY DEFINER
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
    -- The lease runs from the moment of the claim, not from the start of the caller's
    -- transaction (read after the intake, so that the heads it made are due at t).
    t       timestamptz;
    floor_at timestamptz;   -- no head is due below it
    owner   text;
    n       integer;
    g       record;
    upto    bigint;
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
    x_ids   bigint[];       -- heads past their expires_at, discarded
    m_tids  tid[];          -- the heads to move, and where to
    m_heads bigint[];
    m_ready timestamptz[];
    m_leased timestamptz[];
    x_tids  tid[];
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

    -- This transaction writes heads' ready_at from here on (outbox_heads_floor).
    PERFORM outbox_heads_writing();
    -- Commit order: read before the snapshots of the statements below.
    SELECT * INTO g FROM outbox_commit_guard();
    upto := outbox_take_in(g.settled, g.last_id, least(greatest(2 * n, 500), 10000));
    t := clock_timestamp();
    floor_at := outbox_heads_floor();
    IF NOT cfg.commit_order_guard THEN
        -- Switched off: whatever is visible, in id order per aggregate.
        g.settled := g.last_id;
        g.open_below := g.last_id;
        g.held_keys := '{}';
    END IF;
    IF upto IS NULL THEN
        -- Another claim holds the intake row: the mark, not a walk of the row's versions.
        upto := coalesce(pg_sequence_last_value('outbox_intake_mark'), 0);
    END IF;
    -- Parked heads whose second is up, among the first due heads (those that hold the
    -- floor): dropped below with the heads found empty (outbox_refresh_heads looks at their
    -- events first). A few index entries, read without locks.
    SELECT coalesce(array_agg(p.aggregate_type), '{}'), coalesce(array_agg(p.aggregate_id), '{}')
      INTO empty_types, empty_ids
      FROM (SELECT h.aggregate_type, h.aggregate_id, h.parked, h.leased_until
              FROM outbox_heads h
             WHERE h.ready_at <= t AND h.ready_at >= floor_at
             ORDER BY h.ready_at, h.opened_id
             LIMIT 16) p
     WHERE p.parked AND p.leased_until < t;

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
                   h.leased_until AS old_leased,
                   h.tid AS head_tid, h.lock_key, line.ids AS line_ids,
                   e.id, e.ctid, e.created_at, e.state, e.attempts, e.next_attempt_at, e.locked_until, e.lease_token,
                   e.expires_at
              FROM (SELECT h.aggregate_type, h.aggregate_id, h.lock_key, h.head_id, h.ready_at, h.leased_until,
                           h.ctid AS tid
                      FROM outbox_heads h
                     WHERE h.ready_at <= t
                       AND h.ready_at >= floor_at
                       AND (h.leased_until IS NULL OR h.leased_until < t)   -- no run in flight
                       AND NOT h.parked
                       AND (h.head_id <= g.settled
                            OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))
                     ORDER BY h.ready_at, h.opened_id             -- head_id is in no index
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
                          o.lease_token, o.expires_at
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
                            AND (m.expires_at IS NULL OR m.expires_at > t)        -- never sent late
                            AND (m.id <= g.settled
                                 OR (m.id <= g.open_below AND m.lock_key <> ALL (g.held_keys)))) OVER w AS in_run,
                   -- A run whose lease ran out: its first event's retry (random jitter, drawn once).
                   CASE WHEN m.rn = 1 AND m.matched AND m.state = 'processing' AND m.locked_until < t
                        THEN t + outbox_retry_delay(m.attempts, cfg.backoff_base, cfg.backoff_cap) END AS retry_at,
                   -- A pending head past its expires_at is discarded, never handed out (an
                   -- event further down its line is, once it is the head).
                   m.rn = 1 AND m.matched AND m.state = 'pending' AND m.expires_at <= t AS lapsed
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
            SELECT m.aggregate_type, m.aggregate_id, m.old_head_id, m.old_ready, m.old_leased, m.head_tid,
                   cardinality(m.line_ids) AS line_length,
                   -- Moved up only to a run's first event: that one passed the guard, so no
                   -- earlier event of its aggregate can still appear. Any other event read here
                   -- may have a late-committing predecessor this snapshot cannot see, which the
                   -- intake is about to move the head back to.
                   CASE WHEN m.in_run THEN m.id ELSE m.old_head_id END AS new_head_id,
                   -- A run leaves ready_at as it is (below: leased_until).
                   CASE WHEN m.in_run THEN m.old_ready
                        WHEN m.lapsed THEN t                           -- its next event, at once
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
                   END AS new_ready,
                   CASE WHEN m.in_run THEN t + lease END AS new_leased
              FROM marked m
             WHERE m.rn = 1),
        -- The heads that move are moved by the statement after this one, by ctid.
        moved AS (
            SELECT hn.head_tid, hn.new_head_id, hn.new_ready, hn.new_leased
              FROM head_next hn
             WHERE (hn.old_head_id, hn.old_ready, hn.old_leased)
                   IS DISTINCT FROM (hn.new_head_id, hn.new_ready, hn.new_leased))
        SELECT (SELECT array_agg(m.id ORDER BY m.id) FROM marked m WHERE m.in_run),
               (SELECT array_agg(m.ctid ORDER BY m.id) FROM marked m WHERE m.in_run),
               (SELECT array_agg(x.id ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.ctid ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.is_first ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.retry_at ORDER BY x.id) FROM expired x),
               (SELECT count(*) FROM head_next),
               (SELECT array_agg(hn.aggregate_type) FROM head_next hn WHERE hn.line_length = 0),
               (SELECT array_agg(hn.aggregate_id) FROM head_next hn WHERE hn.line_length = 0),
               (SELECT min(m.created_at) FROM marked m
                 WHERE m.in_run OR m.lapsed OR m.id IN (SELECT x.id FROM expired x)),
               (SELECT max(m.created_at) FROM marked m
                 WHERE m.in_run OR m.lapsed OR m.id IN (SELECT x.id FROM expired x)),
               (SELECT array_agg(m.id ORDER BY m.id) FROM marked m WHERE m.lapsed),
               (SELECT array_agg(m.ctid ORDER BY m.id) FROM marked m WHERE m.lapsed),
               (SELECT array_agg(mv.head_tid) FROM moved mv),
               (SELECT array_agg(mv.new_head_id) FROM moved mv),
               (SELECT array_agg(mv.new_ready) FROM moved mv),
               (SELECT array_agg(mv.new_leased) FROM moved mv)
          INTO pass_ids, pass_tids, r_ids, r_tids, r_first, r_retry, seen_heads, pass_empty_types,
               pass_empty_ids, pass_lo, pass_hi, x_ids, x_tids, m_tids, m_heads, m_ready,
               m_leased;
        IF m_tids IS NOT NULL THEN
            -- By ctid (a TID scan), in a statement of its own. Joined by key within the
            -- statement above, the planner could read all of outbox_heads_pkey for it once
            -- ANALYZE had counted few live heads: under a held snapshot, every dead entry of
            -- every head, on every claim. The heads were locked above and stay as they are; in
            -- a snapshot of its own this statement sees them as locked, also one that a report
            -- had changed between the snapshot above and its lock.
            -- A head taken for a run keeps head_id and ready_at: a HOT update.
            UPDATE outbox_heads oh
               SET head_id = mv.new_head_id,
                   ready_at = mv.new_ready,
                   leased_until = mv.new_leased
              FROM unnest(m_tids, m_heads, m_ready, m_leased) AS mv(tid, new_head_id, new_ready, new_leased)
             WHERE oh.ctid = ANY (m_tids)
               AND oh.ctid = mv.tid;
        END IF;
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
        IF x_ids IS NOT NULL THEN
            -- Past their expires_at, out of the flow (their heads were made ready above,
            -- so the next pass looks at the event behind each).
            UPDATE outbox o
               SET state = 'discarded', discarded_at = t, discard_reason = 'expired'
             WHERE o.ctid = ANY (x_tids)                -- locked above
               AND (o.id = ANY (x_ids)) IS TRUE
               AND o.created_at BETWEEN pass_lo AND pass_hi;
        END IF;
        EXIT WHEN (r_ids IS NULL AND x_ids IS NULL) OR cardinality(c_ids) >= n;
    END LOOP;

    IF cardinality(empty_types) > 0 THEN
        -- Heads with no unfinished event in sight: dropped, or set right, under the protocol
        -- that keeps a new event from losing its head (the claim holds them already).
        PERFORM outbox_refresh_heads(empty_types, empty_ids);
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
               -- The columns' domains, as their base types.
               o.aggregate_type::text, o.aggregate_id::text, o.event_type::text, o.payload,
               o.headers::jsonb, o.msg_id::text,
               o.attempts, o.created_at, o.lease_token, o.locked_until
    )
    SELECT * FROM claimed ORDER BY 1;
END;
$$;

CREATE OR REPLACE FUNCTION outbox_replay_candidates(ids bigint[] DEFAULT NULL, aggregate_type text DEFAULT NULL,
                                         aggregate_id text DEFAULT NULL, event_type text DEFAULT NULL,
                                         since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
RETURNS TABLE (id bigint, created_at timestamptz)
LANGUAGE plpgsql
STABLE
-- Runs as its owner, like outbox_replay, which reads its rows: the same selection for both.
SECURITY DEFINER
SET search_path FROM CURRENT
-- A plan per call, with the filters' values: "since IS NULL OR created_at >= since" folds away
-- and the partitions outside [since, until) are pruned, which a generic plan cannot do.
SET plan_cache_mode = force_custom_plan
AS $$
BEGIN
    IF num_nonnulls(ids, aggregate_type, aggregate_id, event_type, since, until) = 0 THEN
        RAISE EXCEPTION 'outbox_replay: no filter given: refusing to replay every published event'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Give ids, aggregate_type, aggregate_id, event_type, since or until (combined with AND).';
    END IF;
    IF since >= until THEN
        RAISE EXCEPTION 'outbox_replay: since (%) is not before until (%)', since, until
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY
    SELECT o.id, o.created_at
      FROM outbox o
     WHERE o.state = 'published'
       AND (outbox_replay_candidates.ids IS NULL OR o.id = ANY (outbox_replay_candidates.ids))
       AND (outbox_replay_candidates.aggregate_type IS NULL OR o.aggregate_type = outbox_replay_candidates.aggregate_type)
       AND (outbox_replay_candidates.aggregate_id IS NULL OR o.aggregate_id = outbox_replay_candidates.aggregate_id)
       AND (outbox_replay_candidates.event_type IS NULL OR o.event_type = outbox_replay_candidates.event_type)
       AND (outbox_replay_candidates.since IS NULL OR o.created_at >= outbox_replay_candidates.since)
       AND (outbox_replay_candidates.until IS NULL OR o.created_at < outbox_replay_candidates.until)
     ORDER BY o.id;
END;
$$;

CREATE OR REPLACE FUNCTION outbox_replay(ids bigint[] DEFAULT NULL, aggregate_type text DEFAULT NULL,
                              aggregate_id text DEFAULT NULL, event_type text DEFAULT NULL,
                              since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
                              new_msg_id boolean DEFAULT false) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: an operator may not insert events nor read payloads itself.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    replayed integer;
BEGIN
    IF new_msg_id IS NULL THEN
        RAISE EXCEPTION 'outbox_replay: new_msg_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Through the insert path of every event (its trigger assigns the ids in this statement's order).
    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, subject, msg_id)
    SELECT o.aggregate_type, o.aggregate_id, o.event_type, o.payload,
           o.headers || jsonb_build_object('Outbox-Replay-Of', o.id::text),
           o.subject,
           CASE WHEN outbox_replay.new_msg_id THEN gen_random_uuid()::text ELSE o.msg_id END
      FROM outbox_replay_candidates(outbox_replay.ids, outbox_replay.aggregate_type, outbox_replay.aggregate_id,
                                    outbox_replay.event_type, outbox_replay.since, outbox_replay.until) c
      JOIN outbox o ON o.id = c.id AND o.created_at = c.created_at
     ORDER BY c.id;
    GET DIAGNOSTICS replayed = ROW_COUNT;
    RETURN replayed;
END;
$$;

-- Keys of finished events are forgotten here, not on the producers' path: a producer that
-- deleted or touched other keys' rows would make producers wait on each other, and deadlock
-- where two of them write several keys at once. The worker calls it with outbox_maintain();
-- any scheduler can call it: it is cheap when there is nothing to do.
CREATE OR REPLACE FUNCTION outbox_idempotency_forget(max_keys integer DEFAULT 10000) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    forgotten integer;
BEGIN
    -- The keys looked at longest ago: those whose event is finished (or gone with its partition)
    -- are forgotten, the others go to the back of the line, so that every call makes progress.
    -- SKIP LOCKED: a key a producer is taking right now is left for the next call; this never
    -- waits for a producer (producers may wait for it, briefly).
    WITH looked AS MATERIALIZED (
        SELECT k.idempotency_key,
               EXISTS (SELECT 1 FROM outbox o WHERE o.id = k.event_id AND o.unfinished) AS held
          FROM outbox_idempotency k
         ORDER BY k.looked_at
         LIMIT max_keys
           FOR UPDATE SKIP LOCKED),
    gone AS (
        DELETE FROM outbox_idempotency k USING looked l
         WHERE k.idempotency_key = l.idempotency_key AND NOT l.held
     RETURNING 1),
    kept AS (
        UPDATE outbox_idempotency k SET looked_at = now()
          FROM looked l
         WHERE k.idempotency_key = l.idempotency_key AND l.held)
    SELECT count(*) INTO forgotten FROM gone;
    RETURN forgotten;
END;
$$;

CREATE OR REPLACE FUNCTION outbox_xmin_holders()
RETURNS TABLE (kind text, pid integer, name text, since timestamptz, age interval, xmin_age integer,
               state text, query text, application_name text, past_threshold boolean)
LANGUAGE sql
STABLE
-- Reads other roles' sessions in pg_stat_activity: runs as its owner (see above).
SECURITY DEFINER
SET search_path FROM CURRENT
-- pg_stat_activity and the others are functions estimated at 1,000 rows each: keep the planner
-- from compiling a query that reads a few dozen rows of memory.
SET jit = off
AS $$
    WITH holder AS (
        SELECT 'session'::text AS kind, a.pid, NULL::text AS name, a.xact_start AS since,
               greatest(age(a.backend_xmin), age(a.backend_xid)) AS xmin_age,
               a.state, left(a.query, 200) AS query, a.application_name
          FROM pg_stat_activity a
         WHERE a.datname = current_database()
           AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
           AND a.pid <> pg_backend_pid()
           AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
        UNION ALL
        SELECT 'walsender', a.pid, a.client_addr::text, NULL, age(a.backend_xmin),
               a.state, NULL, a.application_name
          FROM pg_stat_activity a
         WHERE a.backend_type = 'walsender' AND a.backend_xmin IS NOT NULL
        UNION ALL
        SELECT 'prepared transaction', NULL, p.gid, p.prepared, age(p.transaction),
               'prepared', NULL, NULL
          FROM pg_prepared_xacts p
         WHERE p.database = current_database()
        UNION ALL
        SELECT 'replication slot', r.active_pid, r.slot_name, NULL, age(r.xmin),
               CASE WHEN r.active THEN 'active' ELSE 'inactive' END, NULL, NULL
          FROM pg_replication_slots r
         WHERE r.xmin IS NOT NULL)
    SELECT h.kind, h.pid, h.name, h.since, now() - h.since, h.xmin_age, h.state, h.query, h.application_name,
           CASE WHEN h.kind = 'replication slot' THEN h.state = 'inactive'
                WHEN h.kind = 'walsender' THEN false
                ELSE coalesce(now() - h.since > s.xmin_warn_after, false)
           END
      FROM holder h CROSS JOIN outbox_settings s
     ORDER BY h.xmin_age DESC NULLS LAST, h.since NULLS LAST, h.pid
$$;

CREATE OR REPLACE VIEW outbox_stats AS
SELECT count(*) FILTER (WHERE state = 'pending')                                AS pending,
       count(*) FILTER (WHERE state = 'pending' AND next_attempt_at > now())    AS waiting_retry,
       count(*) FILTER (WHERE state = 'processing')                             AS processing,
       count(*) FILTER (WHERE state = 'published')                              AS published,
       count(*) FILTER (WHERE state = 'dead')                                   AS dead,
       count(*) FILTER (WHERE state = 'discarded')                              AS discarded,
       now() - min(created_at) FILTER (WHERE state IN ('pending', 'processing')) AS oldest_pending_age,
       now() - min(claimed_at) FILTER (WHERE state = 'processing')              AS oldest_lease_age,
       max(claimed_at)                                                          AS last_claim_at
  FROM outbox;

-- The row of outbox_health_row(), and the oldest xmin holder past the threshold with how many
-- there are: those columns read no outbox table, so they need none of the row's pinned plans.
CREATE OR REPLACE VIEW outbox_health AS
SELECT h.backlog, h.pending, h.processing, h.waiting_retry, h.dead, h.expired_leases, h.oldest_pending_age,
       h.last_claim_at, h.worker_claimed_last_minute, h.open_producers, h.oldest_producer_pid,
       h.oldest_producer_age, h.held_by_open_transactions,
       coalesce(x.holders, 0)::integer AS xmin_holders,
       x.kind              AS xmin_holder_kind,
       x.pid               AS xmin_holder_pid,
       x.name              AS xmin_holder_name,
       x.age               AS xmin_holder_age,
       x.state             AS xmin_holder_state,
       x.query             AS xmin_holder_query,
       x.application_name  AS xmin_holder_application
  FROM outbox_health_row() h
  LEFT JOIN LATERAL (SELECT x.kind, x.pid, x.name, x.age, x.state, x.query, x.application_name,
                            count(*) OVER () AS holders
                       FROM outbox_xmin_holders() x
                      WHERE x.past_threshold
                      ORDER BY x.xmin_age DESC NULLS LAST
                      LIMIT 1) x ON true;

COMMENT ON FUNCTION outbox_worker_idle() IS
    'Call on a dedicated session before sleeping: from its return until outbox_worker_busy() every insert into outbox NOTIFYs channel outbox. Claim once more after it returns.';

COMMENT ON FUNCTION outbox_claim(integer, interval, text) IS
    'Lease up to batch_size due events under a new lease_token: runs of up to max_run consecutive events per aggregate, oldest heads first, rows in id order; reclaims expired runs (one failed attempt for the run''s first event).';

COMMENT ON FUNCTION outbox_complete(bigint[], uuid) IS
    'Mark leased events published; returns how many were still held by lease_token (the rest changed nothing).';

COMMENT ON FUNCTION outbox_fail(bigint, uuid, text, boolean) IS
    'Record a failed attempt: returns ''pending'' (retry scheduled with backoff), ''dead'' (permanent or out of attempts), or NULL when lease_token no longer holds the event (nothing changed).';

COMMENT ON VIEW outbox_stats IS
    'One row: events per state, oldest undelivered event''s age, oldest running lease''s age, last claim time.';

COMMENT ON FUNCTION outbox_next_wakeup() IS
    'Earliest moment a retry becomes due or a lease expires (NULL if none; in the past if one just came due): how long an idle worker may sleep.';

COMMENT ON FUNCTION outbox_health_row() IS
    'The row of the outbox_health view (computed with index scans only).';

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

COMMENT ON TABLE outbox_idempotency IS
    'outboxpg: which event holds each idempotency key. Written by the insert trigger only.';

COMMENT ON FUNCTION outbox_idempotency_take(text, bigint) IS
    'Called by the insert trigger for an event with an idempotency_key: true if the event takes the key, false if an unfinished event holds it (the row is then not inserted).';

COMMENT ON FUNCTION outbox_idempotency_event(text) IS
    'The id of the event that holds an idempotency key (NULL: none). Once that event is finished the key is free again.';

COMMENT ON FUNCTION outbox_cancel(bigint[]) IS
    'Take not-yet-delivered events (pending, scheduled or not, and dead) out of the flow: discarded with reason ''cancelled''; the next event of their aggregate becomes claimable. A claimed event is left alone. Returns how many were cancelled.';

COMMENT ON FUNCTION outbox_heads_floor() IS
    'Called by outbox_claim: the time below which no head is due (the lower end of its index range), raised first when more than 20 ms old.';

COMMENT ON FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz) IS
    'The published events outbox_replay would copy with the same filters (combined with AND, at least one; created_at in [since, until)), in id order: its dry run.';

COMMENT ON FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean) IS
    'Re-send published events still in the table as new events, in their original order (filters as outbox_replay_candidates, at least one); same msg_id unless new_msg_id (JetStream drops a copy inside its duplicate window); header Outbox-Replay-Of names the original. Returns how many.';

COMMENT ON FUNCTION outbox_xmin_holders() IS
    'What holds back the xmin horizon (VACUUM of the outbox) in this database, the oldest first: sessions, prepared transactions, replication slots, walsenders; past_threshold: held longer than outbox_settings.xmin_warn_after (a slot: inactive).';

COMMENT ON VIEW outbox_health IS
    'One row, cheap (reads unfinished events, the intake row, the lock table and the server''s activity, never the bulk of published ones): backlog, oldest pending age, dead letters, expired leases, last claim and whether a worker claimed within the last minute, open producing transactions and what they hold back, and what holds back the xmin horizon past outbox_settings.xmin_warn_after.';

COMMENT ON COLUMN outbox_health.xmin_holders IS 'Holders of the xmin horizon past outbox_settings.xmin_warn_after (outbox_xmin_holders()): while they hold it, VACUUM removes no dead row version of the outbox and claims slow down.';

COMMENT ON COLUMN outbox_health.xmin_holder_kind IS 'The oldest of them: session, prepared transaction, replication slot; NULL when none.';

COMMENT ON COLUMN outbox_health.xmin_holder_pid IS 'Its backend pid (a session; a slot''s walsender); pg_terminate_backend(pid) ends a session.';

COMMENT ON COLUMN outbox_health.xmin_holder_name IS 'The prepared transaction''s gid or the replication slot''s name.';

COMMENT ON COLUMN outbox_health.xmin_holder_age IS 'How long it has held: since its transaction began (a session), since PREPARE (a prepared transaction); NULL for a slot.';

COMMENT ON COLUMN outbox_health.xmin_holder_state IS 'pg_stat_activity.state (e.g. idle in transaction); prepared; a slot: active or inactive.';

COMMENT ON COLUMN outbox_health.xmin_holder_query IS 'The start (200 characters) of the session''s current or last query.';

COMMENT ON COLUMN outbox_health.xmin_holder_application IS 'The session''s application_name.';

COMMENT ON COLUMN outbox_health.waiting_retry IS NULL;

-- 3. Nobody may call anything by default.
REVOKE EXECUTE ON FUNCTION
    outbox_wake_workers(), outbox_worker_idle(), outbox_worker_busy(),
    outbox_retry_delay(integer, interval, interval),
    outbox_claim(integer, interval, text), outbox_complete(bigint[], uuid),
    outbox_fail(bigint, uuid, text, boolean), outbox_release(bigint[], uuid),
    outbox_requeue(bigint[]), outbox_discard(bigint[], text),
    outbox_maintain(boolean), outbox_next_wakeup(), outbox_health_row(), outbox_commit_horizon(),
    outbox_commit_guard(), outbox_take_in(bigint, bigint, integer), outbox_refresh_heads(text[], text[]),
    outbox_aggregate_key(text, text)
FROM PUBLIC;

-- 6. Workers: the functions the worker calls, the two settings it reads at start, and the
--    one-row outbox_health for its metrics (counts and ages, no event data).
GRANT EXECUTE ON FUNCTION
    outbox_claim(integer, interval, text), outbox_complete(bigint[], uuid),
    outbox_fail(bigint, uuid, text, boolean), outbox_release(bigint[], uuid),
    outbox_next_wakeup(), outbox_worker_idle(), outbox_worker_busy(), outbox_maintain(boolean),
    outbox_health_row()
TO outbox_worker;

GRANT SELECT ON outbox_health TO outbox_worker;

-- 7. Operators: the views, the settings (read only), the repairs, and the events' metadata
--    for the inspection queries of sql/ (which events wait, on what, who holds a lease, why one
--    died) - but not payload and headers, the application's data.
GRANT SELECT ON outbox_stats, outbox_dead_letters, outbox_partitions, outbox_health, outbox_settings
    TO outbox_operator;

GRANT EXECUTE ON FUNCTION
    outbox_requeue(bigint[]), outbox_discard(bigint[], text), outbox_maintain(boolean), outbox_health_row()
TO outbox_operator;

-- 3. Nobody may call anything by default.
REVOKE EXECUTE ON FUNCTION
    outbox_aggregate_key(text, text), outbox_assign_id(), outbox_idempotency_take(text, bigint),
    outbox_idempotency_event(text), outbox_cancel(bigint[]),
    outbox_wake_workers(), outbox_worker_idle(), outbox_worker_busy(), outbox_next_wakeup(),
    outbox_retry_delay(integer, interval, interval), outbox_commit_guard(), outbox_commit_horizon(),
    outbox_heads_writing(), outbox_heads_floor(), outbox_take_in(bigint, bigint, integer),
    outbox_claim(integer, interval, text),
    outbox_refresh_heads(text[], text[]), outbox_complete(bigint[], uuid),
    outbox_fail(bigint, uuid, text, boolean), outbox_release(bigint[], uuid),
    outbox_extend(bigint[], uuid, interval),
    outbox_requeue(bigint[]), outbox_discard(bigint[], text),
    outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz),
    outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean),
    outbox_maintain(boolean), outbox_idempotency_forget(integer),
    outbox_open_producers(), outbox_health_row(), outbox_xmin_holders(), outbox_unfinished_subjects(integer)
FROM PUBLIC;

-- The trigger takes idempotency keys as the producer; outboxpg.enqueue asks which event holds one.
GRANT EXECUTE ON FUNCTION outbox_idempotency_take(text, bigint), outbox_idempotency_event(text)
    TO outbox_producer;

-- 6. Workers: the functions the worker calls, the two settings it reads at start, and the
--    one-row outbox_health for its metrics (counts and ages, no event data).
GRANT EXECUTE ON FUNCTION
    outbox_claim(integer, interval, text), outbox_complete(bigint[], uuid),
    outbox_fail(bigint, uuid, text, boolean), outbox_release(bigint[], uuid),
    outbox_extend(bigint[], uuid, interval),
    outbox_next_wakeup(), outbox_worker_idle(), outbox_worker_busy(), outbox_maintain(boolean),
    outbox_idempotency_forget(integer), outbox_unfinished_subjects(integer),
    outbox_health_row(), outbox_open_producers(), outbox_xmin_holders()
TO outbox_worker;

-- 7. Operators: the views, the settings (read only), the repairs, and the events' metadata
--    for the inspection queries of sql/ (which events wait, on what, who holds a lease, why one
--    died) - but not payload and headers, the application's data.
GRANT SELECT ON outbox_stats, outbox_dead_letters, outbox_failing, outbox_partitions, outbox_health,
                outbox_settings
    TO outbox_operator;

GRANT EXECUTE ON FUNCTION
    outbox_requeue(bigint[]), outbox_discard(bigint[], text), outbox_cancel(bigint[]),
    outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz),
    outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean),
    outbox_maintain(boolean), outbox_idempotency_forget(integer), outbox_idempotency_event(text),
    outbox_unfinished_subjects(integer), outbox_health_row(), outbox_open_producers(), outbox_xmin_holders()
TO outbox_operator;
