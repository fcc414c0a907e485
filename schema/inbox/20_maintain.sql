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
