-- outboxpg 0020: the commit-order triggers (0013) cost producers less.
--
-- Measured (bench/producer_instructions.py, callgrind, instructions per one-event INSERT
-- transaction): 0013's triggers 555,000, these 541,000 (3451e34, before the per-aggregate guard:
-- 426,000). Where 0013 spent it:
--
--   * outbox_hold_horizon ran two queries per statement: `SELECT * FROM outbox_settings` (a whole
--     row into a record) and `SELECT last_value, is_called FROM outbox_id_seq`. The sequence is
--     now read with pg_sequence_last_value(), a plain function call (no query to plan and run).
--     When the sequence was never used (or setval(..., false) reset it) it returns NULL and the
--     horizon is 0: that holds back more, never less.
--   * the settings are read by outbox_assign_id instead, once per transaction (on its first row,
--     then kept in the transaction-local outboxpg.name_aggregates as before): a multi-row
--     statement or a transaction of several statements reads them once, not once a statement.
--
-- What they do is unchanged (0013's header says it): the same locks, taken before each id is
-- assigned; the same settings, read by the same role (the producer) with the same rights.
-- depends: 0013_outbox_commit_order
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE OR REPLACE FUNCTION outbox_hold_horizon() RETURNS trigger
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

-- The id, assigned after the aggregate's lock. outboxpg.name_aggregates says how many aggregates
-- this transaction may name ('off': the guard is off), outboxpg.held_aggregates lists the keys it
-- holds (',k1,k2,'), or says 'all' once it holds (1868724336, 4); like the locks, both end with
-- the transaction (and a rolled-back savepoint takes back both).
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
    RETURN NEW;
END;
$$;
