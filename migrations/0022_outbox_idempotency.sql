-- outboxpg 0022: idempotent enqueue.
--
--   INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, idempotency_key)
--   VALUES ('order', '42', 'paid', '{}', 'payment-7781');      -- a second one inserts nothing
--
-- An event written with an idempotency_key while an earlier event with the same key is not
-- finished (pending, processing or dead) is not inserted: the INSERT succeeds and writes no row
-- (INSERT ... RETURNING returns none, COPY counts it out), from any language, whatever partition
-- the earlier event is in. Once the earlier event is finished (published or discarded) the key is
-- free again. outbox_idempotency_event(key) says which event holds a key (outboxpg.enqueue uses
-- it to return the earlier event's id and say it was a duplicate).
--
-- How: a unique key cannot span the partitions of outbox (a unique index of a partitioned table
-- must hold the partition key, created_at), so the keys live in a table of their own,
-- outbox_idempotency (key -> the event that holds it). The insert trigger (outbox_assign_id)
-- calls outbox_idempotency_take for a row with a key; it returns false for a duplicate and the
-- trigger drops the row. Two transactions inserting one key at once: the second waits on the
-- first's key row (the primary key's uniqueness check), then sees it committed (a duplicate) or
-- rolled back (it takes the key). Under REPEATABLE READ or SERIALIZABLE the second fails with a
-- serialization error instead of waiting it out: retry the transaction.
--
-- Cost: a row without a key pays one IS NULL test. A row with one pays the key table's insert,
-- and for a key seen before, a look at the earlier event by id (one index probe per partition).
-- Keys of finished events are forgotten by outbox_idempotency_forget(), which the worker calls
-- with outbox_maintain() (any scheduler can call it: it is cheap when there is nothing to do).
-- Not on the producers' path: a producer that deleted or touched other keys' rows would make
-- producers wait on each other, and deadlock where two of them write several keys at once.
-- depends: 0012_outbox_privileges 0021_outbox_deliver_at
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

ALTER TABLE outbox ADD COLUMN idempotency_key text;
COMMENT ON COLUMN outbox.idempotency_key IS
    'Optional: while an event with this key is unfinished, another one with it is not inserted (0022).';

CREATE TABLE outbox_idempotency (
    idempotency_key text        PRIMARY KEY,
    event_id        bigint      NOT NULL,
    -- When the key was taken, or outbox_idempotency_forget() last found its event unfinished.
    looked_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_idempotency_looked_at_idx ON outbox_idempotency (looked_at);
COMMENT ON TABLE outbox_idempotency IS
    'outboxpg: which event holds each idempotency key (0022). Written by the insert trigger only.';

CREATE FUNCTION outbox_idempotency_take(key text, event_id bigint) RETURNS boolean
LANGUAGE plpgsql
-- Runs as its owner: producers may neither read the table nor see other events (0012).
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

CREATE FUNCTION outbox_idempotency_event(key text) RETURNS bigint
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    SELECT k.event_id FROM outbox_idempotency k WHERE k.idempotency_key = key
$$;

COMMENT ON FUNCTION outbox_idempotency_event(text) IS
    'The id of the event that holds an idempotency key (NULL: none). Once that event is finished the key is free again.';

CREATE FUNCTION outbox_idempotency_forget(max_keys integer DEFAULT 10000) RETURNS integer
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
        SELECT k.idempotency_key,
               EXISTS (SELECT 1 FROM outbox o WHERE o.id = k.event_id AND o.unfinished) AS held
          FROM outbox_idempotency k
         ORDER BY k.looked_at
         LIMIT max_keys
           FOR UPDATE SKIP LOCKED),
    gone AS (
        DELETE FROM outbox_idempotency k USING looked l
         WHERE k.idempotency_key = l.idempotency_key AND NOT l.held
     RETURNING 1),
    kept AS (
        UPDATE outbox_idempotency k SET looked_at = now()
          FROM looked l
         WHERE k.idempotency_key = l.idempotency_key AND l.held)
    SELECT count(*) INTO forgotten FROM gone;
    RETURN forgotten;
END;
$$;

COMMENT ON FUNCTION outbox_idempotency_forget(integer) IS
    'Forget up to max_keys idempotency keys whose event is finished (the oldest looked-at first); returns how many. The worker calls it with outbox_maintain().';

-- 0021's function, and the key.
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

REVOKE EXECUTE ON FUNCTION outbox_idempotency_take(text, bigint), outbox_idempotency_event(text),
    outbox_idempotency_forget(integer) FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_producer') THEN
        GRANT INSERT (idempotency_key) ON outbox TO outbox_producer;
        GRANT SELECT (idempotency_key) ON outbox TO outbox_operator;   -- as the other columns but payload and headers (0012)
        -- The trigger runs as the producer and calls it; outbox_idempotency_event for enqueue's answer.
        GRANT EXECUTE ON FUNCTION outbox_idempotency_take(text, bigint), outbox_idempotency_event(text)
            TO outbox_producer;
        GRANT EXECUTE ON FUNCTION outbox_idempotency_event(text) TO outbox_operator;
        GRANT EXECUTE ON FUNCTION outbox_idempotency_forget(integer) TO outbox_worker, outbox_operator;
        GRANT SELECT ON outbox_idempotency TO outbox_operator;
    END IF;
END $$;
