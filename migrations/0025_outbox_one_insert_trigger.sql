-- outboxpg 0025: one insert trigger instead of two.
--
-- 0013's statement trigger outbox_hold_horizon took, before each INSERT or COPY, the two locks
-- that announce a producing transaction ((1868724336, 3) and -(L + 1), see 0013's header). Only
-- the first of them in a transaction counts: later statements' horizons are higher, and a
-- claim reads the lowest horizon of each open transaction. So the row trigger outbox_assign_id
-- now takes them with its transaction's first event, before that event's id (where it already
-- reads the settings once), and the statement trigger goes. The locks, their order against the
-- ids and what claims read are as before. A rolled-back savepoint takes back its locks and the
-- transaction-local setting together, so the next event takes them again.
--
-- And the row trigger does less on the way of a transaction's only event, the common case: the
-- settings (commit_order_guard, commit_order_max_aggregates) are read only when a transaction
-- writes a second aggregate, its first aggregate is named whatever they say (so 0 names one, and
-- with the guard off the claims ignore the name), and the first event's locks go in one
-- statement. PL/pgSQL sets up every expression it evaluates once per transaction, and a
-- one-event transaction pays for all of them.
--
-- Measured (bench/producer_instructions.py, instructions per one-event INSERT transaction, each
-- its own transaction): 3451e34 426,000; 0024 558,000 (+31 %); this step 462,000 (+8 %).
--
-- The setting outboxpg.held_aggregates is the trigger's own, set for the transaction: an
-- application must not set it (outboxpg.name_aggregates is not used any more).
-- depends: 0023_outbox_trace_context
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

DROP TRIGGER outbox_hold_horizon ON outbox;
DROP FUNCTION outbox_hold_horizon();

-- 0023's function, reworked: the transaction's announcement with its first event, and fewer
-- expressions on the way of every event (each costs PL/pgSQL a setup per transaction).
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
        NEW.next_attempt_at := NEW.deliver_at;                                  -- 0021
    END IF;
    IF current_setting('outboxpg.traceparent', true) <> '' THEN                -- 0023
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
        RETURN NULL;    -- a duplicate: no row (0022)
    END IF;
    RETURN NEW;
END;
$$;
