-- outboxpg schema: what an INSERT into outbox does.
--
--   INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES (...);
--   INSERT INTO outbox (..., deliver_at) VALUES (..., now() + interval '1 hour');   -- scheduled
--   INSERT INTO outbox (..., expires_at) VALUES (..., now() + interval '15 minutes');
--   INSERT INTO outbox (..., idempotency_key) VALUES (..., 'payment-7781');  -- a second one inserts nothing
--   INSERT INTO outbox (..., subject) VALUES (..., 'outbox.billing.invoice');   -- under subject_prefix
--   SET LOCAL outboxpg.traceparent = '00-4bf9...-00f0...-01';   -- copied into each event's headers
--   SELECT outbox_cancel(ARRAY[17, 18]);                         -- take your events out of the flow
--
-- The producers write only outbox; a BEFORE INSERT row trigger (outbox_assign_id) does the rest,
-- as the producer, with the idempotency keys' trigger after it, and the statement trigger of
-- 30_wakeup.sql wakes idle workers.
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
-- snapshot. Hash collisions of keys only hold back more. A deployment that never writes one
-- aggregate from two concurrent transactions can switch the guard off (UPDATE outbox_settings
-- SET commit_order_guard = false): claims then ignore the aggregates producers name; the
-- horizon still counts, since the claims' intake needs it.
--
-- Nothing a producer can set weakens this. The trigger keeps what it has announced in a
-- transaction-local setting, outboxpg.held_aggregates ('L:,k1,k2,' or 'L:all'), which any
-- session can also set. So the setting only says which locks to take, never that one may be
-- left out: every row takes its transaction's announcements again (a lock the transaction
-- holds already costs a look in its own lock table, no shared memory), and a value the trigger
-- could not have written (L above the last id handed out, or no L) counts as none. A forged
-- value can make a transaction hold back more, never less.
--
-- What producers write is checked here too, where their transaction can still correct it: an
-- explicit subject must be under subject_prefix or outbox_settings.allowed_subject_prefixes,
-- payload and headers at most max_event_bytes, deliver_at and expires_at finite (and deliver_at
-- at most max_deliver_delay ahead). The settings are read only for the rows that need them (an
-- explicit subject, a schedule, more than 64 KiB), so a plain event pays for none of it.
--
-- Each event records who wrote it (outbox.produced_by: session_user, a column producers may
-- not write): outbox_cancel and the idempotency keys act on the caller's own events only.
-- Producers still share the aggregates' order (an open transaction of one holds back the
-- aggregates it writes, whoever else writes them) and the broker's message ids (docs/privileges.md).
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
--   * the checks above, and the event's size (size_bytes);
--   * deliver_at: written into next_attempt_at, the column every claim waits on for retries, so
--     a scheduled event is a pending event whose first attempt is not due yet: its head is
--     ready at that time, outbox_next_wakeup() says when, and nothing else changes;
--   * trace context: outboxpg.traceparent (and outboxpg.tracestate), set for the transaction
--     by a producer that cannot build headers itself (a trigger, a stored procedure), goes into
--     the event's headers unless they hold a traceparent already (any case); a malformed one
--     fails the insert, naming the setting, since a consumer would drop it;
--   * the commit-order locks (above), then the id, so that the lock comes before the id.
-- The transaction's first event announces it: a producing transaction is open, (1868724336, 3);
-- it may commit ids above L, the last id handed out so far, -(L + 1) (NULL: none since the
-- sequence was made or reset; 0 then holds back every id); and which aggregate it writes,
-- (1868724337, key). Its later events' ids are above L too, so one L is enough: a claim reads
-- the lowest L of each open transaction. Another aggregate is named while the transaction names
-- at most commit_order_max_aggregates (the lock table is shared and finite); past that it holds
-- (1868724336, 4), which holds back every event above its L, and names no more. The settings
-- are read only when a transaction writes a second aggregate. Like the locks, the setting ends
-- with the transaction, and a rolled-back savepoint takes back both. PL/pgSQL sets up every
-- expression it evaluates once per transaction, and a one-event transaction pays for all of
-- them (bench/producer_instructions.py counts the cost).
CREATE OR REPLACE FUNCTION outbox_assign_id() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    held    text;       -- outboxpg.held_aggregates: 'L:,k1,k2,' or 'L:all'
    colon   integer;
    horizon bigint;     -- L
    keys    text;       -- ',k1,k2,' or 'all'
    key     text;
    trace   text;
    cfg     record;
BEGIN
    -- A row that has its id already is being moved, not produced (outbox_maintain).
    IF NEW.id IS NOT NULL THEN
        RETURN NEW;
    END IF;

    NEW.size_bytes := pg_column_size(NEW.payload) + pg_column_size(NEW.headers);
    IF NEW.size_bytes > 65536 OR NEW.subject IS NOT NULL OR NEW.deliver_at IS NOT NULL
       OR NEW.expires_at IS NOT NULL THEN
        SELECT s.max_event_bytes, s.subject_prefix, s.allowed_subject_prefixes, s.max_deliver_delay
          INTO cfg FROM outbox_settings s;
        IF NEW.size_bytes > cfg.max_event_bytes THEN
            RAISE EXCEPTION 'outbox: the event is % bytes (payload and headers), over outbox_settings.max_event_bytes (%)',
                            NEW.size_bytes, cfg.max_event_bytes
                USING ERRCODE = 'check_violation',
                      HINT = 'Keep large data elsewhere and send a reference, or raise max_event_bytes up to the broker''s limit.';
        END IF;
        IF NEW.subject IS NOT NULL
           AND NOT starts_with(NEW.subject || '.', cfg.subject_prefix || '.')
           AND NOT EXISTS (SELECT 1 FROM unnest(cfg.allowed_subject_prefixes) a(prefix)
                            WHERE starts_with(NEW.subject || '.', a.prefix || '.')) THEN
            RAISE EXCEPTION 'outbox: subject % is not under subject_prefix % nor outbox_settings.allowed_subject_prefixes',
                            NEW.subject, cfg.subject_prefix
                USING ERRCODE = 'check_violation',
                      HINT = 'An operator allows more with UPDATE outbox_settings SET allowed_subject_prefixes = ...';
        END IF;
        IF NOT isfinite(NEW.deliver_at) OR NEW.deliver_at > now() + cfg.max_deliver_delay THEN
            RAISE EXCEPTION 'outbox: deliver_at must be a finite time at most outbox_settings.max_deliver_delay (%) ahead, got %',
                            cfg.max_deliver_delay, NEW.deliver_at
                USING ERRCODE = 'check_violation';
        END IF;
        IF NOT isfinite(NEW.expires_at) THEN
            RAISE EXCEPTION 'outbox: expires_at must be a finite time, got %', NEW.expires_at
                USING ERRCODE = 'check_violation';
        END IF;
        IF NEW.deliver_at IS NOT NULL THEN
            NEW.next_attempt_at := NEW.deliver_at;
        END IF;
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
    colon := strpos(held, ':');
    IF colon BETWEEN 2 AND 19 AND left(held, colon - 1) ~ '^[0-9]+$' THEN
        horizon := left(held, colon - 1)::bigint;
        keys := substr(held, colon + 1);
    END IF;
    IF horizon IS NULL OR horizon > coalesce(pg_sequence_last_value('outbox_id_seq'), 0)
       OR (keys <> 'all' AND keys !~ '^,([0-9-]+,)*$') THEN
        -- The transaction's first event, or a value this trigger did not write: announce it.
        -- The aggregate's lock before the horizon's: a claim that sees this transaction's
        -- horizon sees what it holds back too, never a horizon with no aggregate beside it.
        horizon := coalesce(pg_sequence_last_value('outbox_id_seq'), 0);
        PERFORM pg_advisory_xact_lock_shared(1868724336, 3),
                pg_advisory_xact_lock_shared(1868724337, key::integer),
                pg_advisory_xact_lock_shared(-horizon - 1),
                set_config('outboxpg.held_aggregates', horizon || ':,' || key || ',', true);
    ELSIF keys = 'all' THEN
        PERFORM pg_advisory_xact_lock_shared(1868724336, 3),
                pg_advisory_xact_lock_shared(1868724336, 4),
                pg_advisory_xact_lock_shared(-horizon - 1);
    ELSIF strpos(keys, ',' || key || ',') > 0 THEN
        PERFORM pg_advisory_xact_lock_shared(1868724336, 3),
                pg_advisory_xact_lock_shared(1868724337, key::integer),
                pg_advisory_xact_lock_shared(-horizon - 1);
    ELSIF length(keys) - length(replace(keys, ',', '')) - 1     -- keys named so far
          < (SELECT s.commit_order_max_aggregates FROM outbox_settings s) THEN
        PERFORM pg_advisory_xact_lock_shared(1868724336, 3),
                pg_advisory_xact_lock_shared(1868724337, key::integer),
                pg_advisory_xact_lock_shared(-horizon - 1),
                set_config('outboxpg.held_aggregates', horizon || ':' || keys || key || ',', true);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(1868724336, 3),
                pg_advisory_xact_lock_shared(1868724336, 4),
                pg_advisory_xact_lock_shared(-horizon - 1),
                set_config('outboxpg.held_aggregates', horizon || ':all', true);
    END IF;
    NEW.id := nextval('outbox_id_seq');
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER outbox_assign_id
    BEFORE INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_assign_id();

-- Idempotent enqueue. An event written with an idempotency_key while an earlier event of the
-- same producer (produced_by) with the same key is not finished (pending, processing or dead) is
-- not inserted: the INSERT succeeds and writes no row (INSERT ... RETURNING returns none, COPY
-- counts it out), from any language, whatever partition the earlier event is in. Once the
-- earlier event is finished the key is free again. Keys are each producer's own: another login's
-- event with the same key is another event. Two transactions inserting one key at once: the
-- second waits on the first's key row (the primary key's uniqueness check), then sees it
-- committed (a duplicate) or rolled back (it takes the key). Under REPEATABLE READ or
-- SERIALIZABLE the second fails with a serialization error instead of waiting it out: retry the
-- transaction. A row with a key pays the key table's insert and, for a key seen before, a look at
-- the earlier event by id (one index probe per partition); a row without one pays nothing (the
-- trigger's WHEN clause is tested in C).
--
-- A trigger of its own, after outbox_assign_id (triggers of one kind fire in name order: the row
-- has its id), running as the owner: producers may neither read the keys nor see other events,
-- and nobody can take a key but by inserting its event (a trigger function cannot be called).
CREATE OR REPLACE FUNCTION outbox_take_idempotency_key() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    holder bigint;
BEGIN
    IF octet_length(NEW.idempotency_key) > 255 OR NEW.idempotency_key !~ '[^[:space:]]' THEN
        RAISE EXCEPTION 'outbox: idempotency_key must be 1 to 255 bytes and not blank, got %', left(NEW.idempotency_key, 40)
            USING ERRCODE = 'check_violation';
    END IF;
    LOOP
        -- Waits for a transaction that inserted the key and has not ended.
        INSERT INTO outbox_idempotency (produced_by, idempotency_key, event_id)
        VALUES (NEW.produced_by, NEW.idempotency_key, NEW.id)
        ON CONFLICT (produced_by, idempotency_key) DO NOTHING;
        IF FOUND THEN
            RETURN NEW;
        END IF;
        -- Taken. Each statement below sees what committed before it began.
        SELECT k.event_id INTO holder
          FROM outbox_idempotency k
         WHERE k.produced_by = NEW.produced_by AND k.idempotency_key = NEW.idempotency_key
           FOR UPDATE;
        CONTINUE WHEN NOT FOUND;            -- forgotten meanwhile: try again
        IF holder = NEW.id THEN
            RETURN NEW;                     -- this very event, moved by outbox_maintain
        END IF;
        IF EXISTS (SELECT 1 FROM outbox o WHERE o.id = holder AND o.unfinished) THEN
            RETURN NULL;                    -- a duplicate: no row
        END IF;
        UPDATE outbox_idempotency k
           SET event_id = NEW.id, looked_at = now()
         WHERE k.produced_by = NEW.produced_by AND k.idempotency_key = NEW.idempotency_key;
        RETURN NEW;
    END LOOP;
END;
$$;

CREATE OR REPLACE TRIGGER outbox_take_idempotency_key
    BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL)
    EXECUTE FUNCTION outbox_take_idempotency_key();

-- Which event holds one of the caller's keys: outboxpg.enqueue returns the earlier event's id and
-- says that the insert was a duplicate.
CREATE OR REPLACE FUNCTION outbox_idempotency_event(key text) RETURNS bigint
LANGUAGE sql
STABLE
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    SELECT k.event_id FROM outbox_idempotency k WHERE k.produced_by = session_user AND k.idempotency_key = key
$$;

COMMENT ON FUNCTION outbox_idempotency_event(text) IS
    'The id of the caller''s (session_user''s) event that holds an idempotency key (NULL: none). Once that event is finished the key is free again.';

-- Take the caller's own events (produced_by = session_user) that no worker holds out of the
-- flow: pending (scheduled or not) and dead ones become discarded with reason 'cancelled', and
-- the next event of their aggregate becomes claimable (outbox_discard does the work,
-- 60_dead_letters_replay.sql). Other producers' events are left alone (an operator discards
-- anyone's). An event a worker has claimed (processing) is not cancelled, it may be on the wire
-- already: the count says how many were. A claim and a cancel of one event are ordered by its
-- row lock: the loser sees the other's result and leaves the event alone.
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
    RETURN outbox_discard(ARRAY(SELECT o.id FROM outbox o WHERE o.id = ANY (ids) AND o.produced_by = session_user),
                          'cancelled');
END;
$$;

COMMENT ON FUNCTION outbox_cancel(bigint[]) IS
    'Take the caller''s own not-yet-delivered events (pending, scheduled or not, and dead) out of the flow: discarded with reason ''cancelled''; the next event of their aggregate becomes claimable. A claimed event, and other producers'' events, are left alone. Returns how many were cancelled.';
