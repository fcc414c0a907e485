-- Back to 0013's triggers: the settings read once per statement, the sequence read by a query.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

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
