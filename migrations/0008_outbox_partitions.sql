-- outboxpg 0008: partitions, created ahead and dropped whole.
--
--   SELECT * FROM outbox_partitions;           -- each partition, its range and size
--   SELECT * FROM outbox_maintain();           -- create ahead, drop expired; one row per action
--   SELECT * FROM outbox_maintain(true);       -- dry run: what it would do
--
-- Published events are never deleted row by row: a partition is dropped as a whole once its
-- entire range is older than outbox_settings.retention and it holds only finished events
-- (published or discarded). One pending, leased or dead event keeps it, and is reported.
--
-- Partitions cover fixed-width ranges of created_at (outbox_settings.partition_width, aligned
-- to 2000-01-01 00:00 UTC) and are named outbox_pYYYYMMDDTHH24MISS after their start in UTC.
-- Inserts never fail for want of a partition: rows outside every range land in outbox_default,
-- and the next outbox_maintain() moves them into a partition of their own.
--
-- Run it regularly (the worker does, hourly, under the same lock); it creates the first
-- partitions when this file is applied.
-- depends: 0007_outbox_dead_letters 0006_outbox_report
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE VIEW outbox_partitions AS
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
 WHERE i.inhparent = 'outbox'::regclass;

COMMENT ON VIEW outbox_partitions IS 'Partitions of outbox with their created_at range and on-disk size.';

CREATE FUNCTION outbox_maintain(dry_run boolean DEFAULT false)
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

COMMENT ON FUNCTION outbox_maintain(boolean) IS
    'Create partitions ahead (and for rows in outbox_default); drop partitions past retention holding only finished events. One row per action: create, drop, keep (has unfinished events) or skip.';

-- The first partitions: the current range and partitions_ahead beyond it.
DO $$ BEGIN PERFORM outbox_maintain(); END $$;
