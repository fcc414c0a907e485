-- outboxpg 0013: per-aggregate order in commit order, not only in id order.
--
-- Ids come from a sequence when a row is inserted, not when its transaction commits: a
-- transaction that inserted event 10 of an aggregate can still be open while event 11 of the
-- same aggregate is committed and visible. Without a guard, event 11 would be handed out
-- first and event 10 after it.
--
-- The guard holds back, while a producing transaction is open, the aggregates it wrote, and
-- nothing else. Its transaction announces them with shared advisory locks (transaction level),
-- which every session can see in pg_locks at once, long before the rows become visible:
--
--   * before each insert statement: (1868724336, 3) "a producing transaction is open" and
--     -(L + 1), L being the last id assigned so far: "this transaction may still commit ids
--     above L" (outbox_hold_horizon, below);
--   * before each row gets its id: (1868724337, outbox_aggregate_key(aggregate_type,
--     aggregate_id)) for the row's aggregate (outbox_assign_id, below). The id is assigned
--     after the lock: so a claim that sees an event with a higher id committed, and no lock on
--     its aggregate, knows that no lower id of that aggregate can still appear;
--   * a transaction that writes more than commit_order_max_aggregates aggregates stops naming
--     them (the lock table is shared and finite) and takes (1868724336, 4) instead: it holds back
--     every event above its L, as every producing transaction did before.
--
-- outbox_claim reads them once per call (outbox_commit_guard, 0005) BEFORE it takes its
-- snapshot, and hands out an event of id x of an aggregate only when x is at or below the
-- lowest L of all open producing transactions, or when no open transaction holds its
-- aggregate's key (nor the "too many" lock with an L below x). Hash collisions of keys only
-- hold back more.
--
-- Cost: producers pay per insert statement two advisory locks and two set_config calls, and per
-- row one advisory lock the first time the transaction writes an aggregate. A claim reads the
-- sequence and tries one lock; only while producing transactions are open does it also read
-- pg_locks. An open transaction that has inserted into outbox holds back delivery of the
-- aggregates it wrote until it commits or rolls back. A deployment that never writes one
-- aggregate from two concurrent transactions can switch the guard off: UPDATE outbox_settings
-- SET commit_order_guard = false (producers then skip the per-aggregate locks; the two per
-- statement stay, since the claims' intake needs them).
--
-- Lock keys: outboxpg uses the negative half of the one-bigint advisory lock space, -(L + 1),
-- (1868724336, 3) and (1868724336, 4), and the two-key space (1868724337, *).
-- depends: 0005_outbox_claim 0010_outbox_next_wakeup
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- Its settings, commit_order_guard and commit_order_max_aggregates, are in outbox_settings (0001).

CREATE FUNCTION outbox_hold_horizon() RETURNS trigger
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

CREATE TRIGGER outbox_hold_horizon
    BEFORE INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_hold_horizon();

-- The id, assigned after the aggregate's lock. outboxpg.held_aggregates lists the keys this
-- transaction holds (',k1,k2,'), or says 'all' once it holds (1868724336, 4); like the locks,
-- it ends with the transaction (and a rolled-back savepoint takes back both).
CREATE FUNCTION outbox_assign_id() RETURNS trigger
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

ALTER TABLE outbox ALTER COLUMN id DROP DEFAULT;

CREATE TRIGGER outbox_assign_id
    BEFORE INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_assign_id();

-- Who holds what back right now: one row per open producing transaction (for outbox_health,
-- `outboxpg status` and sql/health.sql). aggregates: how many it names (NULL: too many, it holds
-- back every event above held_above); held_above: it may still commit ids above this.
CREATE FUNCTION outbox_open_producers()
RETURNS TABLE (pid integer, xact_age interval, state text, held_above bigint, aggregates integer, all_newer boolean)
LANGUAGE plpgsql
STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY
    WITH l AS MATERIALIZED (
        SELECT l.pid, l.classid, l.objid, l.objsubid
          FROM pg_locks l
         WHERE l.locktype = 'advisory'
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
    SELECT p.pid, now() - a.xact_start, a.state,
           (SELECT min(-((x.classid::bigint << 32) | x.objid::bigint) - 1) FROM l x
             WHERE x.pid = p.pid AND x.objsubid = 1 AND x.classid >= 2147483648),
           (SELECT count(*)::integer FROM l x WHERE x.pid = p.pid AND x.objsubid = 2 AND x.classid = 1868724337),
           EXISTS (SELECT 1 FROM l x WHERE x.pid = p.pid AND x.objsubid = 2 AND x.classid = 1868724336 AND x.objid = 4)
      FROM (SELECT DISTINCT x.pid FROM l x WHERE x.objsubid = 2 AND x.classid = 1868724336 AND x.objid = 3) p
      LEFT JOIN pg_stat_activity a ON a.pid = p.pid
     ORDER BY a.xact_start;
END;
$$;

COMMENT ON FUNCTION outbox_open_producers() IS
    'Open transactions that have inserted into outbox, with what they hold back: the aggregates they wrote (all_newer: every event above held_above).';

-- Least privilege (as 0012): it reads pg_stat_activity for other roles' sessions, so it runs as
-- the owner; workers (metrics) and operators may call it.
ALTER FUNCTION outbox_open_producers() SECURITY DEFINER;
REVOKE EXECUTE ON FUNCTION outbox_open_producers(), outbox_assign_id() FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_worker') THEN
        GRANT EXECUTE ON FUNCTION outbox_open_producers() TO outbox_worker, outbox_operator;
    END IF;
END $$;
