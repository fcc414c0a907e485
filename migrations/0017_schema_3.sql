-- outboxpg release schema-3: takes a database of release schema-2 (its last step: 0016_schema_2) to schema/.
--
-- Produced by tools/schema_step.py (bin/schema-step) from schema/ and migrations/next/: do not
-- edit it. schema/ holds each object's definition and why; docs/migrations.md says how a
-- release is made. Once released (migrations/RELEASED) it is frozen.
-- depends: 0016_schema_2
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- Table changes of the next release, by hand: what CREATE OR REPLACE cannot do (tables, columns,
-- indexes, sequences, types, data, and DROPs of objects that go or change their signature).
-- Applied first; the functions, views, triggers, comments and grants of schema/ that changed
-- follow (tools/schema_step.py, docs/migrations.md). Emptied when a release is made.

-- The idempotency keys get a trigger of their own, in place of the function the insert trigger
-- called and producers could call themselves; outbox_claim and outbox_replay gain an argument,
-- and outbox_xmin_holders names a holder's role instead of its query. Made again below.
DROP FUNCTION outbox_idempotency_take(text, bigint);
DROP VIEW outbox_health;
DROP FUNCTION outbox_xmin_holders();
DROP FUNCTION outbox_claim(integer, interval, text);
DROP FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean);
-- outbox_fail takes the wait a destination asked for (retry_after).
DROP FUNCTION outbox_fail(bigint, uuid, text, boolean);
-- outbox_next_wakeup takes a shard.
DROP FUNCTION outbox_next_wakeup();
-- outbox_complete takes the events' created_at range (created_min, created_max).
DROP FUNCTION outbox_complete(bigint[], uuid);

-- outbox_stats and outbox_health count scheduled events apart from those waiting for a retry (a
-- column more, in the middle); outbox_replay_candidates takes include_replays. Made again below.
DROP VIEW outbox_stats;
DROP FUNCTION outbox_health_row();
DROP FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz);

ALTER TABLE outbox_settings
    ADD COLUMN allowed_subject_prefixes text[] NOT NULL DEFAULT '{}'
                       CONSTRAINT allowed_subject_prefixes_are_valid_nats_subjects CHECK (
                           -- each one as subject_prefix (subjects hold no space: joined by one,
                           -- the elements stay apart)
                           array_position(allowed_subject_prefixes, NULL) IS NULL
                           AND array_to_string(allowed_subject_prefixes, ' ') ~ ('^((?!_INBOX(\.| |$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*'
                                                                                 '( (?!_INBOX(\.| |$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*)*)?$')),
    ADD COLUMN max_event_bytes integer NOT NULL DEFAULT 1000000
                       CONSTRAINT max_event_bytes_at_least_64_kib CHECK (max_event_bytes >= 65536),
    ADD COLUMN max_deliver_delay interval NOT NULL DEFAULT '1 year'
                       CONSTRAINT max_deliver_delay_positive CHECK (max_deliver_delay > interval '0'),
    ADD COLUMN max_claim_bytes bigint NOT NULL DEFAULT 67108864
                       CONSTRAINT max_claim_bytes_positive CHECK (max_claim_bytes > 0);

-- The events and keys written before are the upgrading role's (their producers are not known):
-- producers cannot cancel them, an operator can discard them. No table rewrite: a default
-- that is not volatile is stored once for the rows there.
ALTER TABLE outbox ADD COLUMN produced_by text NOT NULL DEFAULT current_user;
ALTER TABLE outbox ALTER COLUMN produced_by SET DEFAULT session_user;
ALTER TABLE outbox ADD COLUMN size_bytes integer;
ALTER TABLE outbox_idempotency ADD COLUMN produced_by text NOT NULL DEFAULT current_user;
ALTER TABLE outbox_idempotency ALTER COLUMN produced_by DROP DEFAULT;
ALTER TABLE outbox_idempotency DROP CONSTRAINT outbox_idempotency_pkey,
    ADD CONSTRAINT outbox_idempotency_pkey PRIMARY KEY (produced_by, idempotency_key);

-- Operators no longer read lease tokens: whoever holds one can report on a worker's events.
REVOKE SELECT (lease_token) ON outbox FROM outbox_operator;

-- The intake gives the aggregates of the newest events heads ahead of a backlog; this marks how
-- far it has read them (outbox_take_in).
ALTER TABLE outbox_intake ADD COLUMN newest_id bigint NOT NULL DEFAULT 0;

-- A replay's copy names the event it copies, so that a replay copies originals only. Nullable
-- without a default: a change of the catalog alone, no table rewrite.
ALTER TABLE outbox ADD COLUMN replay_of bigint;

-- The intake reads its row where the last intake left it (outbox_take_in), not by a scan.
CREATE SEQUENCE outbox_intake_tid AS bigint MINVALUE 0 START 0;

COMMENT ON COLUMN outbox_settings.allowed_subject_prefixes IS
    'Prefixes (whole tokens) an explicit subject may have besides subject_prefix; any other subject is refused at INSERT.';

COMMENT ON COLUMN outbox_settings.max_event_bytes IS
    'The largest payload plus headers (jsonb bytes) an INSERT may write; at least 65536.';

COMMENT ON COLUMN outbox_settings.max_deliver_delay IS
    'How far ahead of now an INSERT may set deliver_at.';

COMMENT ON COLUMN outbox_settings.max_claim_bytes IS
    'The bytes of events (size_bytes) one outbox_claim hands out when the caller gives no max_bytes; one event always goes.';

COMMENT ON COLUMN outbox.replay_of IS
    'The event this one is a copy of (outbox_replay); NULL: written by a producer.';

COMMENT ON COLUMN outbox.produced_by IS
    'The login that wrote the event (session_user); set by the insert, never by the producer.';

COMMENT ON COLUMN outbox.size_bytes IS
    'payload and headers in bytes (jsonb), measured at insert.';

COMMENT ON SEQUENCE outbox_intake_tid IS
    'outboxpg: where the intake row''s current version lies (block * 65536 + line), as the last intake found it; read by outbox_take_in instead of a scan.';

COMMENT ON TABLE outbox_idempotency IS
    'outboxpg: which event holds each producer''s idempotency key. Written by the insert trigger only.';

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

COMMENT ON FUNCTION outbox_worker_idle() IS
    'Call on a dedicated session before sleeping: from its return until outbox_worker_busy() every insert into outbox NOTIFYs channel outbox. Claim once more after it returns, and each time a lock_timeout ends its wait (an open producing transaction can hold it back for long).';

-- When each head can be claimed: ready_at, or, while a run holds it, leased_until; now while
-- another transaction holds the intake row. A head that came due within the last second counts
-- too (it is returned, in the past: claim now): it may have come due between the worker's last
-- claim and this call. Heads the commit-order guard holds back are left out: the producer's
-- commit wakes the workers, and claiming them now finds nothing. A parked head wakes nobody: its
-- time running out makes nothing due. Index lookups only, pinned like the claim's (a plan made
-- from statistics taken during a burst must not turn into scans of whole partitions later).
CREATE OR REPLACE FUNCTION outbox_next_wakeup(shard text DEFAULT NULL) RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
-- Runs as its owner: a worker has no rights on the tables.
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
SET jit = off
AS $$
DECLARE
    g record;
    floor_at timestamptz := to_timestamp(coalesce(pg_sequence_last_value('outbox_heads_floor_us'), 0) / 1000000.0);
    buckets integer[] := outbox_shard_buckets(shard);     -- NULL: every aggregate
BEGIN
    SELECT * INTO g FROM outbox_commit_guard();
    IF NOT (SELECT s.commit_order_guard FROM outbox_settings s) THEN
        g.settled := g.last_id;
    END IF;
    -- Another transaction holds the intake row: claim now. A claim left open in its transaction
    -- (psql after BEGIN, until the server ends it: outbox_claim) keeps every claim from taking
    -- new events in, and when it ends, nothing announces the events it kept back (their
    -- notification is spent). A claim that finds the row still held and nothing to hand out
    -- waits for it up to a second (outbox_intake_wait): an idle worker claims about once a second
    -- until it ends, not at its poll. Another worker's claim running at this moment costs one
    -- claim more. The row itself is not touched (outbox_intake_holders).
    IF EXISTS (SELECT 1 FROM outbox_intake_holders()) THEN
        RETURN now();
    END IF;
    -- Leased heads sit among the due ones (ready_at passed), at or above the floor: a walk over
    -- the runs in flight, which is short whenever a worker is idle.
    RETURN least(
        (SELECT min(h.ready_at)
           FROM outbox_heads h
          WHERE h.ready_at > now() - interval '1 second'
            AND (buckets IS NULL OR (h.lock_key & 63) = ANY (buckets))
            AND (h.leased_until IS NULL OR h.leased_until <= h.ready_at)
            AND (h.ready_at > now()
                 OR h.head_id <= g.settled
                 OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))),
        (SELECT min(h.leased_until)
           FROM outbox_heads h
          WHERE h.ready_at >= floor_at AND h.ready_at <= now()
            AND (buckets IS NULL OR (h.lock_key & 63) = ANY (buckets))
            AND h.leased_until > h.ready_at
            AND NOT h.parked
            AND h.leased_until > now() - interval '1 second'
            AND (h.leased_until > now()
                 OR h.head_id <= g.settled
                 OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))));
END;
$$;

COMMENT ON FUNCTION outbox_next_wakeup(text) IS
    'Earliest moment a retry becomes due or a lease expires, or now while another transaction holds the intake row (NULL if none; in the past if one just came due): how long an idle worker may sleep. shard ''I/N'': of that shard''s aggregates only.';

-- The commit-order guard, read once per claim, from the producers' advisory locks
-- (20_producing.sql says which). Returns, in this order of reading:
--   last_id     the last id assigned before the call: every id assigned later is above it;
--   settled     no open transaction can still commit an id up to it;
--   open_below  ids up to it can be handed out unless their aggregate's key is in held_keys.
-- The caller takes its snapshot after this returns: a transaction that commits in between was
-- still counted here, so its events are either visible or held back.
CREATE OR REPLACE FUNCTION outbox_commit_guard(OUT last_id bigint, OUT settled bigint, OUT open_below bigint,
                                    OUT held_keys integer[])
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    free     boolean;   -- the producers' lock taken: no producing transaction is open
    seen     boolean;   -- a producing transaction's horizon lock was read
    unlocked boolean;
BEGIN
    held_keys := '{}';
    -- Four looks: each look that finds no producer open where one was open at its lock test
    -- saw one end inside its own reads, which takes a producer's whole transaction to fit in
    -- the time between two statements here. A test saw two such looks in a row once, on a
    -- machine loaded far beyond its cores; four in a row are left to chance.
    FOR look IN 1..4 LOOP
        -- The lock first, then the last id. With the lock taken, no producing transaction is
        -- open and none takes an id until it is let go (the trigger takes it, shared, before
        -- nextval): every id handed out so far is settled. It is let go in the statement that
        -- reads the id (the tuple is read before the projection unlocks), so producers wait no
        -- longer than for the lock alone. Without it, the id is read before the locks below: an
        -- id handed out after this read is above it, and a transaction that handed out one up to
        -- it and is still open shows its locks there. (On a sequence never used yet, last_value
        -- is the next id, not the last one.)
        free := pg_try_advisory_lock(1868724336, 3);
        SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END,
               CASE WHEN free THEN pg_advisory_unlock(1868724336, 3) END
          INTO last_id, unlocked FROM outbox_id_seq;
        IF free THEN
            settled := last_id;
            open_below := last_id;
            RETURN;
        END IF;
        WITH l AS MATERIALIZED (
            SELECT l.pid, l.classid, l.objid, l.objsubid
              FROM pg_locks l
             WHERE l.locktype = 'advisory'
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND l.pid <> pg_backend_pid()),
        horizon AS (
            SELECT l.pid, -((l.classid::bigint << 32) | l.objid::bigint) - 1 AS below
              FROM l
             WHERE l.objsubid = 1 AND l.classid >= 2147483648)   -- negative one-bigint keys
        SELECT least(last_id, (SELECT min(h.below) FROM horizon h)),
               least(last_id, (SELECT min(h.below) FROM horizon h
                                 WHERE h.pid IN (SELECT w.pid FROM l w
                                                  WHERE w.objsubid = 2 AND w.classid = 1868724336 AND w.objid = 4))),
               coalesce((SELECT array_agg(DISTINCT (a.objid::bigint - CASE WHEN a.objid::bigint >= 2147483648
                                                                         THEN 4294967296 ELSE 0 END)::integer)
                           FROM l a WHERE a.objsubid = 2 AND a.classid = 1868724337), '{}'),
               EXISTS (SELECT FROM horizon)
          INTO settled, open_below, held_keys, seen;
        -- None open any more: the ones that held the lock ended since, maybe after the read of
        -- last_id, half way through a transaction whose end would then wait for the next claim.
        -- Try the lock again. (After the last look, settled is that last_id: still true, since
        -- the transaction that held ids up to it has ended, only short of its end.)
        EXIT WHEN seen;
    END LOOP;
END;
$$;

-- The floor, raised first if it is more than 20 ms old.
CREATE OR REPLACE FUNCTION outbox_heads_floor() RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    floor_at    timestamptz := to_timestamp(coalesce(pg_sequence_last_value('outbox_heads_floor_us'), 0) / 1000000.0);
    at          timestamptz := clock_timestamp();
    at_cs       bigint := floor(extract(epoch FROM at) * 100)::bigint;     -- `at` in the writers' unit
    writers     timestamptz;
    first_ready timestamptz;
    raised      timestamptz;
BEGIN
    IF floor_at > at THEN
        -- The clock went back: no floor until the next call raises one from the start.
        PERFORM setval('outbox_heads_floor_us', 0);
        RETURN '-infinity';
    END IF;
    IF floor_at > at - interval '20 milliseconds'
       OR current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN floor_at;
    END IF;
    -- The first head, read twice. A floor that it does not let rise by 20 ms or more stays as
    -- it is, before the read of pg_locks, which takes every lock partition's lock and scans
    -- every backend's locks: behind an old due head (a backlog), that is every claim, and
    -- staying low is always safe. Otherwise first the writers at work (the caller's own lock
    -- among them), then, in a snapshot taken after that, the first head again: a writer that
    -- ends in between is seen by one or the other.
    FOR look IN 1..2 LOOP
        SELECT h.ready_at INTO first_ready
          FROM outbox_heads h
         WHERE h.ready_at >= floor_at
         ORDER BY h.ready_at
         LIMIT 1;
        EXIT WHEN look = 2;
        IF first_ready < floor_at + interval '20 milliseconds' THEN
            RETURN floor_at;
        END IF;
        -- Ages are taken modulo 2^32 centiseconds (a lock newer than `at` has a negative age).
        -- The result is the lock's own centisecond, at or before the moment it was taken.
        SELECT to_timestamp((at_cs - max(CASE WHEN a.age >= 2147483648 THEN a.age - 4294967296 ELSE a.age END)) / 100.0)
          INTO writers
          FROM (SELECT ((at_cs - l.objid::bigint) % 4294967296 + 4294967296) % 4294967296 AS age
                  FROM pg_locks l
                 WHERE l.locktype = 'advisory' AND l.classid = 1868724338 AND l.objsubid = 2
                   AND l.database = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())) a;
    END LOOP;
    raised := least(at, writers, first_ready);      -- least ignores NULLs
    IF raised > floor_at THEN
        PERFORM setval('outbox_heads_floor_us', floor(extract(epoch FROM raised) * 1000000)::bigint);
        RETURN raised;
    END IF;
    RETURN floor_at;
END;
$$;

COMMENT ON FUNCTION outbox_heads_floor() IS
    'Called by outbox_claim: the time below which no head is due (the lower end of its index range), raised first when more than 20 ms old and the first head lets it rise by 20 ms or more.';

-- Note where the intake row's version lies (outbox_intake_tid), for the next intake to read it
-- there. setval is not undone by a rollback: the next intake then finds no version there and
-- scans (outbox_take_in).
CREATE OR REPLACE FUNCTION outbox_intake_remember(at_tid tid) RETURNS void
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT setval('outbox_intake_tid', (p[0])::bigint * 65536 + (p[1])::bigint)
      FROM (SELECT at_tid::text::point AS p) t
$$;

COMMENT ON FUNCTION outbox_intake_remember(tid) IS
    'Called by outbox_take_in: notes where the intake row''s current version lies (outbox_intake_tid).';

-- Take newly committed events into outbox_heads: up to `chunk` in-flow events above the intake
-- cursor, oldest first. Returns the cursor afterwards, or NULL when another claim is taking in
-- right now (one at a time: the others skip it rather than wait).
--
-- The intake row is locked once per claim and written by the ctid it locked (a TID scan reads
-- that version only): the cursor and last_claim_at in one update. Readers that do not move the
-- cursor (a report; a claim whose intake found the row locked) read outbox_intake_mark instead:
-- the intake sets it to the cursor it locked, which is committed, before moving the cursor in
-- its own transaction, so the mark is never above the cursor, whatever commits or rolls back.
-- A mark below the cursor is safe where it is used: it only lowers where a reader starts
-- looking along an aggregate's line, least(head_id, mark + 1), and no unfinished event of an
-- aggregate lies below its head_id at or under the cursor (the intake moved the head back to
-- it). Such a reader may read a few index entries more; it finds the same first event.
CREATE OR REPLACE FUNCTION outbox_take_in(settled bigint, last_id bigint, chunk integer) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
-- Group the new events by aggregate in a hash table, not by sorting all of them.
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    upto    bigint;
    row_tid tid;                                -- the version of the intake row locked
    noted   timestamptz;                        -- its last_claim_at
    types   text[];
    ids     text[];
    firsts  bigint[];
    busy      bigint[] := '{}';                 -- places in types / ids / firsts of busy aggregates
    live_tids tid[];                            -- their heads, found and locked
    live_ns   bigint[];                         -- their places
    live_change boolean[];                      -- and whether the head moves (parked, or head_id above)
    held_from bigint;                           -- the first event of one whose head another holds
    known     bigint[];                         -- places of the other aggregates whose head exists
    k_ns      bigint[];                         -- those whose head was found and locked (then the
    k_tids    tid[];                            -- busy ones' too, below), the versions locked,
    k_change  boolean[];                        -- and whether the head moves (parked, or head_id above)
    moved_ns  bigint[];                         -- the places of the heads moved, of either kind
    k_missing bigint;                           -- those with no head
    k_made    bigint[];                         -- the heads made for them (their opened_id)
    seen    bigint;
    top     bigint;
    at      timestamptz := clock_timestamp();   -- one time for all the heads made here
    -- The aggregates of the newest events, when a backlog lies between them and the cursor.
    new_types  text[];
    new_ids    text[];
    new_firsts bigint[];
    back_tids  tid[];                           -- their parked heads, to bring back
    newest     bigint;                          -- outbox_intake.newest_id
    new_top    bigint;
    remembered bigint := pg_sequence_last_value('outbox_intake_tid');
    known_tid  tid;                             -- where the last intake left the row
    new_tid    tid;                             -- where this one leaves it
BEGIN
    -- The row where the last intake left it (outbox_intake_tid): a TID scan of one version,
    -- where a scan of the table would look at every version a held snapshot keeps. Seen there
    -- but not locked: another claim's intake holds it. Not seen (that claim rolled back after
    -- writing it, the row was written by another hand, VACUUM FULL moved it): the scan.
    IF remembered IS NOT NULL THEN
        known_tid := format('(%s,%s)', remembered >> 16, remembered & 65535)::tid;
        SELECT i.intake_id, i.ctid, i.last_claim_at, i.newest_id INTO upto, row_tid, noted, newest
          FROM outbox_intake i WHERE i.ctid = known_tid FOR UPDATE SKIP LOCKED;
        IF NOT FOUND AND EXISTS (SELECT FROM outbox_intake i WHERE i.ctid = known_tid) THEN
            RETURN NULL;
        END IF;
    END IF;
    IF row_tid IS NULL THEN
        SELECT i.intake_id, i.ctid, i.last_claim_at, i.newest_id INTO upto, row_tid, noted, newest
          FROM outbox_intake i FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        PERFORM outbox_intake_remember(row_tid);
    END IF;
    -- The cursor as locked is committed: the mark may go up to it.
    IF upto > coalesce(pg_sequence_last_value('outbox_intake_mark'), 0) THEN
        PERFORM setval('outbox_intake_mark', upto);
    END IF;
    -- Monitors ask "is a worker claiming?" (outbox_health): to the second, so that a busy
    -- worker does not write the row for that alone. Written with the cursor below, by ctid.
    noted := CASE WHEN noted IS NULL OR noted < at - interval '1 second' THEN at END;
    IF upto >= last_id THEN
        IF noted IS NOT NULL THEN
            UPDATE outbox_intake i SET last_claim_at = noted WHERE i.ctid = row_tid RETURNING i.ctid INTO new_tid;
            PERFORM outbox_intake_remember(new_tid);
        END IF;
        RETURN upto;
    END IF;

    -- One row per aggregate among the new events, with its first event.
    SELECT array_agg(a.aggregate_type ORDER BY a.aggregate_type, a.aggregate_id),
           array_agg(a.aggregate_id ORDER BY a.aggregate_type, a.aggregate_id),
           array_agg(a.first_id ORDER BY a.aggregate_type, a.aggregate_id),
           sum(a.n), max(a.top)
      INTO types, ids, firsts, seen, top
      FROM (SELECT e.aggregate_type, e.aggregate_id, min(e.id) AS first_id, count(*) AS n, max(e.id) AS top
              FROM (SELECT o.id, o.aggregate_type, o.aggregate_id
                      FROM outbox o
                     WHERE o.in_flow
                       AND o.id > upto AND o.id <= last_id
                     ORDER BY o.id
                     LIMIT chunk) e
             GROUP BY e.aggregate_type, e.aggregate_id) a;

    IF types IS NOT NULL THEN
        -- New heads are inserted; a head that exists is locked (in key order, as reports lock
        -- them; against reports, not claims: below), so that a report about to drop it because
        -- it saw no more events of its aggregate waits for this transaction and then sees these
        -- events (outbox_refresh_heads). An event that committed late below its aggregate's head (it
        -- was held back by the commit-order guard meanwhile) moves the head back to it.
        -- A new head is due now, whatever this statement's snapshot said of its event: while
        -- the cursor is held back, events read here may have been claimed, or even published
        -- and their head dropped, since (a run reads its aggregate's line beyond the cursor).
        -- The claim that takes the head finds the truth (a lease running: it waits for its end;
        -- no event left: the head is dropped).
        -- A busy aggregate's head is kept, parked, between two of its events
        -- (outbox_refresh_heads). Its key then has a live version at the newest of its entries,
        -- where INSERT ... ON CONFLICT reads every entry of the key from the oldest before it
        -- reaches it: the heads of busy aggregates are looked up from the newest entry of their
        -- key down (as outbox_refresh_heads finds them). Busy: an event among the ones just
        -- below the cursor (twice as many as this intake read, 50 to 500), looked for only when
        -- this intake read fewer than a chunk: one catching up on a backlog reads chunks of
        -- thousands, and its insert brings parked heads back as well. Not every key: for a key
        -- with no live head (dropped, to be made again) that look reads all of its entries, and
        -- the insert's check then reads them again.
        IF seen < chunk THEN
            busy := ARRAY(SELECT s.n
                            FROM unnest(types, ids) WITH ORDINALITY AS s(t, i, n)
                           WHERE outbox_aggregate_key(s.t, s.i) = ANY (         -- a collision: one look more
                                 ARRAY(SELECT outbox_aggregate_key(o.aggregate_type, o.aggregate_id)
                                         FROM outbox o
                                        WHERE o.id > upto - least(greatest(2 * seen, 50), 500)
                                          AND o.id <= upto)));
        END IF;

        -- Lock order. Reports lock heads in one pass in key order, and wait. The intake may wait
        -- only in a pass of the same kind, holding no head yet: the other aggregates' heads that
        -- exist, all in key order in one statement (below), waiting for a report that holds them.
        -- The rest never waits (SKIP LOCKED, ON CONFLICT DO NOTHING): holding that pass's
        -- heads, a wait there could close a circle with a report that holds one of them and
        -- waits for another. New heads inserted before that pass are seen by no one else until
        -- this transaction commits, so no one waits for them either.
        -- A head that exists is locked FOR KEY SHARE: that is what a report must wait for (its
        -- FOR UPDATE), and all; the claims' locks (FOR NO KEY UPDATE, and their updates, which
        -- change no key) pass beside it. So the other claims go on taking these heads while this
        -- one runs, where a stronger lock (an ON CONFLICT update's) kept every head of the
        -- chunk from them until this claim committed: behind a backlog of a few aggregates,
        -- every claim but the one taking in found all of them locked and came back empty.
        -- Which comes first, the insert or the look for existing heads, follows what most keys
        -- are: in a flow (fewer than a chunk read), aggregates whose head was dropped since their
        -- last event, inserted first (the look would read all of a dropped key's entries, and the
        -- insert's check again); catching up on a backlog, aggregates whose head is there (a
        -- chunk's events are the later ones of aggregates not handed out yet), looked for first,
        -- and the insert is for the others only: one look at each key either way.
        -- opened_id, the first event's id, orders the heads made here among themselves.
        IF seen < chunk THEN
            WITH made AS (
                INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at, opened_id)
                -- The clock, not now(): a head's ready_at is never below the time its writer
                -- announced (outbox_heads_writing); the claim reads its own time after this.
                SELECT s.t, s.i, outbox_aggregate_key(s.t, s.i), s.f, at, s.f
                  FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
                 WHERE s.n <> ALL (busy)
                ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING
                RETURNING h.opened_id)
            -- The others: an aggregate's first event here is its own (one per aggregate), and a
            -- head made here has it as opened_id; counted in a hash table, not pair by pair.
            SELECT array_agg(x.n) INTO known
              FROM (SELECT u.f, max(u.n) AS n, count(*) AS c
                      FROM (SELECT s.f, s.n
                              FROM unnest(firsts) WITH ORDINALITY AS s(f, n)
                             WHERE s.n <> ALL (busy)
                             UNION ALL
                            SELECT m.opened_id, NULL FROM made m) u
                     GROUP BY u.f) x
             WHERE x.c = 1;
        ELSE
            known := ARRAY(SELECT generate_series(1, cardinality(types)::bigint));   -- busy is empty
        END IF;

        IF known IS NOT NULL THEN
            -- Their heads, each from the newest entry of its key down to the first version this
            -- sees (the newest, once locked: a head updated meanwhile is read as it is now); NULL
            -- where there is none.
            SELECT array_agg(s.n), array_agg(h.tid), array_agg(h.parked OR h.head_id > firsts[s.n]),
                   count(*) FILTER (WHERE h.tid IS NULL)
              INTO k_ns, k_tids, k_change, k_missing
              FROM (SELECT types[k.n] COLLATE "C" AS t, ids[k.n] COLLATE "C" AS i, k.n
                      FROM unnest(known) AS k(n)
                     ORDER BY 1, 2) s
              LEFT JOIN LATERAL (
                   SELECT h.ctid AS tid, h.parked, h.head_id FROM outbox_heads h
                    WHERE h.aggregate_type = s.t
                      AND h.aggregate_id >= s.i AND h.aggregate_id <= s.i
                    ORDER BY h.aggregate_type DESC, h.aggregate_id DESC
                    LIMIT 1
                      FOR KEY SHARE) h ON true;
            IF k_missing > 0 THEN
                -- No head: made now (catching up, the new aggregates; in a flow, heads gone since
                -- the insert above, a report dropped one while this waited for it). One that is
                -- there again is left to the next intake.
                WITH made AS (
                    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at, opened_id)
                    SELECT types[k.n], ids[k.n], outbox_aggregate_key(types[k.n], ids[k.n]), firsts[k.n], at, firsts[k.n]
                      FROM unnest(k_ns, k_tids) AS k(n, tid)
                     WHERE k.tid IS NULL
                    ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING
                    RETURNING h.opened_id)
                SELECT array_agg(m.opened_id) INTO k_made FROM made m;
                IF coalesce(cardinality(k_made), 0) < k_missing THEN
                    held_from := least(held_from, (SELECT min(firsts[k.n]) FROM unnest(k_ns, k_tids) AS k(n, tid)
                                                    WHERE k.tid IS NULL AND firsts[k.n] <> ALL (coalesce(k_made, '{}'))));
                END IF;
            END IF;
        END IF;

        IF cardinality(busy) > 0 THEN
            -- The busy aggregates' heads, each from the newest entry of its key down to the
            -- first version this sees, locked FOR KEY SHARE (Lock order, above) unless a report
            -- holds it. In a flow these are the aggregates whose events keep coming: a stronger
            -- lock kept them from every other claim until this one committed, and a worker of a
            -- shard whose claim found them so went to sleep with its shard's heads due.
            SELECT array_agg(h.tid), array_agg(s.n), array_agg(h.parked OR h.head_id > firsts[s.n])
              INTO live_tids, live_ns, live_change
              FROM (SELECT s.t COLLATE "C" AS t, s.i COLLATE "C" AS i, s.n
                      FROM unnest(types, ids) WITH ORDINALITY AS s(t, i, n)
                     WHERE s.n = ANY (busy)
                     ORDER BY 1, 2) s
             CROSS JOIN LATERAL (
                   SELECT h.ctid AS tid, h.parked, h.head_id FROM outbox_heads h
                    WHERE h.aggregate_type = s.t
                      AND h.aggregate_id >= s.i AND h.aggregate_id <= s.i
                    ORDER BY h.aggregate_type DESC, h.aggregate_id DESC
                    LIMIT 1
                      FOR KEY SHARE SKIP LOCKED) h;
            IF coalesce(cardinality(live_ns), 0) < cardinality(busy) THEN
                -- The busy aggregates whose head was not found: made when there is none (no other
                -- transaction makes heads: the intake row is locked). One that exists is held by
                -- another transaction (SKIP LOCKED passed it): DO NOTHING neither waits for it nor
                -- locks it, and the cursor stays below the aggregate's first event here, for the
                -- next intake to take it in again. Its holder may be a report about to park or drop
                -- it from a view that missed the event.
                WITH made AS (
                    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at, opened_id)
                    SELECT s.t, s.i, outbox_aggregate_key(s.t, s.i), s.f, at, s.f
                      FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
                     WHERE s.n = ANY (busy) AND s.n <> ALL (coalesce(live_ns, '{}'))
                    ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING
                    RETURNING h.aggregate_type, h.aggregate_id)
                SELECT least(held_from, min(s.f)) INTO held_from
                  FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
                 WHERE s.n = ANY (busy) AND s.n <> ALL (coalesce(live_ns, '{}'))
                   AND NOT EXISTS (SELECT FROM made m WHERE m.aggregate_type = s.t AND m.aggregate_id = s.i);
            END IF;
            k_ns := k_ns || live_ns;
            k_tids := k_tids || live_tids;
            k_change := k_change || live_change;
        END IF;

        IF true = ANY (k_change) THEN
            -- Of the heads found above, of either kind: a parked head comes back (due again at
            -- the ready_at it kept, no longer leased), and an event that committed late below its
            -- aggregate's head (held back by the commit-order guard meanwhile) moves the head
            -- back to it. Only columns in no index change: a HOT update. Locked first, SKIP
            -- LOCKED: one that another transaction holds (or changed since) keeps the cursor
            -- below (held_from).
            WITH moved AS (
                UPDATE outbox_heads h
                   SET head_id = least(h.head_id, firsts[l.n]),
                       leased_until = CASE WHEN h.parked THEN NULL ELSE h.leased_until END,
                       parked = false
                  FROM (SELECT c.tid, c.n FROM unnest(k_tids, k_ns, k_change) AS c(tid, n, moves)
                         WHERE c.moves) l
                 WHERE h.ctid = ANY (ARRAY(SELECT x.ctid FROM outbox_heads x
                                            WHERE x.ctid = ANY (ARRAY(SELECT c.tid
                                                                        FROM unnest(k_tids, k_change) AS c(tid, moves)
                                                                       WHERE c.moves))
                                              FOR NO KEY UPDATE SKIP LOCKED))
                   AND h.ctid = l.tid
                   AND (h.parked OR h.head_id > firsts[l.n])
             RETURNING l.n)
            SELECT array_agg(m.n) INTO moved_ns FROM moved m;
            held_from := least(held_from, (SELECT min(firsts[c.n]) FROM unnest(k_ns, k_change) AS c(n, moves)
                                            WHERE c.moves AND c.n <> ALL (coalesce(moved_ns, '{}'))));
        END IF;
    END IF;

    IF seen >= chunk THEN
        -- A backlog: the chunk above did not reach the newest events. Their aggregates get heads
        -- now rather than when the cursor reaches them, so that the traffic of other aggregates
        -- is not held back by a backlog it has nothing to do with (at a million backlog events,
        -- the cursor takes a minute to get there). This is safe for order: an aggregate with no
        -- head has no unfinished event up to the cursor (that is what the cursor means), and a
        -- claim reads every line from the cursor on, least(head_id, cursor + 1); so the events
        -- of a head made here (at its first newest event) that lie between the cursor and the
        -- newest ones are handed out before the newest, in id order (the commit-order guard
        -- still checks each of them), and the cursor moves the head back to the first of them
        -- when it gets there.
        -- The newest events are read backward from the last one, down to newest_id (what an
        -- earlier claim read so), at most a chunk: in a steady flow, what committed since the
        -- last claim, each event once (and what an open transaction still holds back, again on
        -- each claim, as the cursor does). What lies below a chunk of them is left to the
        -- cursor. Heads that exist are neither locked nor waited for (ON CONFLICT DO NOTHING):
        -- their lines hold the new events already. A parked one comes back, found newest-first
        -- without a lock, then locked by ctid, SKIP LOCKED.
        SELECT array_agg(f.t ORDER BY f.t, f.i), array_agg(f.i ORDER BY f.t, f.i),
               array_agg(f.first_id ORDER BY f.t, f.i)
          INTO new_types, new_ids, new_firsts
          FROM (SELECT e.aggregate_type AS t, e.aggregate_id AS i, min(e.id) AS first_id
                  FROM (SELECT o.id, o.aggregate_type, o.aggregate_id
                          FROM outbox o
                         WHERE o.in_flow
                           AND o.id > greatest(top, newest) AND o.id <= last_id
                         ORDER BY o.id DESC
                         LIMIT chunk) e
                 GROUP BY e.aggregate_type, e.aggregate_id) f;
        -- Up to the horizon only, like the cursor: an event below last_id whose transaction is
        -- still open is not visible here, and would be left to the cursor (a whole backlog later)
        -- if newest_id moved past it; the next claim reads it then.
        new_top := least(last_id, settled);
        IF new_types IS NOT NULL THEN
            -- The probe below does not see the heads the insert makes (the parts of a statement
            -- share its snapshot): it finds the heads that existed, and brings back the parked
            -- ones. (It used to skip the aggregates the insert had made first, by a join with the
            -- insert's rows: with only nested loops here, that compared every pair, 500,000
            -- comparisons and 51 ms for the 1,000 aggregates of the first claim after a burst.)
            WITH made AS (
                INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at, opened_id)
                SELECT s.t, s.i, outbox_aggregate_key(s.t, s.i), s.f, at, s.f
                  FROM unnest(new_types, new_ids, new_firsts) AS s(t, i, f)
                ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING)
            SELECT array_agg(h.tid) INTO back_tids
              FROM (SELECT s.t COLLATE "C" AS t, s.i COLLATE "C" AS i
                      FROM unnest(new_types, new_ids) AS s(t, i)) s
             CROSS JOIN LATERAL (
                   SELECT h.ctid AS tid, h.parked FROM outbox_heads h
                    WHERE h.aggregate_type = s.t
                      AND h.aggregate_id >= s.i AND h.aggregate_id <= s.i
                    ORDER BY h.aggregate_type DESC, h.aggregate_id DESC
                    LIMIT 1) h
             WHERE h.parked;
            IF back_tids IS NOT NULL THEN
                UPDATE outbox_heads h
                   SET leased_until = NULL, parked = false
                 WHERE h.ctid = ANY (ARRAY(SELECT l.ctid FROM outbox_heads l
                                            WHERE l.ctid = ANY (back_tids) AND l.parked
                                              FOR UPDATE SKIP LOCKED));
            END IF;
        END IF;
    END IF;

    -- Past everything read (all of it when fewer than chunk came back), never past the horizon.
    top := least(CASE WHEN coalesce(seen, 0) < chunk THEN last_id ELSE top END, settled);
    -- Below a busy aggregate whose head another transaction held (see above).
    top := least(top, held_from - 1);
    IF top > upto OR noted IS NOT NULL OR new_top > newest THEN
        -- By ctid (a TID scan): the version locked above, not a walk of all of them.
        UPDATE outbox_intake i
           SET intake_id = greatest(top, upto),
               newest_id = greatest(new_top, newest),
               last_claim_at = coalesce(noted, i.last_claim_at)
         WHERE i.ctid = row_tid
        RETURNING i.ctid INTO new_tid;
        PERFORM outbox_intake_remember(new_tid);
        upto := greatest(top, upto);
    END IF;
    RETURN upto;
END;
$$;

-- Wait for the claim that holds the intake row to end (true), at most a second (false). A claim
-- that finds the row held takes nothing in itself; when it then has nothing to hand out either,
-- what it would hand out may be the heads that other claim is making (or bringing back) right
-- now, due the moment it commits: after a burst into an idle fleet, every worker but the one
-- taking in would come back empty and sleep until a notification that the burst has already
-- spent, and a caller of another language until its next poll. So it waits, and looks again.
-- The wait is a row lock in a subtransaction that is rolled back at once (the exception
-- below), so the lock goes with it: holding it, this claim would keep the next intake out.
-- Bounded, because the holder may be a session that claimed and stays open (a user trying
-- outbox_claim in psql); then the claim comes back empty as it did without the wait. Under a
-- statement_timeout (a role's, say) it waits at most half of it, so that the claim comes back
-- empty rather than cancelled.
CREATE OR REPLACE FUNCTION outbox_intake_wait() RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET lock_timeout = '1s'
AS $$
DECLARE
    statement_ms bigint := (SELECT s.setting::bigint FROM pg_settings s WHERE s.name = 'statement_timeout');
BEGIN
    IF statement_ms > 0 THEN
        -- Local to this call: the SET clause above puts lock_timeout back when it returns.
        PERFORM set_config('lock_timeout', greatest(1, least(1000, statement_ms / 2))::text, true);
    END IF;
    PERFORM FROM outbox_intake i FOR KEY SHARE;
    RAISE SQLSTATE 'OBX02';
EXCEPTION
    WHEN SQLSTATE 'OBX02' THEN
        RETURN true;
    WHEN lock_not_available THEN
        RETURN false;
END;
$$;

COMMENT ON FUNCTION outbox_intake_wait() IS
    'Called by outbox_claim when it found the intake row held and had nothing to hand out: waits for the holder to end (true), at most 1 s or half the statement_timeout (false).';

-- The sessions, other than this one, whose transaction holds the intake row or is locking it
-- right now. A row lock comes with a lock on its table, which pg_locks shows (the row lock itself
-- shows only to a session waiting for it). outbox_next_wakeup claims again while there is one;
-- outbox_open_claims names those open for over a second.
CREATE OR REPLACE FUNCTION outbox_intake_holders() RETURNS SETOF integer
LANGUAGE sql
STABLE
SET search_path FROM CURRENT
AS $$
    SELECT DISTINCT l.pid
      FROM pg_locks l
     WHERE l.locktype = 'relation'
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND l.relation = 'outbox_intake'::regclass
       AND l.mode IN ('RowShareLock', 'RowExclusiveLock')
       AND l.granted
       AND l.pid <> pg_backend_pid()
$$;

COMMENT ON FUNCTION outbox_intake_holders() IS
    'Called by outbox_next_wakeup and outbox_open_claims: the other sessions whose transaction holds or locks the intake row.';

-- The bucket of an aggregate, 0 to 63.
CREATE OR REPLACE FUNCTION outbox_aggregate_bucket(aggregate_type text, aggregate_id text) RETURNS integer
LANGUAGE sql
IMMUTABLE PARALLEL SAFE
SET search_path FROM CURRENT
AS $$ SELECT outbox_aggregate_key(aggregate_type, aggregate_id) & 63 $$;

COMMENT ON FUNCTION outbox_aggregate_bucket(text, text) IS
    'The bucket (0-63) of an aggregate: the low six bits of outbox_aggregate_key. Shards are ranges of buckets.';

-- The buckets of shard 'I/N' (0 <= I < N <= 64): the range [ceil(64 I / N), ceil(64 (I+1) / N)).
-- The shards 0/N .. N-1/N cover each bucket once. NULL for NULL.
CREATE OR REPLACE FUNCTION outbox_shard_buckets(shard text) RETURNS integer[]
LANGUAGE plpgsql
IMMUTABLE PARALLEL SAFE
SET search_path FROM CURRENT
AS $$
DECLARE
    parts text[] := regexp_match(shard, '^\s*([0-9]{1,4})\s*/\s*([0-9]{1,4})\s*$');
    i integer := parts[1]::integer;
    n integer := parts[2]::integer;
BEGIN
    IF shard IS NULL THEN
        RETURN NULL;
    END IF;
    IF parts IS NULL OR n < 1 OR n > 64 OR i >= n THEN
        RAISE EXCEPTION 'shard must be I/N with 0 <= I < N <= 64, got %', quote_literal(shard)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN ARRAY(SELECT generate_series((64 * i + n - 1) / n, (64 * (i + 1) + n - 1) / n - 1));
END;
$$;

COMMENT ON FUNCTION outbox_shard_buckets(text) IS
    'The buckets (see outbox_aggregate_bucket) of shard ''I/N'': a contiguous range, about 64/N of them.';

-- Makes the index that shard claims read (idempotent: false if it was there). Run by the
-- schema's owner, once, before the first worker with a shard starts; outbox_claim refuses a
-- shard without it. Takes a SHARE lock on outbox_heads while it builds (claims and reports
-- wait): the table holds one row per aggregate with unfinished events, a build of milliseconds
-- to seconds.
CREATE OR REPLACE FUNCTION outbox_shards_enable() RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF to_regclass('outbox_heads_bucket_idx') IS NOT NULL THEN
        RETURN false;
    END IF;
    -- Due heads per bucket in claim order: as outbox_heads_ready_idx, one range per bucket.
    CREATE INDEX outbox_heads_bucket_idx ON outbox_heads ((lock_key & 63), ready_at, opened_id)
        WHERE ready_at IS NOT NULL;
    RETURN true;
END;
$$;

COMMENT ON FUNCTION outbox_shards_enable() IS
    'Creates outbox_heads_bucket_idx, which outbox_claim(..., shard) needs; false if it exists. Run by the schema owner.';

-- Drops it again once no worker claims with a shard (their claims fail from then on).
CREATE OR REPLACE FUNCTION outbox_shards_disable() RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF to_regclass('outbox_heads_bucket_idx') IS NULL THEN
        RETURN false;
    END IF;
    DROP INDEX outbox_heads_bucket_idx;
    RETURN true;
END;
$$;

COMMENT ON FUNCTION outbox_shards_disable() IS
    'Drops outbox_heads_bucket_idx (claims with a shard fail from then on); false if it was not there.';

-- The claim: the intake first, then passes over the due heads (a pass that reclaimed expired
-- runs or discarded expired events looks again for the rest of the batch), then one UPDATE that
-- leases the runs found, by the ctids locked on the way.
--
-- A claim hands out at most max_bytes of events (size_bytes: payload and headers; default
-- outbox_settings.max_claim_bytes), so that what a worker holds for a batch is bounded whatever
-- the producers wrote; at least one event goes, however large. The budget is spent in claim
-- order (the oldest heads first, each run from its first event), so it cuts a run short but
-- never skips an event: what it leaves stays due for the next claim.
--
-- With a shard ('I/N', see Shards above) the claim takes the heads of that shard's buckets
-- only: it first reads the front of each bucket (its first due head, one probe each), then
-- takes heads bucket by bucket, the bucket whose first head has waited longest first, each
-- bucket's heads oldest first, from outbox_heads_bucket_idx. A merge of the buckets in ready
-- order would take the same heads when fewer are due than the claim hands out; when more are
-- due, it would take the oldest of all, where this takes a bucket's newer heads before another
-- bucket's older ones, for one claim: the next starts from the bucket now waiting longest. In
-- exchange its reads are the probes and the heads it takes, where a merge by LATERAL reads a
-- claim's worth from every bucket. The intake, the floor, the shares, the passes and the guard
-- are the same; a shard's claim takes in every shard's new events (the intake is one cursor),
-- and reclaims expired runs of its own shard only. Without a shard (NULL, or '0/1'), the
-- claim reads outbox_heads_ready_idx as it always has.
CREATE OR REPLACE FUNCTION outbox_claim(batch_size integer, lease interval DEFAULT NULL, worker text DEFAULT NULL,
                                        max_bytes bigint DEFAULT NULL, shard text DEFAULT NULL,
                                        quiet_only boolean DEFAULT false)
RETURNS TABLE (
    id             bigint,
    subject        text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb,
    msg_id         text,
    attempts       integer,
    created_at     timestamptz,
    lease_token    uuid,
    locked_until   timestamptz,
    -- When the event was first due: its deliver_at, or its creation if that came later. The
    -- worker's lag counts from it, so a scheduled event is not lag before its time.
    due_at         timestamptz
)
LANGUAGE plpgsql
-- Runs as its owner: a worker has no rights on the tables.
SECURITY DEFINER
SET search_path FROM CURRENT
-- Generic plans: a custom plan would re-plan every statement below on each call, over every
-- partition (milliseconds), for plans that do not depend on the arguments.
SET plan_cache_mode = force_generic_plan
-- Pinned plan shape. These run with generic plans (planned once per session), and a plan made
-- while the table was small must not turn into scans of the whole backlog after a burst (seen:
-- seconds per claim until the next ANALYZE). Index probes and nested loops are the right plan
-- at every size here (a hash join would read all of outbox_heads), so the planner is not given
-- the choice.
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
-- Index scans stay on for the claim, whatever the session says; the updates by ctid below
-- turn them off while they run (set_config inside is undone when the function returns).
SET enable_indexscan = on
AS $$
#variable_conflict use_column
DECLARE
    cfg     outbox_settings;
    token   uuid := gen_random_uuid();
    -- The lease runs from the moment of the claim, not from the start of the caller's
    -- transaction (read after the intake, so that the heads it made are due at t).
    t       timestamptz;
    floor_at timestamptz;   -- no head is due below it
    owner   text;
    n       integer;
    g       record;
    upto    bigint;
    intake_held boolean;    -- another claim held the intake row: this one took nothing in
    locked  boolean := false;   -- a pass of this look locked a head
    remaining  integer;
    empty_types text[] := '{}';   -- heads this claim holds that showed no unfinished event
    empty_ids   text[] := '{}';
    parked_tids tid[];             -- parked heads at the front whose second is up
    pass_empty_types text[];
    pass_empty_ids   text[];
    seen_heads bigint;
    -- What to do with the events read (parallel arrays).
    c_ids   bigint[] := '{}';
    c_tids  tid[] := '{}';
    pass_ids  bigint[];
    pass_tids tid[];
    pass_lo   timestamptz;
    pass_hi   timestamptz;
    r_ids   bigint[];
    r_tids  tid[];
    r_first boolean[];
    r_retry timestamptz[];
    x_ids   bigint[];       -- heads past their expires_at, discarded
    m_tids  tid[];          -- the heads to move, and where to
    m_heads bigint[];
    m_ready timestamptz[];
    m_leased timestamptz[];
    x_tids  tid[];
    due     bigint;         -- claimable heads at the front of the queue (up to 16)
    front   integer[];      -- their lock_keys, in claim order
    front_read integer;     -- the due heads read there, claimable or not (up to 16)
    busy_front boolean[];   -- whether each of them is a busy aggregate's head
    skip    integer[];      -- the lock_keys of busy heads at the front this pass leaves
    busy_key integer;       -- the lock_key of the busy head this pass takes, if any
    busy_share integer;     -- what it takes at most
    share   integer;        -- the events a run of this pass takes at most, or one more:
    plus    integer[];      -- the lock_keys of the heads that take one more
    budget  bigint;         -- max_bytes, or the setting
    pass_bytes bigint;
    taken   bigint := 0;    -- bytes of the events of the passes before
    lo      timestamptz;
    hi      timestamptz;
    buckets integer[];      -- the shard's buckets; NULL: no shard, every head
    due_buckets integer[];  -- those with a due head, the one whose first waited longest first
    window_end timestamptz := 'infinity';   -- quiet_only: the last ready_at of the front read
    idle_limit interval;    -- the session's idle_in_transaction_session_timeout (0: none)
BEGIN
    IF batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'outbox_claim: batch_size must be 1 or more, got %', coalesce(batch_size::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO STRICT cfg FROM outbox_settings;
    n := least(batch_size, cfg.max_claim_batch);
    lease := coalesce(lease, cfg.default_lease);
    IF lease <= interval '0' THEN
        RAISE EXCEPTION 'outbox_claim: lease must be positive, got %', lease
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Until this transaction ends it holds the intake row, and the heads it makes are invisible
    -- to every other claim: a caller that claims in a transaction and leaves it idle (psql after
    -- BEGIN, a driver that does not autocommit, a worker hung between its claim and its commit)
    -- would keep every new event from every claim for as long as it stays. So the server ends
    -- the transaction once it has been idle for as long as the lease, which has run out by then
    -- anyway: the claim is undone, its events are claimed again. A shorter timeout of the
    -- session's own stays. In autocommit the transaction ends with the call, and this with it.
    idle_limit := current_setting('idle_in_transaction_session_timeout')::interval;
    IF idle_limit = interval '0' OR idle_limit > lease THEN
        PERFORM set_config('idle_in_transaction_session_timeout',
                           least(ceil(extract(epoch FROM lease) * 1000), 2147483647)::bigint::text, true);
    END IF;
    quiet_only := coalesce(quiet_only, false);    -- NULL: as the default, like the other arguments
    budget := coalesce(max_bytes, cfg.max_claim_bytes);
    IF budget < 1 THEN
        RAISE EXCEPTION 'outbox_claim: max_bytes must be 1 or more, got %', budget
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    owner := coalesce(worker, nullif(current_setting('application_name'), ''), 'backend ' || pg_backend_pid());
    buckets := outbox_shard_buckets(shard);       -- raises on a malformed shard
    IF cardinality(buckets) = 64 THEN
        buckets := NULL;                          -- '0/1': every bucket, the plain claim
    ELSIF buckets IS NOT NULL AND to_regclass('outbox_heads_bucket_idx') IS NULL THEN
        RAISE EXCEPTION 'outbox_claim: shards are not enabled in this database (the schema owner runs SELECT outbox_shards_enable())'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;

    -- This transaction writes heads' ready_at from here on (outbox_heads_floor).
    PERFORM outbox_heads_writing();
    -- The look: the guard, the intake, the due heads, the passes. Taken again, once, when this
    -- claim found the intake row held by another claim and nothing to hand out (below).
    FOR look IN 1..2 LOOP
        -- Commit order: read before the snapshots of the statements below.
        SELECT * INTO g FROM outbox_commit_guard();
        upto := outbox_take_in(g.settled, g.last_id, least(greatest(2 * n, 500), 10000));
        intake_held := upto IS NULL;
        t := clock_timestamp();
        floor_at := outbox_heads_floor();
        IF NOT cfg.commit_order_guard THEN
            -- Switched off: whatever is visible, in id order per aggregate.
            g.settled := g.last_id;
            g.open_below := g.last_id;
            g.held_keys := '{}';
        END IF;
        IF upto IS NULL THEN
            -- Another claim holds the intake row: the mark, not a walk of the row's versions.
            upto := coalesce(pg_sequence_last_value('outbox_intake_mark'), 0);
        END IF;
        IF buckets IS NOT NULL THEN
            -- The shard's buckets with a due head, the one whose first head has waited longest
            -- first: one probe of outbox_heads_bucket_idx per bucket, from the floor up.
            due_buckets := ARRAY(
                SELECT b.k
                  FROM unnest(buckets) AS b(k)
                 CROSS JOIN LATERAL (
                       SELECT h.ready_at, h.opened_id
                         FROM outbox_heads h
                        WHERE (h.lock_key & 63) = b.k
                          AND h.ready_at <= t AND h.ready_at >= floor_at
                        ORDER BY h.ready_at, h.opened_id
                        LIMIT 1) f
                 ORDER BY f.ready_at, f.opened_id);
        END IF;
        -- The first due heads (those that hold the floor), read without locks: parked ones whose
        -- second is up are dropped below with the heads found empty (outbox_refresh_heads looks at
        -- their events first); which can be claimed, for the shares below; and whether a pass can
        -- find any (below). A claimable one is busy when it has been moved on 3 times or more (its
        -- events came one after another) and more than 10 of them wait now (a quiet head's share at
        -- most, below): the line of such a head is read to its 11th event, no further. An aggregate
        -- that has caught up is quiet again, however busy it was.
        SELECT coalesce(array_agg(p.tid) FILTER (WHERE p.parked AND p.leased_until < t), '{}'),
               coalesce(array_agg(p.lock_key ORDER BY p.ready_at, p.opened_id) FILTER (WHERE p.claimable), '{}'),
               coalesce(array_agg(p.moves >= 3 AND EXISTS (SELECT FROM outbox o
                                                          WHERE o.aggregate_type = p.aggregate_type
                                                            AND o.aggregate_id = p.aggregate_id
                                                            AND o.unfinished AND o.id >= least(p.head_id, upto + 1)
                                                          ORDER BY o.id
                                                         OFFSET 10)
                                  ORDER BY p.ready_at, p.opened_id) FILTER (WHERE p.claimable), '{}'),
               count(*), max(p.ready_at)
          INTO parked_tids, front, busy_front, front_read, window_end
          FROM (SELECT h.aggregate_type, h.aggregate_id, h.parked, h.leased_until, h.lock_key, h.ready_at, h.opened_id,
                       NOT h.parked AND (h.leased_until IS NULL OR h.leased_until < t)
                       AND (h.head_id <= g.settled
                            OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys))) AS claimable,
                       h.head_id, h.moves, h.tid
                  FROM (SELECT h.*, h.ctid AS tid FROM outbox_heads h
                         WHERE buckets IS NULL
                           AND h.ready_at <= t AND h.ready_at >= floor_at
                         ORDER BY h.ready_at, h.opened_id
                         LIMIT 16) h
                 UNION ALL
                -- A shard's first due heads, bucket by bucket.
                SELECT h.aggregate_type, h.aggregate_id, h.parked, h.leased_until, h.lock_key, h.ready_at, h.opened_id,
                       NOT h.parked AND (h.leased_until IS NULL OR h.leased_until < t)
                       AND (h.head_id <= g.settled
                            OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys))) AS claimable,
                       h.head_id, h.moves, h.tid
                  FROM unnest(due_buckets) AS b(k)
                 CROSS JOIN LATERAL (
                       SELECT h.*, h.ctid AS tid FROM outbox_heads h
                        WHERE (h.lock_key & 63) = b.k
                          AND h.ready_at <= t AND h.ready_at >= floor_at
                        ORDER BY h.ready_at, h.opened_id
                        LIMIT 16) h
                 LIMIT 16) p;
        -- A claim takes one busy head (more than 10 events waiting: a backlog, or an aggregate whose
        -- events come faster than they are published) and every quiet one among those at the front
        -- (10 events or fewer: a quiet aggregate, however many events it had before, is one as soon
        -- as it has caught up); the other busy heads there are left to the next claim. So a busy
        -- aggregate's run is long (published as one atomic batch where the stream allows it, not
        -- event by event), the other claims in flight take the other busy heads side by side, and a
        -- quiet aggregate's event goes in the next claim after it is due, whatever the busy ones
        -- have queued. Left only in the first pass: one that comes back short takes them in the
        -- next (a short claim still means that nothing more is claimable).
        SELECT coalesce(array_agg(f.k ORDER BY f.i) FILTER (WHERE NOT f.b), '{}'),
               coalesce(array_agg(f.k) FILTER (WHERE f.b AND f.r > 1), '{}'),
               min(f.k) FILTER (WHERE f.b AND f.r = 1)
          INTO front, skip, busy_key
          FROM (SELECT u.k, u.b, u.i, count(*) FILTER (WHERE u.b) OVER (ORDER BY u.i) AS r
                  FROM unnest(front, busy_front) WITH ORDINALITY AS u(k, b, i)) f;
        -- quiet_only: the quiet heads among the first 16 due ones, none of the busy ones, and no
        -- head behind them (window_end), so that the claim reads at most the front whatever the
        -- busy aggregates have queued. A worker whose batches are all out with busy aggregates'
        -- runs claims so beside them (its lane), and a quiet aggregate's event does not wait for
        -- one of those batches to come back.
        IF quiet_only THEN
            skip := '{}';
            busy_key := NULL;
            IF front_read < 16 THEN
                window_end := 'infinity';      -- every due head was read: none lies behind them
            END IF;
        ELSE
            window_end := 'infinity';
        END IF;

        -- Passes: a pass that reclaimed expired runs looks again for the rest of the batch, so a
        -- worker's crash does not cost the next claim its batch (a short claim tells a worker that
        -- nothing more is claimable right now).
        FOR pass IN 1..8 LOOP
            -- Every due head was read above (fewer than 16) and none can be claimed: a pass would
            -- find none either, under the same conditions (save a head that commits in between,
            -- which the next claim takes), so it is not made. Planned and run, it is about 40% of an
            -- empty claim on a new connection and half of every later empty claim.
            EXIT WHEN pass = 1 AND cardinality(front) = 0 AND busy_key IS NULL AND (front_read < 16 OR quiet_only);
            remaining := n - cardinality(c_ids);
            -- Shares: with a busy head, each quiet head takes up to 10 events (its own share at
            -- most) and the busy one the rest, so that the claim stays full. Without one, a run
            -- takes at most its share of what the claim still hands out, split among the quiet
            -- heads at the front, the remainder one event each to the first of them: alone, a head
            -- takes it all; behind many heads of a few events each (a uniform mix) the share is
            -- larger than their lines and changes nothing. The heads this pass locks may differ
            -- from the ones read above (taken by a claim meanwhile): the shares are then a little
            -- off, never the order.
            due := greatest(cardinality(front), 1);
            IF busy_key IS NULL THEN
                share := least(cfg.max_run, remaining, greatest(1, remaining / due));
                plus := CASE WHEN share < cfg.max_run THEN front[1 : remaining - share * due] ELSE '{}' END;
            ELSE
                share := least(10, greatest(1, remaining / (cardinality(front) + 1)));
                plus := '{}';
                busy_share := least(cfg.max_run, greatest(1, remaining - cardinality(front) * share));
            END IF;
            -- One statement a pass. `cand`: the heads whose time has come, oldest first, leaving out
            -- those the guard holds back (head_id is a lower bound of the first event's id; each
            -- event is checked below), each with its line: its first max_run unfinished events, read
            -- twice, as they are (`line`) and locked, SKIP LOCKED (`e`). An event someone else is
            -- changing right now is missing from the second read, and the run ends before it
            -- (`matched`). The nested loop is lazy: it stops after `remaining` events, so heads and
            -- events past them are neither read nor locked.
            WITH cand AS MATERIALIZED (
                SELECT h.aggregate_type, h.aggregate_id, h.head_id AS old_head_id, h.ready_at AS old_ready,
                       h.leased_until AS old_leased, h.opened_id AS old_opened,
                       h.tid AS head_tid, h.lock_key, line.ids AS line_ids,
                       e.id, e.ctid, e.created_at, e.state, e.attempts, e.next_attempt_at, e.locked_until, e.lease_token,
                       e.expires_at, e.size_bytes
                  FROM (SELECT h.aggregate_type, h.aggregate_id, h.lock_key, h.head_id, h.ready_at, h.leased_until,
                               h.opened_id, h.tid,
                               CASE WHEN h.lock_key = busy_key THEN busy_share
                                    ELSE share + (h.lock_key = ANY (plus))::integer END AS share
                          FROM (SELECT u.* FROM (
                                SELECT h.*, h.ctid AS tid FROM outbox_heads h
                                 WHERE buckets IS NULL
                                   AND h.ready_at <= t
                                   AND h.ready_at >= floor_at
                                   AND (h.leased_until IS NULL OR h.leased_until < t)   -- no run in flight
                                   AND NOT h.parked
                                   AND (h.head_id <= g.settled
                                        OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))
                                   AND h.lock_key <> ALL (skip)
                                   AND h.ready_at <= window_end
                                   AND (NOT quiet_only OR h.lock_key = ANY (front))
                                 ORDER BY h.ready_at, h.opened_id     -- head_id is in no index
                                 LIMIT remaining
                                   FOR NO KEY UPDATE SKIP LOCKED) u
                         UNION ALL
                        -- A shard's: the same, bucket by bucket (a lazy loop: buckets after the
                        -- claim is full are not read).
                        (SELECT s.* FROM unnest(due_buckets) AS b(k)
                          CROSS JOIN LATERAL (
                                SELECT h.*, h.ctid AS tid FROM outbox_heads h
                                 WHERE (h.lock_key & 63) = b.k
                                   AND h.ready_at <= t
                                   AND h.ready_at >= floor_at
                                   AND (h.leased_until IS NULL OR h.leased_until < t)
                                   AND NOT h.parked
                                   AND (h.head_id <= g.settled
                                        OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))
                                   AND h.lock_key <> ALL (skip)
                                   AND h.ready_at <= window_end
                                   AND (NOT quiet_only OR h.lock_key = ANY (front))
                                 ORDER BY h.ready_at, h.opened_id
                                 LIMIT remaining
                                   FOR NO KEY UPDATE SKIP LOCKED) s
                         LIMIT remaining)) h) h
                 CROSS JOIN LATERAL (
                       SELECT array(SELECT o.id FROM outbox o
                                     WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                                       AND o.unfinished AND o.id >= least(h.head_id, upto + 1)
                                     ORDER BY o.id LIMIT h.share) AS ids
                        OFFSET 0) line   -- once per head, not once per row of the join below
                  LEFT JOIN LATERAL (
                       SELECT o.id, o.ctid, o.created_at, o.state, o.attempts, o.next_attempt_at, o.locked_until,
                              o.lease_token, o.expires_at, o.size_bytes
                         FROM outbox o
                        WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                          AND o.unfinished AND o.id >= least(h.head_id, upto + 1)
                        ORDER BY o.id
                        LIMIT h.share
                          FOR UPDATE SKIP LOCKED) e ON true
                 LIMIT remaining),
            -- A line's rows: by the head's ctid, the one thing two heads never share (a parked head's
            -- head_id is past the cursor, where another aggregate's first event may be).
            numbered AS (
                SELECT c.*, row_number() OVER w AS rn, c.id = c.line_ids[row_number() OVER w] AS matched
                  FROM cand c
                WINDOW w AS (PARTITION BY c.head_tid ORDER BY c.id)),
            marked AS MATERIALIZED (
                SELECT m.*,
                       first_value(m.state) OVER w AS first_state,
                       first_value(m.lease_token) OVER w AS first_token,
                       first_value(m.locked_until) OVER w AS first_until,
                       first_value(m.matched) OVER w AS first_matched,
                       -- The line's run: the prefix of events that are pending, due and not held back.
                       bool_and(m.matched AND m.state = 'pending' AND m.next_attempt_at <= t
                                AND (m.expires_at IS NULL OR m.expires_at > t)        -- never sent late
                                AND (m.id <= g.settled
                                     OR (m.id <= g.open_below AND m.lock_key <> ALL (g.held_keys)))) OVER w AS in_line,
                       -- A run whose lease ran out: its first event's retry (random jitter, drawn once).
                       CASE WHEN m.rn = 1 AND m.matched AND m.state = 'processing' AND m.locked_until < t
                            THEN t + outbox_retry_delay(m.attempts, cfg.backoff_base, cfg.backoff_cap) END AS retry_at,
                       -- A pending head past its expires_at is discarded, never handed out (an
                       -- event further down its line is, once it is the head).
                       m.rn = 1 AND m.matched AND m.state = 'pending' AND m.expires_at <= t AS lapsed
                  FROM numbered m
                WINDOW w AS (PARTITION BY m.head_tid ORDER BY m.id)),
            -- The run, within the byte budget: in claim order (the oldest head first, each line from
            -- its first event), the events whose bytes fit with those before them; and the claim's
            -- first event in any case. Cut anywhere, each head keeps a prefix of its line.
            budgeted AS MATERIALIZED (
                SELECT m.*,
                       m.in_line
                       AND (taken + sum(coalesce(m.size_bytes, 0)) FILTER (WHERE m.in_line) OVER b <= budget
                            OR (cardinality(c_ids) = 0 AND count(*) FILTER (WHERE m.in_line) OVER b = 1)) AS in_run
                  FROM marked m
                WINDOW b AS (ORDER BY m.old_ready, m.old_opened, m.id)),
            -- What becomes of each row: an event still leased under an expired run's token goes
            -- back (`expired`); a head becomes what its first row says (rn = 1).
            head_next AS (
                SELECT m.*,
                       m.first_state = 'processing' AND m.first_until < t AND m.first_matched
                       AND m.matched AND m.state = 'processing' AND m.lease_token = m.first_token AS expired,
                       -- Moved up only to a run's first event: that one passed the guard, so no
                       -- earlier event of its aggregate can still appear. Any other event read here
                       -- may have a late-committing predecessor this snapshot cannot see, which the
                       -- intake is about to move the head back to.
                       CASE WHEN m.in_run THEN m.id ELSE m.old_head_id END AS new_head_id,
                       -- A run leaves ready_at as it is (below: leased_until).
                       CASE WHEN m.in_run THEN m.old_ready
                            WHEN m.lapsed THEN t                           -- its next event, at once
                            WHEN m.retry_at IS NOT NULL
                                 THEN CASE WHEN m.attempts >= cfg.max_attempts THEN NULL ELSE m.retry_at END
                            -- No unfinished event seen (a head the intake made from an old view):
                            -- dropped below by outbox_refresh_heads, which looks again first.
                            WHEN cardinality(m.line_ids) = 0 THEN m.old_ready
                            WHEN m.id IS NULL OR NOT m.matched THEN m.old_ready  -- being reported right now
                            WHEN m.state = 'dead' THEN NULL
                            WHEN m.state = 'pending' AND m.next_attempt_at > t THEN m.next_attempt_at
                            WHEN m.state = 'processing' AND m.locked_until >= t THEN m.locked_until
                            ELSE m.old_ready                               -- held back by the guard
                       END AS new_ready,
                       CASE WHEN m.in_run THEN t + lease END AS new_leased
                  FROM budgeted m),
            -- The heads that move are moved by the statement after this one, by ctid.
            moved AS (
                SELECT hn.*,
                       hn.rn = 1 AND (hn.old_head_id, hn.old_ready, hn.old_leased)
                                     IS DISTINCT FROM (hn.new_head_id, hn.new_ready, hn.new_leased) AS moves
                  FROM head_next hn)
            -- All of it in one scan of the rows: one aggregate per array, the arrays of a kind over
            -- the same rows in the same order (a scalar subquery each costs a plan of its own).
            SELECT array_agg(m.id ORDER BY m.id) FILTER (WHERE m.in_run),
                   array_agg(m.ctid ORDER BY m.id) FILTER (WHERE m.in_run),
                   sum(coalesce(m.size_bytes, 0)) FILTER (WHERE m.in_run),
                   array_agg(m.id ORDER BY m.id) FILTER (WHERE m.expired),
                   array_agg(m.ctid ORDER BY m.id) FILTER (WHERE m.expired),
                   array_agg(m.rn = 1 ORDER BY m.id) FILTER (WHERE m.expired),
                   array_agg(CASE WHEN m.rn = 1 AND m.attempts < cfg.max_attempts THEN m.retry_at END ORDER BY m.id)
                       FILTER (WHERE m.expired),
                   count(*) FILTER (WHERE m.rn = 1),
                   array_agg(m.aggregate_type) FILTER (WHERE m.rn = 1 AND cardinality(m.line_ids) = 0),
                   array_agg(m.aggregate_id) FILTER (WHERE m.rn = 1 AND cardinality(m.line_ids) = 0),
                   min(m.created_at) FILTER (WHERE m.in_run OR m.lapsed OR m.expired),
                   max(m.created_at) FILTER (WHERE m.in_run OR m.lapsed OR m.expired),
                   array_agg(m.id ORDER BY m.id) FILTER (WHERE m.lapsed),
                   array_agg(m.ctid ORDER BY m.id) FILTER (WHERE m.lapsed),
                   array_agg(m.head_tid) FILTER (WHERE m.moves),
                   array_agg(m.new_head_id) FILTER (WHERE m.moves),
                   array_agg(m.new_ready) FILTER (WHERE m.moves),
                   array_agg(m.new_leased) FILTER (WHERE m.moves)
              INTO pass_ids, pass_tids, pass_bytes, r_ids, r_tids, r_first, r_retry, seen_heads, pass_empty_types,
                   pass_empty_ids, pass_lo, pass_hi, x_ids, x_tids, m_tids, m_heads, m_ready,
                   m_leased
              FROM moved m;
            locked := locked OR seen_heads > 0;
            IF m_tids IS NOT NULL THEN
                -- By ctid (a TID scan), in a statement of its own. Joined by key within the
                -- statement above, the planner could read all of outbox_heads_pkey for it once
                -- ANALYZE had counted few live heads: under a held snapshot, every dead entry of
                -- every head, on every claim. The heads were locked above and stay as they are; in
                -- a snapshot of its own this statement sees them as locked, also one that a report
                -- had changed between the snapshot above and its lock.
                -- A head taken for a run keeps head_id and ready_at: a HOT update.
                UPDATE outbox_heads oh
                   SET head_id = mv.new_head_id,
                       ready_at = mv.new_ready,
                       leased_until = mv.new_leased
                  FROM unnest(m_tids, m_heads, m_ready, m_leased) AS mv(tid, new_head_id, new_ready, new_leased)
                 WHERE oh.ctid = ANY (m_tids)
                   AND oh.ctid = mv.tid;
            END IF;
            empty_types := empty_types || pass_empty_types;
            empty_ids := empty_ids || pass_empty_ids;
            EXIT WHEN seen_heads = 0 AND cardinality(skip) = 0;
            c_ids  := c_ids || pass_ids;          -- || and least/greatest ignore NULLs
            c_tids := c_tids || pass_tids;
            taken  := taken + coalesce(pass_bytes, 0);
            lo := least(lo, pass_lo);
            hi := greatest(hi, pass_hi);

            -- The updates by ctid: with index scans off while they are planned (see the last one).
            IF r_ids IS NOT NULL OR x_ids IS NOT NULL THEN
                PERFORM set_config('enable_indexscan', 'off', true);
            END IF;
            IF r_ids IS NOT NULL THEN
                -- Reclaim expired runs: the first event failed an attempt (retried after a backoff,
                -- or dead: retry_at NULL), the rest go back unattempted. Their old token matches
                -- nothing from now on (fencing). The heads were moved above, to the retry time.
                UPDATE outbox o
                   SET state           = CASE WHEN NOT r.is_first THEN 'pending'
                                              WHEN r.retry_at IS NULL THEN 'dead' ELSE 'pending' END::outbox_state,
                       attempts        = CASE WHEN r.is_first THEN o.attempts ELSE greatest(o.attempts - 1, 0) END,
                       next_attempt_at = CASE WHEN r.is_first THEN coalesce(r.retry_at, t) ELSE t END,
                       dead_at         = CASE WHEN r.is_first AND r.retry_at IS NULL THEN t END,
                       last_error      = CASE WHEN r.is_first
                                              THEN format('lease expired at %s (held by %s)', o.locked_until, o.locked_by)
                                              ELSE o.last_error END,
                       locked_until    = NULL,
                       lease_token     = NULL
                  FROM unnest(r_ids, r_first, r_retry) AS r(id, is_first, retry_at)
                 WHERE o.ctid = ANY (r_tids)                -- locked above
                   AND (o.id = ANY (r_ids)) IS TRUE         -- a ctid from another partition may name a row here
                   AND o.created_at BETWEEN pass_lo AND pass_hi
                   AND o.id = r.id;
            END IF;
            IF x_ids IS NOT NULL THEN
                -- Past their expires_at, out of the flow (their heads were made ready above,
                -- so the next pass looks at the event behind each).
                UPDATE outbox o
                   SET state = 'discarded', discarded_at = t, discard_reason = 'expired'
                 WHERE o.ctid = ANY (x_tids)                -- locked above
                   AND (o.id = ANY (x_ids)) IS TRUE
                   AND o.created_at BETWEEN pass_lo AND pass_hi;
            END IF;
            IF r_ids IS NOT NULL OR x_ids IS NOT NULL THEN
                PERFORM set_config('enable_indexscan', 'on', true);
            END IF;
            EXIT WHEN (r_ids IS NULL AND x_ids IS NULL AND cardinality(skip) = 0) OR cardinality(c_ids) >= n
                      OR taken >= budget;
            -- The busy heads left in the first pass share what remains.
            front := skip;
            skip := '{}';
            busy_key := NULL;
        END LOOP;
        -- Nothing handed out, nothing locked, the intake row held by another claim: what that
        -- claim is taking in may be due the moment it commits. Wait for it, once, and look again.
        -- Not when this look locked a head (a claim that waits holds none: the other claim may
        -- wait for a head it holds, to drop it), not for the lane (quiet_only: it looks beside the
        -- worker's full batches and comes back soon anyway), and not under REPEATABLE READ or
        -- SERIALIZABLE, where a second look would see the same snapshot.
        EXIT WHEN look = 2 OR NOT intake_held OR quiet_only OR locked OR cardinality(c_ids) > 0
                  OR current_setting('transaction_isolation') <> 'read committed';
        EXIT WHEN NOT outbox_intake_wait();
    END LOOP;

    IF cardinality(parked_tids) > 0 THEN
        -- The parked heads read at the front are not locked yet, and this claim holds its runs'
        -- heads (and its intake's): a wait for one of them could close a circle with a report
        -- that holds it (it parked it) and waits for one of those. So only those it can lock
        -- now, by the version read (or the one it became since), SKIP LOCKED; one that another
        -- holds is left to a later claim.
        SELECT empty_types || coalesce(array_agg(h.aggregate_type::text), '{}'),
               empty_ids || coalesce(array_agg(h.aggregate_id::text), '{}')
          INTO empty_types, empty_ids
          FROM outbox_heads h
         WHERE h.ctid = ANY (ARRAY(SELECT x.ctid FROM outbox_heads x
                                    WHERE x.ctid = ANY (parked_tids)
                                      FOR UPDATE SKIP LOCKED));
    END IF;
    IF cardinality(empty_types) > 0 THEN
        -- Heads with no unfinished event in sight: dropped, or set right, under the protocol
        -- that keeps a new event from losing its head (the claim holds them).
        PERFORM outbox_refresh_heads(empty_types, empty_ids);
    END IF;
    IF cardinality(c_ids) = 0 THEN
        RETURN;
    END IF;

    -- The rows are found by ctid (a TID scan), the created_at range prunes the partitions.
    -- The statement is planned once per session (generic plans), and on a small table an index
    -- scan of the primary key (id, created_at) over the range looks cheaper: that plan, made by
    -- a session that claimed while the outbox held a few events, then read the partition's
    -- whole key on every claim once a backlog had come (440 ms instead of 17 for a claim of
    -- 500 after a burst of 200,000, until an ANALYZE replanned it). Index scans are off while
    -- it is planned and run.
    PERFORM set_config('enable_indexscan', 'off', true);
    RETURN QUERY
    WITH claimed AS (
        UPDATE outbox o
           SET state        = 'processing',
               attempts     = o.attempts + 1,
               locked_by    = owner,
               claimed_at   = t,
               locked_until = t + lease,
               lease_token  = token
         WHERE o.ctid = ANY (c_tids)                     -- locked above: still due
           -- A ctid from another partition may name a row here. IS TRUE: a filter, not an
           -- index condition (an index probe per id is what the ctids save).
           AND (o.id = ANY (c_ids)) IS TRUE
           AND o.created_at BETWEEN lo AND hi
     RETURNING o.id,
               coalesce(o.subject, cfg.subject_prefix || '.' || o.aggregate_type || '.' || o.event_type),
               -- The columns' domains, as their base types.
               o.aggregate_type::text, o.aggregate_id::text, o.event_type::text, o.payload,
               o.headers::jsonb, o.msg_id::text,
               o.attempts, o.created_at, o.lease_token, o.locked_until,
               greatest(o.created_at, o.deliver_at)
    )
    SELECT * FROM claimed ORDER BY 1;
END;
$$;

COMMENT ON FUNCTION outbox_claim(integer, interval, text, bigint, text, boolean) IS
    'Lease up to batch_size due events (at most max_bytes of them, default outbox_settings.max_claim_bytes; one at least) under a new lease_token: runs of up to max_run consecutive events per aggregate, oldest heads first, rows in id order; reclaims expired runs (one failed attempt for the run''s first event). shard ''I/N'': the aggregates of that shard only (outbox_shards_enable first). quiet_only: the quiet aggregates'' heads among the first 16 due, no busy one (a lane beside full batches).';

-- Mark leased events published. created_min and created_max, when given, are the least and the
-- greatest created_at of the events, as the claim returned them: created_at is the partition
-- key, so the update then reads only the partitions that can hold them. Without them it reads
-- every partition (each partition's outbox_in_flow_idx, rows or not), and an install keeps a
-- week of partitions by default. A range that leaves an event out leaves it leased (it is not
-- counted), as a wrong token does; a range cut to milliseconds leaves none out.
CREATE OR REPLACE FUNCTION outbox_complete(ids bigint[], lease_token uuid,
                                           created_min timestamptz DEFAULT NULL,
                                           created_max timestamptz DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: a worker has no rights on the tables.
SECURITY DEFINER
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    done  integer;
    lo    bigint;
    hi    bigint;
    -- Parameters of the generic plans below: their partitions are pruned as each call starts.
    -- A millisecond wider on each side, for clients whose time type keeps only milliseconds
    -- (JavaScript's Date, for one): created_at has microseconds.
    since timestamptz := coalesce(created_min - interval '1 millisecond', '-infinity');
    until timestamptz := coalesce(created_max + interval '1 millisecond', 'infinity');
    types text[];
    aggs  text[];
BEGIN
    IF ids IS NULL OR lease_token IS NULL THEN
        RAISE EXCEPTION 'outbox_complete: ids and lease_token must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT min(i), max(i) INTO lo, hi FROM unnest(ids) i;
    IF hi - lo < 2 * cardinality(ids) THEN
        -- (Nearly) consecutive ids, as a claim from a backlog hands out: one range scan of
        -- outbox_in_flow_idx per partition, where "id = ANY" probes every partition for every
        -- id. "IS TRUE" keeps the list out of the index condition.
        WITH done AS (
            UPDATE outbox o
               SET state = 'published', published_at = clock_timestamp(), locked_until = NULL
             WHERE o.in_flow
               AND o.id BETWEEN lo AND hi
               AND o.created_at BETWEEN since AND until
               AND (o.id = ANY (ids)) IS TRUE
               AND o.state = 'processing'
               AND o.lease_token = outbox_complete.lease_token
         RETURNING o.aggregate_type, o.aggregate_id)
        SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO done, types, aggs FROM done d;
    ELSE
        WITH done AS (
            UPDATE outbox o
               SET state = 'published', published_at = clock_timestamp(), locked_until = NULL
             WHERE o.in_flow                -- found by id in outbox_in_flow_idx
               AND o.id = ANY (ids)
               AND o.created_at BETWEEN since AND until
               AND o.state = 'processing'
               AND o.lease_token = outbox_complete.lease_token
         RETURNING o.aggregate_type, o.aggregate_id)
        SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO done, types, aggs FROM done d;
    END IF;
    IF done > 0 THEN
        PERFORM outbox_refresh_heads(types, aggs);
    END IF;
    RETURN done;
END;
$$;

COMMENT ON FUNCTION outbox_complete(bigint[], uuid, timestamptz, timestamptz) IS
    'Mark leased events published; returns how many were still held by lease_token (the rest changed nothing). created_min and created_max, the least and greatest created_at of the events, let it read only their partitions.';

-- A failed attempt. The retry waits the backoff (outbox_retry_delay) or, when the destination said
-- how long to wait (an HTTP Retry-After, say), that long if it is longer: up to backoff_cap, so
-- that no answer can park an event for longer than the backoff ever would. Asked to wait, the
-- worker does not come back early to spend another attempt on an answer it already has.
CREATE OR REPLACE FUNCTION outbox_fail(id bigint, lease_token uuid, error text, permanent boolean DEFAULT false,
                                       retry_after interval DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql
-- Runs as its owner: a worker has no rights on the tables.
SECURITY DEFINER
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    cfg       outbox_settings;
    t         timestamptz := clock_timestamp();
    new_state outbox_state;
    agg_type  text;
    agg_id    text;
BEGIN
    IF id IS NULL OR lease_token IS NULL THEN
        RAISE EXCEPTION 'outbox_fail: id and lease_token must not be NULL'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    SELECT * INTO STRICT cfg FROM outbox_settings;
    UPDATE outbox o
       SET state           = CASE WHEN coalesce(permanent, false) OR o.attempts >= cfg.max_attempts
                                  THEN 'dead' ELSE 'pending' END::outbox_state,
           next_attempt_at = t + greatest(outbox_retry_delay(o.attempts, cfg.backoff_base, cfg.backoff_cap),
                                          -- greatest ignores a NULL; least would not
                                          CASE WHEN retry_after IS NOT NULL THEN least(retry_after, cfg.backoff_cap) END),
           dead_at         = CASE WHEN coalesce(permanent, false) OR o.attempts >= cfg.max_attempts THEN t END,
           -- Bounded, so that a runaway error text cannot bloat the table.
           last_error      = left(coalesce(error, 'unknown error (outbox_fail was given no text)'), 8000),
           locked_until    = NULL,
           lease_token     = NULL
     WHERE o.in_flow                -- found by id in outbox_in_flow_idx
       AND o.state = 'processing'
       AND o.lease_token = outbox_fail.lease_token
       AND o.id = outbox_fail.id
    RETURNING o.state, o.aggregate_type, o.aggregate_id INTO new_state, agg_type, agg_id;
    -- NULL: the token no longer holds this event's lease; nothing changed.
    IF new_state IS NOT NULL THEN
        PERFORM outbox_refresh_heads(ARRAY[agg_type], ARRAY[agg_id]);
    END IF;
    RETURN new_state::text;
END;
$$;

COMMENT ON FUNCTION outbox_fail(bigint, uuid, text, boolean, interval) IS
    'Record a failed attempt: returns ''pending'' (retry scheduled with backoff, or after retry_after if longer, up to backoff_cap), ''dead'' (permanent or out of attempts), or NULL when lease_token no longer holds the event (nothing changed).';

-- A new session's first claim and first report compile their functions and plan each of their
-- statements: 15 to 20 ms of the server's CPU with events waiting, against 2 to 3 ms for the
-- same claim once warm (bench/first_claim.py). Paid where it hurts: a fleet that a burst wakes
-- pays it once per worker in the middle of the burst, and a pool pays it again for every
-- connection it opens or replaces under load. outbox_warm_up() pays it ahead of time: it writes
-- an event of its own, claims, completes what the claim handed out, and then undoes all of it
-- (a subtransaction rolled back). The session keeps the plans, and nothing else stays: no event,
-- no head, no lease, no cursor moved (outbox_intake_mark and the heads' floor are written only
-- with values that stay true after a rollback, as for any claim rolled back). For those few
-- milliseconds it holds what a claim holds (the intake row; the heads it claims, which other
-- claims skip) and what a producer announces (its own event's aggregate, for the commit-order
-- guard), and it uses up two ids. outboxpg-worker calls it on its claims' connection whenever
-- it opens one; other languages call it once on a connection made for claiming, before its
-- first claim. `shard`: the shard the connection's claims will name, so that the shard's own
-- statements are planned too.
CREATE OR REPLACE FUNCTION outbox_warm_up(shard text DEFAULT NULL) RETURNS void
LANGUAGE plpgsql
-- Runs as its owner: a worker may not write events.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    ids   bigint[];
    token uuid;
BEGIN
    -- Twice: PL/pgSQL compiles outbox_claim once for the calls that pass a text argument (its
    -- worker or shard, as outboxpg-worker does) and once more for those that pass none
    -- (outbox_claim(50)), since the collation of the call is part of what it compiles for. The
    -- second round plans only outbox_claim's own statements again.
    FOR round IN 1..2 LOOP
        BEGIN
            INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
            VALUES ('outboxpg', 'warm-up', 'outboxpg.warm_up', '{}');
            IF round = 1 THEN
                SELECT array_agg(c.id), (array_agg(c.lease_token))[1] INTO ids, token
                  FROM outbox_claim(50, NULL, 'outbox_warm_up', NULL, shard) c;
            ELSE
                SELECT array_agg(c.id), (array_agg(c.lease_token))[1] INTO ids, token
                  FROM outbox_claim(50) c;
            END IF;
            IF token IS NOT NULL THEN
                PERFORM outbox_complete(ids, token);
            END IF;
            RAISE EXCEPTION USING ERRCODE = 'OBXWU', MESSAGE = 'outbox_warm_up: undone';
        EXCEPTION WHEN SQLSTATE 'OBXWU' THEN
            NULL;   -- the event, its head, the claim and the report are undone; the plans stay
        END;
    END LOOP;
END;
$$;

COMMENT ON FUNCTION outbox_warm_up(text) IS
    'Plan a new session''s claim and report ahead of its first claim: claims and completes an event of its own, then undoes it all. Call once on a connection made for claiming.';

-- The filters both outbox_replay and outbox_replay_candidates refuse, in one place.
CREATE OR REPLACE FUNCTION outbox_replay_check(ids bigint[], aggregate_type text, aggregate_id text,
                                               event_type text, since timestamptz, until timestamptz,
                                               include_replays boolean) RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF num_nonnulls(ids, aggregate_type, aggregate_id, event_type, since, until) = 0 THEN
        RAISE EXCEPTION 'outbox_replay: no filter given: refusing to replay every published event'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Give ids, aggregate_type, aggregate_id, event_type, since or until (combined with AND).';
    END IF;
    IF since >= until THEN
        RAISE EXCEPTION 'outbox_replay: since (%) is not before until (%)', since, until
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF include_replays IS NULL THEN
        RAISE EXCEPTION 'outbox_replay: include_replays must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
END;
$$;

COMMENT ON FUNCTION outbox_replay_check(bigint[], text, text, text, timestamptz, timestamptz, boolean) IS
    'Called by outbox_replay and outbox_replay_candidates: refuses no filter at all, since not before until, a NULL include_replays.';

CREATE OR REPLACE FUNCTION outbox_replay_candidates(ids bigint[] DEFAULT NULL, aggregate_type text DEFAULT NULL,
                                         aggregate_id text DEFAULT NULL, event_type text DEFAULT NULL,
                                         since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
                                         include_replays boolean DEFAULT false)
RETURNS TABLE (id bigint, created_at timestamptz)
LANGUAGE plpgsql
STABLE
-- Runs as its owner, like outbox_replay, which reads its rows: the same selection for both.
SECURITY DEFINER
SET search_path FROM CURRENT
-- A plan per call, with the filters' values: "since IS NULL OR created_at >= since" folds away
-- and the partitions outside [since, until) are pruned, which a generic plan cannot do.
SET plan_cache_mode = force_custom_plan
AS $$
BEGIN
    PERFORM outbox_replay_check(ids, aggregate_type, aggregate_id, event_type, since, until, include_replays);
    RETURN QUERY
    SELECT o.id, o.created_at
      FROM outbox o
     WHERE o.state = 'published'
       AND (outbox_replay_candidates.ids IS NULL OR o.id = ANY (outbox_replay_candidates.ids))
       AND (outbox_replay_candidates.aggregate_type IS NULL OR o.aggregate_type = outbox_replay_candidates.aggregate_type)
       AND (outbox_replay_candidates.aggregate_id IS NULL OR o.aggregate_id = outbox_replay_candidates.aggregate_id)
       AND (outbox_replay_candidates.event_type IS NULL OR o.event_type = outbox_replay_candidates.event_type)
       AND (outbox_replay_candidates.since IS NULL OR o.created_at >= outbox_replay_candidates.since)
       AND (outbox_replay_candidates.until IS NULL OR o.created_at < outbox_replay_candidates.until)
       AND (outbox_replay_candidates.include_replays OR o.replay_of IS NULL)
     ORDER BY o.id;
END;
$$;

COMMENT ON FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz, boolean) IS
    'The published events outbox_replay would copy with the same filters (combined with AND, at least one; created_at in [since, until); copies made by earlier replays only with include_replays), in id order: its dry run.';

-- At most max_events copies a call, all or nothing: a filter that matches more (a slip such as
-- since => '-infinity') copies nothing and says how to go on.
CREATE OR REPLACE FUNCTION outbox_replay(ids bigint[] DEFAULT NULL, aggregate_type text DEFAULT NULL,
                              aggregate_id text DEFAULT NULL, event_type text DEFAULT NULL,
                              since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
                              new_msg_id boolean DEFAULT false, max_events integer DEFAULT 10000,
                              include_replays boolean DEFAULT false) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: an operator may not insert events nor read payloads itself.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    replayed integer;
BEGIN
    -- outbox_replay_candidates' own checks, made here first: the INSERT below may never call it
    -- (a hash join whose outbox side comes out empty does not read the other side).
    PERFORM outbox_replay_check(ids, aggregate_type, aggregate_id, event_type, since, until, include_replays);
    IF new_msg_id IS NULL THEN
        RAISE EXCEPTION 'outbox_replay: new_msg_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF max_events IS NULL OR max_events < 1 THEN
        RAISE EXCEPTION 'outbox_replay: max_events must be 1 or more, got %', coalesce(max_events::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Through the insert path of every event (its trigger assigns the ids in this statement's
    -- order). A copy belongs to the original's producer. One more than the cap is read: finding
    -- it undoes the statement.
    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, subject, msg_id, produced_by,
                        replay_of)
    SELECT o.aggregate_type, o.aggregate_id, o.event_type, o.payload,
           o.headers || jsonb_build_object('Outbox-Replay-Of', o.id::text),
           o.subject,
           CASE WHEN outbox_replay.new_msg_id THEN gen_random_uuid()::text ELSE o.msg_id END,
           o.produced_by,
           o.id
      FROM (SELECT c.id, c.created_at
              FROM outbox_replay_candidates(outbox_replay.ids, outbox_replay.aggregate_type, outbox_replay.aggregate_id,
                                            outbox_replay.event_type, outbox_replay.since, outbox_replay.until,
                                            outbox_replay.include_replays) c
             ORDER BY c.id
             LIMIT max_events + 1) c
      JOIN outbox o ON o.id = c.id AND o.created_at = c.created_at
     ORDER BY c.id;
    GET DIAGNOSTICS replayed = ROW_COUNT;
    IF replayed > max_events THEN
        RAISE EXCEPTION 'outbox_replay: more than max_events (%) published events match: nothing was replayed', max_events
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Narrow the filters (since, until, aggregate_type, ...), or raise max_events.';
    END IF;
    RETURN replayed;
END;
$$;

COMMENT ON FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean, integer, boolean) IS
    'Re-send published events still in the table as new events, in their original order (filters as outbox_replay_candidates, at least one; copies of earlier replays only with include_replays; at most max_events, else none); same msg_id unless new_msg_id (JetStream drops a copy inside its duplicate window); replay_of and header Outbox-Replay-Of name the original. Returns how many.';

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

-- Every event counted, published ones included: a tool for people, not for a tight loop.
-- Of the pending events, two kinds wait for a time: scheduled ones (never tried, deliver_at
-- ahead) and those waiting for a retry (failed at least once, backoff ahead). A scheduled event
-- is not a failure: counted apart, so that a dashboard of retries shows failures only. Nor is
-- it late: the oldest undelivered event's age counts from when an event is due
-- (greatest(created_at, deliver_at)), and a scheduled event not due yet has no age.
CREATE OR REPLACE VIEW outbox_stats AS
SELECT count(*) FILTER (WHERE state = 'pending')                                AS pending,
       count(*) FILTER (WHERE state = 'pending' AND attempts = 0 AND next_attempt_at > now()) AS scheduled,
       count(*) FILTER (WHERE state = 'pending' AND attempts > 0 AND next_attempt_at > now()) AS waiting_retry,
       count(*) FILTER (WHERE state = 'processing')                             AS processing,
       count(*) FILTER (WHERE state = 'published')                              AS published,
       count(*) FILTER (WHERE state = 'dead')                                   AS dead,
       count(*) FILTER (WHERE state = 'discarded')                              AS discarded,
       now() - min(greatest(created_at, deliver_at))
                 FILTER (WHERE state = 'processing' OR (state = 'pending'
                               AND NOT (attempts = 0 AND next_attempt_at > now())))   AS oldest_pending_age,
       now() - min(claimed_at) FILTER (WHERE state = 'processing')              AS oldest_lease_age,
       max(claimed_at)                                                          AS last_claim_at
  FROM outbox;

COMMENT ON VIEW outbox_stats IS
    'One row: events per state (of the pending ones: scheduled, never tried and not due yet; waiting_retry, failed and waiting for their next attempt), age of the oldest undelivered event that is due (from its due time), oldest running lease''s age, last claim time.';

-- Claims whose transaction has stayed open for more than a second, one row per session. Such a
-- transaction holds the intake row: until it ends, no claim takes new events in, and the
-- claims' last_claim_at (written on that row) stands still. A worker's claim is a transaction
-- of milliseconds; one left open is a session that claimed after BEGIN (psql, a driver that
-- does not autocommit), which the server ends once it has been idle for its lease
-- (outbox_claim). Found by its lock on the intake row (outbox_intake_holders), named by pid,
-- state, age and application_name, never by its query. Without pg_read_all_stats for the owner
-- the age of other roles' sessions is unknown, and none of them is listed.
CREATE OR REPLACE FUNCTION outbox_open_claims()
RETURNS TABLE (pid integer, xact_age interval, state text, application_name text)
LANGUAGE plpgsql
STABLE
-- Runs as its owner: reads other roles' sessions in pg_stat_activity.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY
    SELECT a.pid, now() - a.xact_start, a.state, a.application_name::text
      FROM outbox_intake_holders() h(holder)
      JOIN pg_stat_activity a ON a.pid = h.holder
     WHERE a.xact_start < now() - interval '1 second'
     ORDER BY a.xact_start;
END;
$$;

COMMENT ON FUNCTION outbox_open_claims() IS
    'Sessions whose claim has held its transaction open for over a second: until they end, no claim takes new events in (the server ends one idle for its lease).';

CREATE OR REPLACE FUNCTION outbox_health_row()
RETURNS TABLE (
    backlog                    bigint,
    pending                    bigint,
    processing                 bigint,
    scheduled                  bigint,
    waiting_retry              bigint,
    dead                       bigint,
    expired_leases             bigint,
    oldest_pending_age         interval,
    last_claim_at              timestamptz,
    worker_claimed_last_minute boolean,
    open_producers             integer,
    oldest_producer_pid        integer,
    oldest_producer_age        interval,
    held_by_open_transactions  bigint
)
LANGUAGE plpgsql
STABLE
ROWS 1
-- Runs as its owner: the view that calls it runs it as the one who reads the view.
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
-- With sequential scans off, any plan with one (outbox_settings, the id sequence) is costed
-- above jit_above_cost: JIT compiled it on every call (8 ms a call here, 84 ms the first).
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    n_pending    bigint;
    n_processing bigint;
    n_scheduled  bigint;
    n_waiting    bigint;
    n_dead       bigint;
    n_expired    bigint;
    n_held       bigint;
    oldest       timestamptz;
    last_claim   timestamptz;
    n_producers  integer := 0;
    p_pid        integer;
    p_age        interval;
    guard_on     boolean;
    -- What the claim holds back (outbox_commit_guard): ids above settled, unless at or below
    -- open_below and of an aggregate whose key is not in held_keys. NULL settled: nothing.
    settled      bigint;
    open_below   bigint;
    held_keys    integer[];
BEGIN
    SELECT i.last_claim_at INTO last_claim FROM outbox_intake i;

    IF to_regprocedure('outbox_open_producers()') IS NOT NULL THEN
        SELECT count(*)::integer,
               (array_agg(p.pid ORDER BY p.xact_age DESC NULLS LAST, p.held_above))[1],
               (array_agg(p.xact_age ORDER BY p.xact_age DESC NULLS LAST, p.held_above))[1]
          INTO n_producers, p_pid, p_age
          FROM outbox_open_producers() p;
    END IF;
    IF n_producers > 0 THEN
        SELECT s.commit_order_guard INTO guard_on FROM outbox_settings s;
        IF guard_on THEN
            SELECT g.settled, g.open_below, g.held_keys INTO settled, open_below, held_keys
              FROM outbox_commit_guard() g;
        END IF;
    END IF;

    -- One pass over the unfinished events (the partial index outbox_unfinished_by_aggregate_idx).
    SELECT count(*) FILTER (WHERE o.state = 'pending'),
           count(*) FILTER (WHERE o.state = 'processing'),
           count(*) FILTER (WHERE o.state = 'pending' AND o.attempts = 0 AND o.next_attempt_at > now()),
           count(*) FILTER (WHERE o.state = 'pending' AND o.attempts > 0 AND o.next_attempt_at > now()),
           count(*) FILTER (WHERE o.state = 'dead'),
           count(*) FILTER (WHERE o.state = 'processing' AND o.locked_until < now()),
           count(*) FILTER (WHERE o.state = 'pending' AND o.id > settled
                              AND (o.id > open_below
                                   OR outbox_aggregate_key(o.aggregate_type, o.aggregate_id) = ANY (held_keys))),
           -- Due time, not creation; a scheduled event not due yet is not late (outbox_stats).
           min(greatest(o.created_at, o.deliver_at))
               FILTER (WHERE o.state = 'processing' OR (o.state = 'pending'
                             AND NOT (o.attempts = 0 AND o.next_attempt_at > now())))
      INTO n_pending, n_processing, n_scheduled, n_waiting, n_dead, n_expired, n_held, oldest
      FROM outbox o
     WHERE o.unfinished;

    RETURN QUERY SELECT n_pending + n_processing, n_pending, n_processing, n_scheduled, n_waiting, n_dead, n_expired,
                        now() - oldest, last_claim,
                        coalesce(last_claim >= now() - interval '1 minute', false),
                        n_producers, p_pid, p_age, n_held;
END;
$$;

COMMENT ON FUNCTION outbox_health_row() IS
    'The row of the outbox_health view (computed with index scans only).';

CREATE OR REPLACE FUNCTION outbox_xmin_holders()
RETURNS TABLE (kind text, pid integer, name text, since timestamptz, age interval, xmin_age integer,
               state text, role text, application_name text, past_threshold boolean)
LANGUAGE sql
STABLE
-- Reads other roles' sessions in pg_stat_activity: runs as its owner (see above).
SECURITY DEFINER
SET search_path FROM CURRENT
-- pg_stat_activity and the others are functions estimated at 1,000 rows each: keep the planner
-- from compiling a query that reads a few dozen rows of memory.
SET jit = off
AS $$
    WITH holder AS (
        SELECT 'session'::text AS kind, a.pid, NULL::text AS name, a.xact_start AS since,
               greatest(age(a.backend_xmin), age(a.backend_xid)) AS xmin_age,
               a.state, a.usename::text AS role, a.application_name
          FROM pg_stat_activity a
         WHERE a.datname = current_database()
           AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
           AND a.pid <> pg_backend_pid()
           AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
        UNION ALL
        SELECT 'walsender', a.pid, a.client_addr::text, NULL, age(a.backend_xmin),
               a.state, a.usename::text, a.application_name
          FROM pg_stat_activity a
         WHERE a.backend_type = 'walsender' AND a.backend_xmin IS NOT NULL
        UNION ALL
        SELECT 'prepared transaction', NULL, p.gid, p.prepared, age(p.transaction),
               'prepared', NULL, NULL
          FROM pg_prepared_xacts p
         WHERE p.database = current_database()
        UNION ALL
        SELECT 'replication slot', r.active_pid, r.slot_name, NULL, age(r.xmin),
               CASE WHEN r.active THEN 'active' ELSE 'inactive' END, NULL, NULL
          FROM pg_replication_slots r
         WHERE r.xmin IS NOT NULL)
    SELECT h.kind, h.pid, h.name, h.since, now() - h.since, h.xmin_age, h.state, h.role, h.application_name,
           CASE WHEN h.kind = 'replication slot' THEN h.state = 'inactive'
                WHEN h.kind = 'walsender' THEN false
                ELSE coalesce(now() - h.since > s.xmin_warn_after, false)
           END
      FROM holder h CROSS JOIN outbox_settings s
     ORDER BY h.xmin_age DESC NULLS LAST, h.since NULLS LAST, h.pid
$$;

COMMENT ON FUNCTION outbox_xmin_holders() IS
    'What holds back the xmin horizon (VACUUM of the outbox) in this database, the oldest first: sessions, prepared transactions, replication slots, walsenders; past_threshold: held longer than outbox_settings.xmin_warn_after (a slot: inactive).';

-- The row of outbox_health_row(), and the oldest xmin holder past the threshold with how many
-- there are: those columns read no outbox table, so they need none of the row's pinned plans.
CREATE OR REPLACE VIEW outbox_health AS
SELECT h.backlog, h.pending, h.processing, h.scheduled, h.waiting_retry, h.dead, h.expired_leases, h.oldest_pending_age,
       h.last_claim_at, h.worker_claimed_last_minute, h.open_producers, h.oldest_producer_pid,
       h.oldest_producer_age, h.held_by_open_transactions,
       coalesce(x.holders, 0)::integer AS xmin_holders,
       x.kind              AS xmin_holder_kind,
       x.pid               AS xmin_holder_pid,
       x.name              AS xmin_holder_name,
       x.age               AS xmin_holder_age,
       x.state             AS xmin_holder_state,
       x.role              AS xmin_holder_role,
       x.application_name  AS xmin_holder_application
  FROM outbox_health_row() h
  LEFT JOIN LATERAL (SELECT x.kind, x.pid, x.name, x.age, x.state, x.role, x.application_name,
                            count(*) OVER () AS holders
                       FROM outbox_xmin_holders() x
                      WHERE x.past_threshold
                      ORDER BY x.xmin_age DESC NULLS LAST
                      LIMIT 1) x ON true;

COMMENT ON VIEW outbox_health IS
    'One row, cheap (reads unfinished events, the intake row, the lock table and the server''s activity, never the bulk of published ones): backlog, oldest pending age, dead letters, expired leases, last claim and whether a worker claimed within the last minute, open producing transactions and what they hold back, and what holds back the xmin horizon past outbox_settings.xmin_warn_after.';

COMMENT ON COLUMN outbox_health.backlog IS 'Events pending (incl. scheduled, waiting for a retry or held back) or leased.';

COMMENT ON COLUMN outbox_health.scheduled IS 'Pending events never tried whose deliver_at is ahead: waiting for their time, not failing.';

COMMENT ON COLUMN outbox_health.waiting_retry IS 'Pending events that failed and wait for their next attempt (backoff).';

COMMENT ON COLUMN outbox_health.oldest_pending_age IS 'now() - due time (greatest(created_at, deliver_at)) of the oldest pending or leased event that is due; scheduled events not due yet do not count; NULL when there is none.';

COMMENT ON COLUMN outbox_health.dead IS 'Dead letters: each holds back the later events of its aggregate until requeued or discarded.';

COMMENT ON COLUMN outbox_health.expired_leases IS 'Leases past locked_until (worker died or hung); the next outbox_claim() retries them.';

COMMENT ON COLUMN outbox_health.last_claim_at IS 'When a worker last called outbox_claim (outbox_intake, to the second), whatever it found; NULL: never.';

COMMENT ON COLUMN outbox_health.worker_claimed_last_minute IS 'last_claim_at within the last minute. With a backlog, false means no worker is claiming.';

COMMENT ON COLUMN outbox_health.open_producers IS 'Open transactions that have inserted into outbox (outbox_open_producers()).';

COMMENT ON COLUMN outbox_health.oldest_producer_pid IS 'Backend pid of the producing transaction open longest; NULL when none is open.';

COMMENT ON COLUMN outbox_health.oldest_producer_age IS 'How long that transaction has been open; NULL when none is, or when the owner may not see its session.';

COMMENT ON COLUMN outbox_health.held_by_open_transactions IS 'Pending events the commit-order guard holds back until open producing transactions end.';

COMMENT ON COLUMN outbox_health.xmin_holders IS 'Holders of the xmin horizon past outbox_settings.xmin_warn_after (outbox_xmin_holders()): while they hold it, VACUUM removes no dead row version of the outbox and claims slow down.';

COMMENT ON COLUMN outbox_health.xmin_holder_kind IS 'The oldest of them: session, prepared transaction, replication slot; NULL when none.';

COMMENT ON COLUMN outbox_health.xmin_holder_pid IS 'Its backend pid (a session; a slot''s walsender); pg_terminate_backend(pid) ends a session.';

COMMENT ON COLUMN outbox_health.xmin_holder_name IS 'The prepared transaction''s gid or the replication slot''s name.';

COMMENT ON COLUMN outbox_health.xmin_holder_age IS 'How long it has held: since its transaction began (a session), since PREPARE (a prepared transaction); NULL for a slot.';

COMMENT ON COLUMN outbox_health.xmin_holder_state IS 'pg_stat_activity.state (e.g. idle in transaction); prepared; a slot: active or inactive.';

COMMENT ON COLUMN outbox_health.xmin_holder_role IS 'The role the session (or walsender) logged in as.';

COMMENT ON COLUMN outbox_health.xmin_holder_application IS 'The session''s application_name.';

-- Who, besides superusers and the roles of the schema's and the outbox's owners, may create
-- objects in the install schema:
-- such a role can plant a function or operator that the SECURITY DEFINER functions, whose
-- search_path is this schema, would pick over a built-in (an exact format(text, timestamptz,
-- text) wins over format(text, VARIADIC "any")), and so run its code as the owner. The install
-- refuses then (90_privileges.sql), and so does the worker at start: an install opened up later
-- is caught when the worker next starts. NULL: nobody.
CREATE OR REPLACE FUNCTION outbox_untrusted_creators() RETURNS text
LANGUAGE sql
STABLE
SET search_path FROM CURRENT
AS $$
    -- The schema's own grants of CREATE, so that the answer names whom to REVOKE it from (a
    -- grant to PUBLIC is one name, not every role).
    SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                      ', ' ORDER BY a.grantee <> 0, pg_get_userbyid(a.grantee))
      FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
     WHERE n.oid = current_schema()::regnamespace
       AND a.privilege_type = 'CREATE'
       AND (a.grantee = 0
            OR NOT (pg_has_role(a.grantee, n.nspowner, 'USAGE')
                    OR pg_has_role(a.grantee, (SELECT c.relowner FROM pg_class c WHERE c.oid = 'outbox'::regclass),
                                   'USAGE')
                    OR (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = a.grantee)))
$$;

COMMENT ON FUNCTION outbox_untrusted_creators() IS
    'Roles other than the schema owner''s and superusers that may CREATE in the install schema, where they could plant objects the SECURITY DEFINER functions would use (NULL: none). The install and the worker refuse while there are any.';

-- 2. Every function that runs as its owner pins its search_path to this schema with pg_temp
--    last: refuse to go on otherwise.
DO $$
DECLARE
    bad text;
BEGIN
    SELECT string_agg(p.oid::regprocedure::text, ', ') INTO bad
      FROM pg_proc p
     WHERE p.pronamespace = current_schema()::regnamespace
       AND p.proname LIKE 'outbox\_%'
       AND p.prosecdef
       AND NOT coalesce(p.proconfig @> ARRAY[format('search_path=%I, pg_temp', current_schema())], false);
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'outboxpg: SECURITY DEFINER functions without search_path = %, pg_temp: %',
                        quote_ident(current_schema()), bad;
    END IF;
    -- Whoever may create objects in this schema can plant a function or operator that the
    -- SECURITY DEFINER functions would pick up, and run it as the owner (outbox_untrusted_creators).
    bad := outbox_untrusted_creators();
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'outboxpg: % may CREATE in schema %, where the SECURITY DEFINER outbox functions look up names: refusing to install',
                        bad, quote_ident(current_schema())
            -- A code of its own (class OB: outboxpg), so that outboxpg migrate can tell it apart.
            USING ERRCODE = 'OBX01',
                  HINT = format('REVOKE CREATE ON SCHEMA %I FROM %s; then install again (docs/privileges.md).',
                                current_schema(), bad);
    END IF;
END $$;

-- 3. Nobody may call anything by default.
REVOKE EXECUTE ON FUNCTION
    outbox_aggregate_key(text, text), outbox_assign_id(), outbox_take_idempotency_key(),
    outbox_idempotency_event(text), outbox_cancel(bigint[]),
    outbox_wake_workers(), outbox_worker_idle(), outbox_worker_busy(), outbox_next_wakeup(text),
    outbox_retry_delay(integer, interval, interval), outbox_commit_guard(), outbox_commit_horizon(),
    outbox_heads_writing(), outbox_heads_floor(), outbox_take_in(bigint, bigint, integer),
    outbox_intake_wait(), outbox_intake_remember(tid), outbox_intake_holders(),
    outbox_aggregate_bucket(text, text), outbox_shard_buckets(text), outbox_shards_enable(),
    outbox_shards_disable(), outbox_claim(integer, interval, text, bigint, text, boolean),
    outbox_refresh_heads(text[], text[]), outbox_complete(bigint[], uuid, timestamptz, timestamptz),
    outbox_fail(bigint, uuid, text, boolean, interval), outbox_release(bigint[], uuid),
    outbox_extend(bigint[], uuid, interval), outbox_warm_up(text),
    outbox_requeue(bigint[]), outbox_discard(bigint[], text),
    outbox_replay_check(bigint[], text, text, text, timestamptz, timestamptz, boolean),
    outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz, boolean),
    outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean, integer, boolean),
    outbox_maintain(boolean), outbox_forget_deleted(), outbox_idempotency_forget(integer),
    outbox_open_producers(), outbox_open_claims(), outbox_health_row(), outbox_xmin_holders(),
    outbox_unfinished_subjects(integer), outbox_untrusted_creators()
FROM PUBLIC;

-- outboxpg.enqueue asks which of its events holds a key.
GRANT EXECUTE ON FUNCTION outbox_idempotency_event(text) TO outbox_producer;

-- 6. Workers: the functions the worker calls, the two settings it reads at start, and the
--    one-row outbox_health for its metrics (counts and ages, no event data).
GRANT EXECUTE ON FUNCTION
    outbox_claim(integer, interval, text, bigint, text, boolean), outbox_complete(bigint[], uuid, timestamptz, timestamptz),
    outbox_fail(bigint, uuid, text, boolean, interval), outbox_release(bigint[], uuid),
    outbox_extend(bigint[], uuid, interval), outbox_warm_up(text),
    outbox_next_wakeup(text), outbox_worker_idle(), outbox_worker_busy(), outbox_maintain(boolean),
    outbox_idempotency_forget(integer), outbox_unfinished_subjects(integer),
    outbox_health_row(), outbox_open_producers(), outbox_xmin_holders(), outbox_untrusted_creators()
TO outbox_worker;

GRANT SELECT (subject_prefix, backoff_cap, allowed_subject_prefixes) ON outbox_settings TO outbox_worker;

GRANT SELECT ON outbox_health TO outbox_worker;

-- 7. Operators: the views, the settings (read only), the repairs, and the events' metadata
--    for the inspection queries of sql/ (which events wait, on what, who holds a lease, why one
--    died) - but not payload and headers, the application's data.
GRANT SELECT ON outbox_stats, outbox_dead_letters, outbox_failing, outbox_partitions, outbox_health,
                outbox_settings
    TO outbox_operator;

GRANT EXECUTE ON FUNCTION
    outbox_requeue(bigint[]), outbox_discard(bigint[], text), outbox_cancel(bigint[]),
    outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz, boolean),
    outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean, integer, boolean),
    outbox_maintain(boolean), outbox_idempotency_forget(integer), outbox_idempotency_event(text),
    outbox_unfinished_subjects(integer), outbox_health_row(), outbox_open_producers(), outbox_open_claims(),
    outbox_xmin_holders(), outbox_untrusted_creators()
TO outbox_operator;

-- Which shard an aggregate is in (its bucket, the shard's buckets): for operators and workers
-- that run shards. Making or dropping the index shards need stays with the owner.
GRANT EXECUTE ON FUNCTION outbox_aggregate_bucket(text, text), outbox_shard_buckets(text)
    TO outbox_operator, outbox_worker;

-- Not lease_token: whoever holds it can report on a worker's events.
GRANT SELECT (id, created_at, aggregate_type, aggregate_id, event_type, subject, msg_id, state, attempts,
              next_attempt_at, locked_by, claimed_at, locked_until, last_error,
              published_at, dead_at, discarded_at, discard_reason,
              in_flow, unfinished,   -- what the partial indexes select on
              tableoid,              -- which partition an event is in
              deliver_at, idempotency_key, expires_at, produced_by, size_bytes, replay_of)
    ON outbox TO outbox_operator;
