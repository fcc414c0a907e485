-- Back to 0024: the statement trigger outbox_hold_horizon (as 0020 left it) and 0023's row trigger.
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
    trace  text;
BEGIN
    -- A row that has its id already is being moved, not produced (outbox_maintain).
    IF NEW.id IS NOT NULL THEN
        RETURN NEW;
    END IF;
    IF NEW.deliver_at IS NOT NULL THEN
        NEW.next_attempt_at := NEW.deliver_at;
    END IF;
    trace := current_setting('outboxpg.traceparent', true);
    IF trace <> '' THEN     -- (nested: the headers are read only when it is set)
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

CREATE FUNCTION outbox_hold_horizon() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    -- Taken with the guard off too: the claims' intake cursor (0005) must not pass ids that an
    -- open transaction may still commit, or their events would never be taken in.
    -- "A producing transaction is open": lets a claim skip reading pg_locks when none is.
    PERFORM pg_advisory_xact_lock_shared(1868724336, 3);
    -- Every id this statement assigns is above L, the last id handed out before it (NULL: the
    -- sequence has handed out none since it was made or reset; 0 then holds back every id).
    PERFORM pg_advisory_xact_lock_shared(-coalesce(pg_sequence_last_value('outbox_id_seq'), 0) - 1);
    RETURN NULL;
END;
$$;

CREATE TRIGGER outbox_hold_horizon
    BEFORE INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_hold_horizon();
