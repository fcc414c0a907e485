-- Back to 0022: no trace context from settings.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

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
    IF NEW.deliver_at IS NOT NULL THEN
        NEW.next_attempt_at := NEW.deliver_at;
    END IF;
    most := current_setting('outboxpg.name_aggregates', true);
    IF most IS NULL OR most = '' THEN
        -- The transaction's first row: read the settings once.
        SELECT CASE WHEN s.commit_order_guard THEN s.commit_order_max_aggregates::text ELSE 'off' END
          INTO most
          FROM outbox_settings s;
        PERFORM set_config('outboxpg.name_aggregates', most, true);
    END IF;
    IF most <> 'off' THEN
        held := coalesce(current_setting('outboxpg.held_aggregates', true), '');
        IF held <> 'all' THEN
            key := outbox_aggregate_key(NEW.aggregate_type, NEW.aggregate_id)::text;
            IF strpos(held, ',' || key || ',') = 0 THEN
                -- Keys held so far: the commas, less one ('' holds none).
                n_held := length(held) - length(replace(held, ',', ''));
                IF greatest(n_held - 1, 0) < most::integer THEN
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
    IF NEW.idempotency_key IS NOT NULL AND NOT outbox_idempotency_take(NEW.idempotency_key, NEW.id) THEN
        RETURN NULL;    -- a duplicate: no row
    END IF;
    RETURN NEW;
END;
$$;
