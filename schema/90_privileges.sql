-- outboxpg schema: least privilege. Three group roles, and nothing for anybody else.
--
--   GRANT outbox_producer TO shop_app;       -- may INSERT events, nothing more
--   GRANT outbox_worker   TO outbox_relay;   -- may run the worker: claim, report, LISTEN, maintain
--   GRANT outbox_operator TO ops_alice;      -- may read the views and repair dead letters
--
-- The roles are NOLOGIN groups: applications and people log in with roles of their own that
-- are granted one of them (docs/privileges.md). Roles belong to the cluster, not to a database:
-- they are created here only when missing, so that every database (and every schema) outboxpg
-- is installed into shares the same three.
--
--   outbox_producer  INSERT into outbox, only the columns an event is made of (not
--                    produced_by, size_bytes, its state, attempts or created_at); SELECT of the
--                    id column only, for INSERT ... RETURNING id (outboxpg.enqueue); USAGE and
--                    SELECT of the id sequence and SELECT on outbox_settings, which the insert
--                    trigger uses as the producer; EXECUTE of outbox_cancel (its own events) and
--                    outbox_idempotency_event (which of its events holds a key). It cannot read
--                    events back. The insert trigger runs as the producer and only reads those,
--                    takes advisory locks and NOTIFYs (built-ins everyone may call); the keys'
--                    trigger runs as the owner. A trigger needs no EXECUTE grant to fire.
--   outbox_worker    EXECUTE of the functions the worker calls (claim, complete, fail,
--                    release, extend, next_wakeup, worker_idle, worker_busy, maintain,
--                    idempotency_forget, unfinished_subjects, health_row, open_producers,
--                    xmin_holders, untrusted_creators); SELECT of outbox_settings.subject_prefix,
--                    .allowed_subject_prefixes and .backoff_cap (the worker checks its JetStream
--                    stream against them at start); SELECT on
--                    outbox_health (its metrics: counts and ages only). LISTEN needs no
--                    privilege. It cannot read, change or delete events except through those
--                    functions, nor requeue or discard them.
--   outbox_operator  SELECT on the views and on outbox_settings, outbox_heads, outbox_intake and
--                    outbox_idempotency; EXECUTE of the repairs (requeue, discard, replay,
--                    cancel), outbox_maintain and the inspection functions; SELECT on every
--                    column of outbox except payload, headers and lease_token (the inspection
--                    queries in sql/ read the events' metadata); SELECT on yoyo's _yoyo_migration, where it
--                    exists (the command line checks the applied steps). It cannot read
--                    payloads, change events other than through the repair functions, claim, or
--                    change settings.
--
-- Functions are executable by PUBLIC by default: that is revoked from the outbox_* functions.
-- The functions that touch the tables are SECURITY DEFINER: they run as their owner (the role
-- that installed outboxpg), so that a worker can claim without any right on the table. Each of
-- them pins search_path to '<this schema>, pg_temp' (SET search_path FROM CURRENT):
-- pg_catalog is searched first, pg_temp last (and never for functions or operators), so a
-- caller's own tables, temporary tables, functions or operators cannot be slipped under them.
-- The install checks that before it grants anything.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- 1. The group roles, where missing.
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_worker', 'outbox_operator'] LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r);
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', r);
            EXECUTE format('COMMENT ON ROLE %I IS %L', r,
                           'outboxpg group role (docs/privileges.md); grant it to login roles');
        EXCEPTION
            -- Another database's install created it at the same moment.
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'outboxpg: role % does not exist and % may not create it', r, current_user
                    USING HINT = format('Have a DBA run: CREATE ROLE %I NOLOGIN; then run this step again.', r);
        END;
    END LOOP;
END $$;

-- 2. Every function that runs as its owner pins its search_path to this schema with pg_temp
--    last: refuse to go on otherwise.
DO $$
DECLARE
    bad text;
BEGIN
    SELECT string_agg(p.oid::regprocedure::text, ', ') INTO bad
      FROM pg_proc p
     WHERE p.pronamespace = current_schema()::regnamespace
       AND p.proname LIKE 'outbox\_%'
       AND p.prosecdef
       AND NOT coalesce(p.proconfig @> ARRAY[format('search_path=%I, pg_temp', current_schema())], false);
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'outboxpg: SECURITY DEFINER functions without search_path = %, pg_temp: %',
                        quote_ident(current_schema()), bad;
    END IF;
    -- Whoever may create objects in this schema can plant a function or operator that the
    -- SECURITY DEFINER functions would pick up, and run it as the owner (outbox_untrusted_creators).
    bad := outbox_untrusted_creators();
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'outboxpg: % may CREATE in schema %, where the SECURITY DEFINER outbox functions look up names: refusing to install',
                        bad, quote_ident(current_schema())
            -- A code of its own (class OB: outboxpg), so that outboxpg migrate can tell it apart.
            USING ERRCODE = 'OBX01',
                  HINT = format('REVOKE CREATE ON SCHEMA %I FROM %s; then install again (docs/privileges.md).',
                                current_schema(), bad);
    END IF;
END $$;

-- 3. Nobody may call anything by default.
REVOKE EXECUTE ON FUNCTION
    outbox_aggregate_key(text, text), outbox_assign_id(), outbox_take_idempotency_key(),
    outbox_idempotency_event(text), outbox_cancel(bigint[]),
    outbox_wake_workers(), outbox_worker_idle(), outbox_worker_busy(), outbox_next_wakeup(text),
    outbox_retry_delay(integer, interval, interval), outbox_commit_guard(), outbox_commit_horizon(),
    outbox_heads_writing(), outbox_heads_floor(), outbox_take_in(bigint, bigint, integer),
    outbox_intake_wait(), outbox_intake_remember(tid), outbox_intake_holders(),
    outbox_aggregate_bucket(text, text), outbox_shard_buckets(text), outbox_shards_enable(),
    outbox_shards_disable(), outbox_claim(integer, interval, text, bigint, text, boolean),
    outbox_refresh_heads(text[], text[]), outbox_complete(bigint[], uuid, timestamptz, timestamptz),
    outbox_fail(bigint, uuid, text, boolean, interval), outbox_release(bigint[], uuid),
    outbox_extend(bigint[], uuid, interval), outbox_warm_up(text),
    outbox_requeue(bigint[]), outbox_discard(bigint[], text),
    outbox_replay_check(bigint[], text, text, text, timestamptz, timestamptz, boolean),
    outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz, boolean),
    outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean, integer, boolean),
    outbox_maintain(boolean), outbox_forget_deleted(), outbox_idempotency_forget(integer),
    outbox_open_producers(), outbox_open_claims(), outbox_health_row(), outbox_xmin_holders(),
    outbox_unfinished_subjects(integer), outbox_untrusted_creators()
FROM PUBLIC;

-- 4. The schema itself: PUBLIC usually has USAGE (public schema); grant it where it has not.
DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_worker', 'outbox_operator'] LOOP
        IF NOT has_schema_privilege(r, current_schema(), 'USAGE') THEN
            EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), r);
        END IF;
    END LOOP;
END $$;

-- 5. Producers: write events, nothing else.
GRANT INSERT (aggregate_type, aggregate_id, event_type, payload, subject, headers, msg_id,
              deliver_at, idempotency_key, expires_at) ON outbox
    TO outbox_producer;
GRANT SELECT (id) ON outbox TO outbox_producer;                 -- INSERT ... RETURNING id
GRANT USAGE ON SEQUENCE outbox_id_seq TO outbox_producer;       -- nextval() in the insert trigger
-- The insert trigger runs as the producer: it reads the commit-order settings and the last
-- value of the id sequence, and names each aggregate by its key.
GRANT SELECT ON outbox_settings TO outbox_producer;
GRANT SELECT ON SEQUENCE outbox_id_seq TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox_aggregate_key(text, text) TO outbox_producer;
-- outboxpg.enqueue asks which of its events holds a key.
GRANT EXECUTE ON FUNCTION outbox_idempotency_event(text) TO outbox_producer;
GRANT EXECUTE ON FUNCTION outbox_cancel(bigint[]) TO outbox_producer;

-- 6. Workers: the functions the worker calls, the two settings it reads at start, and the
--    one-row outbox_health for its metrics (counts and ages, no event data).
GRANT EXECUTE ON FUNCTION
    outbox_claim(integer, interval, text, bigint, text, boolean), outbox_complete(bigint[], uuid, timestamptz, timestamptz),
    outbox_fail(bigint, uuid, text, boolean, interval), outbox_release(bigint[], uuid),
    outbox_extend(bigint[], uuid, interval), outbox_warm_up(text),
    outbox_next_wakeup(text), outbox_worker_idle(), outbox_worker_busy(), outbox_maintain(boolean),
    outbox_idempotency_forget(integer), outbox_unfinished_subjects(integer),
    outbox_health_row(), outbox_open_producers(), outbox_xmin_holders(), outbox_untrusted_creators()
TO outbox_worker;
GRANT SELECT (subject_prefix, backoff_cap, allowed_subject_prefixes) ON outbox_settings TO outbox_worker;
GRANT SELECT ON outbox_health TO outbox_worker;

-- 7. Operators: the views, the settings (read only), the repairs, and the events' metadata
--    for the inspection queries of sql/ (which events wait, on what, who holds a lease, why one
--    died) - but not payload and headers, the application's data.
GRANT SELECT ON outbox_stats, outbox_dead_letters, outbox_failing, outbox_partitions, outbox_health,
                outbox_settings
    TO outbox_operator;
-- The queue of aggregates, the intake cursor and the idempotency keys: what sql/health.sql and
-- the CLI look at.
GRANT SELECT ON outbox_heads, outbox_intake, outbox_idempotency TO outbox_operator;
GRANT EXECUTE ON FUNCTION
    outbox_requeue(bigint[]), outbox_discard(bigint[], text), outbox_cancel(bigint[]),
    outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz, boolean),
    outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean, integer, boolean),
    outbox_maintain(boolean), outbox_idempotency_forget(integer), outbox_idempotency_event(text),
    outbox_unfinished_subjects(integer), outbox_health_row(), outbox_open_producers(), outbox_open_claims(),
    outbox_xmin_holders(), outbox_untrusted_creators()
TO outbox_operator;
-- An aggregate's advisory lock key (a hash of its name): sql/health.sql matches the keys that open
-- producing transactions hold in pg_locks with the events they hold back.
GRANT EXECUTE ON FUNCTION outbox_aggregate_key(text, text) TO outbox_operator;
-- Which shard an aggregate is in (its bucket, the shard's buckets): for operators and workers
-- that run shards. Making or dropping the index shards need stays with the owner.
GRANT EXECUTE ON FUNCTION outbox_aggregate_bucket(text, text), outbox_shard_buckets(text)
    TO outbox_operator, outbox_worker;
-- Not lease_token: whoever holds it can report on a worker's events.
GRANT SELECT (id, created_at, aggregate_type, aggregate_id, event_type, subject, msg_id, state, attempts,
              next_attempt_at, locked_by, claimed_at, locked_until, last_error,
              published_at, dead_at, discarded_at, discard_reason,
              in_flow, unfinished,   -- what the partial indexes select on
              tableoid,              -- which partition an event is in
              deliver_at, idempotency_key, expires_at, produced_by, size_bytes, replay_of)
    ON outbox TO outbox_operator;
-- The outboxpg command line (status, maintain, dead) checks which steps are applied in yoyo's
-- bookkeeping table, when the schema was installed with yoyo (outboxpg migrate) rather than psql.
DO $$
BEGIN
    IF to_regclass('_yoyo_migration') IS NOT NULL THEN
        GRANT SELECT ON _yoyo_migration TO outbox_operator;
    END IF;
END $$;
