-- outboxpg 0021: scheduled delivery and cancellation.
--
--   INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, deliver_at)
--   VALUES ('order', '42', 'reminder', '{}', now() + interval '1 hour');
--   SELECT outbox_cancel(ARRAY[17, 18]);          -- how many were taken out of the flow
--
-- An event is not handed out before its deliver_at (NULL: at once). The insert trigger writes
-- deliver_at into next_attempt_at, the column every claim already waits on for retries: a
-- scheduled event is a pending event whose first attempt is not due yet. So nothing else
-- changes: its aggregate's head is ready at that time (outbox_heads.ready_at, set by the claim
-- that first sees it), outbox_next_wakeup() says when, and an idle worker sleeps until then
-- without polling. Order beats time: later events of the same aggregate wait behind a
-- scheduled one (a run never passes an event that is not due). A deliver_at in the past is due
-- at once. The event stays in the partition of its created_at, which outbox_maintain never
-- drops while the event is unfinished, however far off deliver_at is.
--
-- outbox_cancel(ids) takes events that no worker holds out of the flow: pending (scheduled or
-- not) and dead ones become discarded with reason 'cancelled', and the next event of their
-- aggregate becomes claimable (outbox_discard, 0007, does the work). An event a worker has
-- claimed (processing) is not cancelled, it may be on the wire already: the count says how many
-- were. A claim and a cancel of one event are ordered by its row lock: the loser sees the
-- other's result and leaves the event alone. Applications may cancel the events they wrote:
-- outbox_producer may call it (and outbox_operator).
-- depends: 0007_outbox_dead_letters 0012_outbox_privileges 0020_outbox_producer_cost
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

ALTER TABLE outbox ADD COLUMN deliver_at timestamptz;
COMMENT ON COLUMN outbox.deliver_at IS
    'Not handed out before this time (NULL: at once). Copied into next_attempt_at at insert.';

-- 0020's function, and the copy of deliver_at into next_attempt_at.
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
    RETURN NEW;
END;
$$;

CREATE FUNCTION outbox_cancel(ids bigint[]) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner, like outbox_discard: producers may not update the table (0012).
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

REVOKE EXECUTE ON FUNCTION outbox_cancel(bigint[]) FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_producer') THEN
        GRANT INSERT (deliver_at) ON outbox TO outbox_producer;
        GRANT SELECT (deliver_at) ON outbox TO outbox_operator;   -- as the other columns but payload and headers (0012)
        GRANT EXECUTE ON FUNCTION outbox_cancel(bigint[]) TO outbox_producer, outbox_operator;
    END IF;
END $$;
