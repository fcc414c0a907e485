-- outboxpg schema: partitions, created ahead and dropped whole; what else keeps the tables small.
--
--   SELECT * FROM outbox_partitions;           -- each partition, its range and size
--   SELECT * FROM outbox_maintain();           -- create ahead, drop expired; one row per action
--   SELECT * FROM outbox_maintain(true);       -- dry run: what it would do
--   SELECT outbox_idempotency_forget();        -- forget the keys of finished events
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
-- Run it regularly (the worker does, hourly, under the same lock); the install creates the
-- first partitions.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE OR REPLACE VIEW outbox_partitions AS
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

CREATE OR REPLACE FUNCTION outbox_maintain(dry_run boolean DEFAULT false)
RETURNS TABLE (action text, partition text, range_start timestamptz, range_end timestamptz, detail text)
LANGUAGE plpgsql
-- Runs as its owner: workers run it on a schedule without any right on the tables.
SECURITY DEFINER
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
    -- New partitions get outbox_default's storage parameters (its fillfactor, 10_tables.sql).
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

-- Rows deleted by hand (DELETE FROM outbox ...; the functions never delete) and TRUNCATE take
-- their aggregates' heads along, so that no head is left pointing at nothing.
CREATE OR REPLACE FUNCTION outbox_forget_deleted() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    types text[];
    ids   text[];
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM outbox_heads;
        RETURN NULL;
    END IF;
    SELECT array_agg(g.aggregate_type), array_agg(g.aggregate_id) INTO types, ids
      FROM gone g WHERE g.unfinished;
    IF types IS NOT NULL THEN
        PERFORM outbox_refresh_heads(types, ids);
    END IF;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE TRIGGER outbox_forget_deleted
    AFTER DELETE ON outbox REFERENCING OLD TABLE AS gone
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_forget_deleted();
CREATE OR REPLACE TRIGGER outbox_forget_truncated
    AFTER TRUNCATE ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_forget_deleted();

-- Keys of finished events are forgotten here, not on the producers' path: a producer that
-- deleted or touched other keys' rows would make producers wait on each other, and deadlock
-- where two of them write several keys at once. The worker calls it with outbox_maintain()
-- (outboxpg-worker --maintenance-interval); any scheduler can call it: it is cheap when
-- there is nothing to do. So a key lives as long as its event is unfinished, and up to one
-- such interval after; only an event's insert takes a key, so keys cannot pile up beyond the
-- events that made them.
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
        SELECT k.produced_by, k.idempotency_key,
               EXISTS (SELECT 1 FROM outbox o WHERE o.id = k.event_id AND o.unfinished) AS held
          FROM outbox_idempotency k
         ORDER BY k.looked_at
         LIMIT max_keys
           FOR UPDATE SKIP LOCKED),
    gone AS (
        DELETE FROM outbox_idempotency k USING looked l
         WHERE k.produced_by = l.produced_by AND k.idempotency_key = l.idempotency_key AND NOT l.held
     RETURNING 1),
    kept AS (
        UPDATE outbox_idempotency k SET looked_at = now()
          FROM looked l
         WHERE k.produced_by = l.produced_by AND k.idempotency_key = l.idempotency_key AND l.held)
    SELECT count(*) INTO forgotten FROM gone;
    RETURN forgotten;
END;
$$;

COMMENT ON FUNCTION outbox_idempotency_forget(integer) IS
    'Forget up to max_keys idempotency keys whose event is finished (the oldest looked-at first); returns how many. The worker calls it with outbox_maintain().';
