-- outboxpg inbox, step 1: the files of schema/inbox/ in order.
--
-- Produced by tools/inbox_step.py from schema/inbox/: do not edit it. Once released, frozen.

-- ==== schema/inbox/10_inbox.sql ====
-- outboxpg inbox: which messages a consumer has processed, recorded in the consumer's own
-- transaction, in the consumer's own database (which needs no outbox: these files install alone).
--
--   BEGIN;
--   SELECT outbox_inbox_receive('billing', 'order-42-paid');   -- true: first time; false: done before
--   -- ... the consumer's own writes, only when it answered true ...
--   COMMIT;                                                    -- then ack the message to the broker
--
-- A message is processed exactly once as long as its id is remembered: the consumer's side effect
-- and the record of its id commit together or not at all, so a crash before the commit leaves
-- neither (the redelivery is processed), and a crash after it (before the ack) leaves both (the
-- redelivery answers false and is only acked).
--
-- How a duplicate is caught. The id is written with INSERT ... ON CONFLICT DO NOTHING under a
-- unique key: a duplicate whose first copy is committed conflicts at once; one whose first copy is
-- still being inserted by an open transaction waits for that transaction, then conflicts (it
-- committed: false) or inserts (it rolled back: true). Only a unique index gives that wait; a
-- SELECT does not see the other transaction's row and would let both proceed.
--
-- Retention by time partitions. Ids are dropped a whole partition at a time (outbox_inbox_maintain,
-- 20_maintain.sql), so the table is partitioned by time, and a unique index of a partitioned table
-- must include the partition key: it is unique per partition only. The partition key, bucket, is
-- the start of the receive time's slot of width outbox_inbox_settings.retention (aligned to
-- 2000-01-01 UTC). A receive in slot b writes the id twice, into slot b - 1 and slot b (one
-- statement, the older row first), and answers true only when both rows were new. A duplicate
-- received up to one retention later is in slot b or b + 1, and writes slot b, which already
-- holds the id: it conflicts there, through the unique index, with the wait above when the first
-- copy is not committed yet, across a slot boundary too (a receive just before the boundary and
-- its duplicate just after meet in the older slot). outbox_inbox_maintain drops a slot once the
-- slot after it is over (no receive writes it any more), so an id is remembered for at least one
-- retention and at most two. The cost is a second index entry per message.
--
-- Under REPEATABLE READ or SERIALIZABLE, a duplicate whose first copy committed after the
-- transaction's snapshot raises serialization_failure (40001) instead of answering: retry the
-- transaction, as for any conflict at those levels.
--
-- Changing retention changes the slots: ids received before the change are found only where the
-- old and the new slots overlap. Change it while no redelivery is expected, or not at all.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE TABLE outbox_inbox_settings (
    -- A boolean primary key that must be true: the table can hold exactly one row.
    singleton                 boolean  PRIMARY KEY DEFAULT true CHECK (singleton),
    -- How long an id is remembered at least (at most twice as long): longer than any redelivery.
    -- Also the width of a partition. date_bin() takes no months or years.
    retention                 interval NOT NULL DEFAULT '7 days'
        CHECK (retention >= interval '1 second' AND date_part('month', retention) = 0
               AND date_part('year', retention) = 0),
    -- Partitions outbox_inbox_maintain keeps ready beyond the current one.
    partitions_ahead          integer  NOT NULL DEFAULT 1 CHECK (partitions_ahead BETWEEN 1 AND 100),
    -- How long outbox_inbox_maintain waits for a partition's lock before leaving it to the next run.
    maintenance_lock_timeout  interval NOT NULL DEFAULT '1s' CHECK (maintenance_lock_timeout > interval '0')
);

COMMENT ON TABLE outbox_inbox_settings IS
    'The inbox''s settings, one row: retention (how long ids are remembered, at least), partitions_ahead, maintenance_lock_timeout.';

INSERT INTO outbox_inbox_settings DEFAULT VALUES;

CREATE TABLE outbox_inbox (
    consumer     text        NOT NULL CHECK (consumer <> '' AND octet_length(consumer) <= 200),
    msg_id       text        NOT NULL CHECK (msg_id <> '' AND octet_length(msg_id) <= 1000),
    -- The start of a retention slot: the receive's own, or the one before it (see above).
    bucket       timestamptz NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT statement_timestamp(),
    PRIMARY KEY (consumer, msg_id, bucket)
) PARTITION BY RANGE (bucket);

COMMENT ON TABLE outbox_inbox IS
    'The ids of the messages each consumer processed, two rows each (its slot and the one before); written by outbox_inbox_receive, dropped by partition by outbox_inbox_maintain.';

-- Rows outside every partition (the partitions were not kept ahead) land here; the next
-- outbox_inbox_maintain() moves them into partitions of their own.
CREATE TABLE outbox_inbox_default PARTITION OF outbox_inbox DEFAULT;

-- One statement, runs as its caller (who needs INSERT on outbox_inbox and SELECT on the settings,
-- both granted to outbox_consumer by 90_privileges.sql, and nothing more: no SELECT, UPDATE or
-- DELETE on the ids). No RETURNING and no conflict target: those would need SELECT.
CREATE OR REPLACE FUNCTION outbox_inbox_receive(consumer text, msg_id text) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    width    interval;
    slot     timestamptz;
    inserted integer;
BEGIN
    SELECT s.retention INTO STRICT width FROM outbox_inbox_settings s;
    slot := date_bin(width, statement_timestamp(), timestamptz '2000-01-01 00:00:00+00');
    -- The older slot first: every receive takes its rows in time order, so two of them never
    -- wait for each other in a circle.
    INSERT INTO outbox_inbox (consumer, msg_id, bucket)
    VALUES ($1, $2, slot - width), ($1, $2, slot)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    RETURN inserted = 2;
END;
$$;

COMMENT ON FUNCTION outbox_inbox_receive(text, text) IS
    'Record that consumer processes msg_id, in the caller''s transaction: true the first time, false when it was processed before (within retention). A concurrent duplicate waits for the first transaction: false if it commits, true if it rolls back.';

-- ==== schema/inbox/20_maintain.sql ====
-- outboxpg inbox: partitions, created ahead and dropped whole once no receive can need them.
--
--   SELECT * FROM outbox_inbox_partitions;        -- each partition, its range and size
--   SELECT * FROM outbox_inbox_maintain();        -- create ahead, drop expired; one row per action
--   SELECT * FROM outbox_inbox_maintain(true);    -- dry run: what it would do
--
-- Partitions are one retention slot wide (10_inbox.sql) and named outbox_inbox_pYYYYMMDDTHH24MISS
-- after their start in UTC. A receive in slot b writes slots b - 1 and b, so a partition is dropped
-- once its whole range ends at or before the start of slot b - 1: nothing writes or reads it again.
-- Run it regularly (a consumer may, on a timer: hourly is plenty); the install runs it once.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE OR REPLACE VIEW outbox_inbox_partitions AS
SELECT c.relname::text                           AS partition,
       bound.expr = 'DEFAULT'                    AS is_default,
       range.bounds[1]::timestamptz              AS range_start,
       range.bounds[2]::timestamptz              AS range_end,
       pg_total_relation_size(c.oid)             AS total_bytes,
       pg_size_pretty(pg_total_relation_size(c.oid)) AS total_size
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
 CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS expr) bound
 CROSS JOIN LATERAL (SELECT regexp_match(bound.expr, $re$FROM \('([^']+)'\) TO \('([^']+)'\)$re$) AS bounds) range
 WHERE i.inhparent = 'outbox_inbox'::regclass;

COMMENT ON VIEW outbox_inbox_partitions IS 'Partitions of outbox_inbox with their bucket range and on-disk size.';

CREATE OR REPLACE FUNCTION outbox_inbox_maintain(dry_run boolean DEFAULT false)
RETURNS TABLE (action text, partition text, range_start timestamptz, range_end timestamptz, detail text)
LANGUAGE plpgsql
-- Runs as its owner: a consumer runs it on a timer without any right to create or drop tables.
SECURITY DEFINER
SET search_path FROM CURRENT
-- Scopes the lock_timeout set below to this call.
SET lock_timeout = '1s'
AS $$
#variable_conflict use_column
DECLARE
    cfg      outbox_inbox_settings;
    t        timestamptz := clock_timestamp();
    origin   constant timestamptz := '2000-01-01 00:00:00+00';
    width    interval;
    slot     timestamptz;
    horizon  timestamptz;
    lo       timestamptz;
    hi       timestamptz;
    edge     timestamptz;
    name     text;
    stray    bigint;
    p        record;
BEGIN
    SELECT * INTO STRICT cfg FROM outbox_inbox_settings;
    width := cfg.retention;
    slot := date_bin(width, t, origin);
    -- Receives write the slot before the current one: everything that ends before it is done with.
    horizon := slot - width;

    -- One maintainer at a time (every consumer process may run this); a dry run takes no lock.
    IF NOT dry_run AND NOT pg_try_advisory_xact_lock(1868724336, 10) THEN
        RETURN QUERY SELECT 'skip', NULL::text, NULL::timestamptz, NULL::timestamptz,
                            'another outbox_inbox_maintain() is running';
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout',
                       (extract(epoch FROM cfg.maintenance_lock_timeout) * 1000)::bigint::text, true);

    -- 1. Create: the slot before the current one, the current one, partitions_ahead beyond it, and
    --    the slot of every row in the default partition that is not past the horizon.
    FOR lo IN
        SELECT b FROM generate_series(horizon, slot + width * cfg.partitions_ahead, width) AS b
        UNION
        SELECT DISTINCT date_bin(width, d.bucket, origin) FROM outbox_inbox_default d WHERE d.bucket >= horizon
        ORDER BY 1
    LOOP
        hi := lo + width;
        -- Fit between existing partitions (retention may have changed since they were made).
        LOOP
            SELECT max(ep.range_end) INTO edge FROM outbox_inbox_partitions ep
             WHERE NOT ep.is_default AND ep.range_start <= lo AND ep.range_end > lo;
            EXIT WHEN edge IS NULL OR lo >= hi;
            lo := edge;
        END LOOP;
        SELECT min(ep.range_start) INTO edge FROM outbox_inbox_partitions ep
         WHERE NOT ep.is_default AND ep.range_start > lo AND ep.range_start < hi;
        hi := coalesce(edge, hi);
        CONTINUE WHEN lo >= hi;

        name := 'outbox_inbox_p' || to_char(lo AT TIME ZONE 'UTC', 'YYYYMMDD"T"HH24MISS');
        SELECT count(*) INTO stray FROM outbox_inbox_default d WHERE d.bucket >= lo AND d.bucket < hi;
        IF dry_run THEN
            RETURN QUERY SELECT 'create', name, lo, hi,
                                CASE WHEN stray > 0 THEN format('would move %s rows from outbox_inbox_default', stray) END;
            CONTINUE;
        END IF;
        BEGIN
            IF stray = 0 THEN
                EXECUTE format('CREATE TABLE %I PARTITION OF outbox_inbox FOR VALUES FROM (%L) TO (%L)', name, lo, hi);
            ELSE
                -- Rows in the default partition would violate the new partition's range: move them
                -- into a fresh table first, then attach it.
                LOCK TABLE outbox_inbox_default IN ACCESS EXCLUSIVE MODE;
                EXECUTE format('CREATE TABLE %I (LIKE outbox_inbox INCLUDING DEFAULTS INCLUDING CONSTRAINTS)', name);
                EXECUTE format('WITH moved AS (DELETE FROM outbox_inbox_default WHERE bucket >= %L AND bucket < %L RETURNING *)
                                INSERT INTO %I SELECT * FROM moved', lo, hi, name);
                GET DIAGNOSTICS stray = ROW_COUNT;
                EXECUTE format('ALTER TABLE outbox_inbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)', name, lo, hi);
            END IF;
            RETURN QUERY SELECT 'create', name, lo, hi,
                                CASE WHEN stray > 0 THEN format('moved %s rows from outbox_inbox_default', stray) END;
        EXCEPTION
            WHEN lock_not_available THEN
                RETURN QUERY SELECT 'skip', name, lo, hi, 'lock not granted within maintenance_lock_timeout; next run';
            WHEN check_violation OR unique_violation THEN
                RETURN QUERY SELECT 'skip', name, lo, hi, 'rows arrived in outbox_inbox_default meanwhile; next run moves them';
        END;
    END LOOP;

    -- 2. Drop: partitions whose whole range ends at or before the horizon.
    FOR p IN
        SELECT * FROM outbox_inbox_partitions ep
         WHERE NOT ep.is_default AND ep.range_end <= horizon
         ORDER BY ep.range_start
    LOOP
        BEGIN
            IF NOT dry_run THEN
                EXECUTE format('DROP TABLE %I', p.partition);
            END IF;
            RETURN QUERY SELECT 'drop', p.partition, p.range_start, p.range_end, format('%s freed', p.total_size);
        EXCEPTION
            WHEN lock_not_available THEN
                RETURN QUERY SELECT 'skip', p.partition, p.range_start, p.range_end,
                                    'lock not granted within maintenance_lock_timeout; next run';
        END;
    END LOOP;

    -- 3. Rows in the default partition past the horizon (a receive that raced a drop): forgotten
    --    row by row, as their partition would have been.
    IF dry_run THEN
        SELECT count(*) INTO stray FROM outbox_inbox_default d WHERE d.bucket < horizon;
    ELSE
        DELETE FROM outbox_inbox_default d WHERE d.bucket < horizon;
        GET DIAGNOSTICS stray = ROW_COUNT;
    END IF;
    IF stray > 0 THEN
        RETURN QUERY SELECT 'forget', 'outbox_inbox_default', NULL::timestamptz, horizon,
                            format('%s expired rows', stray);
    END IF;
END;
$$;

COMMENT ON FUNCTION outbox_inbox_maintain(boolean) IS
    'Create inbox partitions ahead (and for rows in outbox_inbox_default); drop those no receive writes any more. One row per action: create, drop, forget (expired rows of the default partition) or skip.';

-- The first partitions: the slot before the current one, the current one and partitions_ahead beyond.
DO $$ BEGIN PERFORM outbox_inbox_maintain(); END $$;

-- ==== schema/inbox/90_privileges.sql ====
-- outboxpg inbox: least privilege. One group role, and nothing for anybody else.
--
--   GRANT outbox_consumer TO billing_app;    -- may record the messages it processes, and maintain
--
-- outbox_consumer is a NOLOGIN group (roles belong to the cluster: created here only when
-- missing, shared by every database the inbox is installed into). Its members may:
--   - EXECUTE outbox_inbox_receive, which runs as the caller: INSERT into outbox_inbox (the
--     columns consumer, msg_id and bucket) and SELECT on outbox_inbox_settings, which it reads;
--   - EXECUTE outbox_inbox_maintain, which runs as the owner (SECURITY DEFINER): it creates and
--     drops partitions, by retention only;
--   - SELECT outbox_inbox_partitions (names, ranges, sizes).
-- They cannot read, change or delete ids, drop or truncate partitions, or change the settings.
-- Functions are executable by PUBLIC by default: that is revoked from both.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- 1. The group role, where missing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_consumer') THEN
        BEGIN
            CREATE ROLE outbox_consumer NOLOGIN;
            COMMENT ON ROLE outbox_consumer IS 'outboxpg group role (docs/how-to/inbox.md); grant it to login roles';
        EXCEPTION
            -- Another database's install created it at the same moment.
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'outboxpg: role outbox_consumer does not exist and % may not create it', current_user
                    USING HINT = 'Have a DBA run: CREATE ROLE outbox_consumer NOLOGIN; then run this step again.';
        END;
    END IF;
END $$;

-- 2. The function that runs as its owner pins its search_path to this schema with pg_temp last,
--    and nobody but the owner (and roles that could act as it anyway) may create objects in this
--    schema, where it looks names up: refuse to go on otherwise.
DO $$
DECLARE
    bad text;
BEGIN
    SELECT string_agg(p.oid::regprocedure::text, ', ') INTO bad
      FROM pg_proc p
     WHERE p.pronamespace = current_schema()::regnamespace
       AND p.proname LIKE 'outbox\_inbox\_%'
       AND p.prosecdef
       AND NOT coalesce(p.proconfig @> ARRAY[format('search_path=%I, pg_temp', current_schema())], false);
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'outboxpg: SECURITY DEFINER functions without search_path = %, pg_temp: %',
                        quote_ident(current_schema()), bad;
    END IF;
    SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                      ', ' ORDER BY a.grantee <> 0, pg_get_userbyid(a.grantee)) INTO bad
      FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
     WHERE n.oid = current_schema()::regnamespace
       AND a.privilege_type = 'CREATE'
       AND (a.grantee = 0
            OR NOT (pg_has_role(a.grantee, n.nspowner, 'USAGE') OR pg_has_role(a.grantee, current_user, 'USAGE')
                    OR (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = a.grantee)));
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'outboxpg: % may CREATE in schema %, where outbox_inbox_maintain looks up names: refusing to install',
                        bad, quote_ident(current_schema())
            USING ERRCODE = 'OBX01',
                  HINT = format('REVOKE CREATE ON SCHEMA %I FROM %s; then install again.', current_schema(), bad);
    END IF;
END $$;

-- 3. Nobody may call anything by default.
REVOKE EXECUTE ON FUNCTION outbox_inbox_receive(text, text), outbox_inbox_maintain(boolean) FROM PUBLIC;

-- 4. The schema itself: PUBLIC usually has USAGE (public schema); grant it where it has not.
DO $$
BEGIN
    IF NOT has_schema_privilege('outbox_consumer', current_schema(), 'USAGE') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO outbox_consumer', current_schema());
    END IF;
END $$;

-- 5. Consumers: record ids (through the function, which runs as them), maintain, look at sizes.
GRANT EXECUTE ON FUNCTION outbox_inbox_receive(text, text), outbox_inbox_maintain(boolean) TO outbox_consumer;
GRANT INSERT (consumer, msg_id, bucket) ON outbox_inbox TO outbox_consumer;
GRANT SELECT ON outbox_inbox_settings TO outbox_consumer;
GRANT SELECT ON outbox_inbox_partitions TO outbox_consumer;
