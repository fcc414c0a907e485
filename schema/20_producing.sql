-- outboxpg schema: what an INSERT into outbox does.
--
--   INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES (...);
--   INSERT INTO outbox (..., deliver_at) VALUES (..., now() + interval '1 hour');   -- scheduled
--   INSERT INTO outbox (..., expires_at) VALUES (..., now() + interval '15 minutes');
--   INSERT INTO outbox (..., idempotency_key) VALUES (..., 'payment-7781');  -- a second one inserts nothing
--   SET LOCAL outboxpg.traceparent = '00-4bf9...-00f0...-01';   -- copied into each event's headers
--   SELECT outbox_cancel(ARRAY[17, 18]);                         -- take events out of the flow
--
-- The producers write only outbox; one BEFORE INSERT row trigger (outbox_assign_id) does the
-- rest, as the producer, and the statement trigger of 30_wakeup.sql wakes idle workers.
--
-- Commit order. Ids come from a sequence when a row is inserted, not when its transaction
-- commits: a transaction that inserted event 10 of an aggregate can still be open while event 11
-- of the same aggregate is committed and visible. The guard holds back, while a producing
-- transaction is open, the aggregates it wrote, and nothing else. The transaction announces them
-- with shared advisory locks (transaction level), which every session can see in pg_locks at
-- once, long before the rows become visible:
--
--   (1868724336, 3)    "a producing transaction is open" (lets a claim skip pg_locks when none is);
--   -(L + 1)           (one bigint) "this transaction may still commit ids above L", L being the
--                      last id handed out before its first event;
--   (1868724337, key)  per aggregate written, key = outbox_aggregate_key(type, id), taken before
--                      the row's id: a claim that sees an event committed with a higher id, and
--                      no lock on its aggregate, knows that no lower id of it can still appear;
--   (1868724336, 4)    "this transaction wrote more than commit_order_max_aggregates aggregates"
--                      (the lock table is shared and finite): it names no more of them, and holds
--                      back every event above its L instead.
--
-- outbox_claim reads them once per call (outbox_commit_guard, 40_claim.sql), before it takes its
-- snapshot. Hash collisions of keys only hold back more. Producers pay, per transaction, three
-- advisory locks and a setting with their first event, and one lock per further aggregate. A
-- deployment that never writes one aggregate from two concurrent transactions can switch the
-- guard off (UPDATE outbox_settings SET commit_order_guard = false): producers then name one
-- aggregate only, which claims ignore; the horizon stays, since the claims' intake needs it.
--
-- Lock keys: outboxpg uses the negative half of the one-bigint advisory lock space, -(L + 1),
-- (1868724336, 1 to 4) and the two-key spaces (1868724337, *) and (1868724338, *); 1868724336
-- is 'obxp'.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- The advisory lock key of an aggregate, as producers take it and claims look for it.
-- Schema-qualified built-ins: it is inlined into its callers, and may be called from any search_path.
CREATE OR REPLACE FUNCTION outbox_aggregate_key(aggregate_type text, aggregate_id text) RETURNS integer
LANGUAGE sql
IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.hashtext($1 OPERATOR(pg_catalog.||) '/' OPERATOR(pg_catalog.||) $2) $$;

COMMENT ON FUNCTION outbox_aggregate_key(text, text) IS
    'Second key of the advisory lock (1868724337, key) a producing transaction holds on each aggregate it wrote. Hash collisions only hold back more, never less.';

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

CREATE OR REPLACE TRIGGER outbox_assign_id
    BEFORE INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_assign_id();

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

COMMENT ON FUNCTION outbox_idempotency_take(text, bigint) IS
    'Called by the insert trigger for an event with an idempotency_key: true if the event takes the key, false if an unfinished event holds it (the row is then not inserted).';

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

COMMENT ON FUNCTION outbox_idempotency_event(text) IS
    'The id of the event that holds an idempotency key (NULL: none). Once that event is finished the key is free again.';

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

COMMENT ON FUNCTION outbox_cancel(bigint[]) IS
    'Take not-yet-delivered events (pending, scheduled or not, and dead) out of the flow: discarded with reason ''cancelled''; the next event of their aggregate becomes claimable. A claimed event is left alone. Returns how many were cancelled.';
