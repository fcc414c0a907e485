-- outboxpg inbox: which messages a consumer has processed, recorded in the consumer's own
-- transaction, in the consumer's own database (which needs no outbox: these files install alone).
--
--   BEGIN;
--   SELECT outbox_inbox_receive('billing', 'order-42-paid');   -- true: first time; false: done before
--   -- ... the consumer's own writes, only when it answered true ...
--   COMMIT;                                                    -- then ack the message to the broker
--
-- A message is processed exactly once as long as its id is remembered: the consumer's side effect
-- and the record of its id commit together or not at all, so a crash before the commit leaves
-- neither (the redelivery is processed), and a crash after it (before the ack) leaves both (the
-- redelivery answers false and is only acked).
--
-- How a duplicate is caught. The id is written with INSERT ... ON CONFLICT DO NOTHING under a
-- unique key: a duplicate whose first copy is committed conflicts at once; one whose first copy is
-- still being inserted by an open transaction waits for that transaction, then conflicts (it
-- committed: false) or inserts (it rolled back: true). Only a unique index gives that wait; a
-- SELECT does not see the other transaction's row and would let both proceed.
--
-- Retention by time partitions. Ids are dropped a whole partition at a time (outbox_inbox_maintain,
-- 20_maintain.sql), so the table is partitioned by time, and a unique index of a partitioned table
-- must include the partition key: it is unique per partition only. The partition key, bucket, is
-- the start of the receive time's slot of width outbox_inbox_settings.retention (aligned to
-- 2000-01-01 UTC). A receive in slot b writes the id twice, into slot b - 1 and slot b (one
-- statement, the older row first), and answers true only when both rows were new. A duplicate
-- received up to one retention later is in slot b or b + 1, and writes slot b, which already
-- holds the id: it conflicts there, through the unique index, with the wait above when the first
-- copy is not committed yet, across a slot boundary too (a receive just before the boundary and
-- its duplicate just after meet in the older slot). outbox_inbox_maintain drops a slot once the
-- slot after it is over (no receive writes it any more), so an id is remembered for at least one
-- retention and at most two. The cost is a second index entry per message.
--
-- Under REPEATABLE READ or SERIALIZABLE, a duplicate whose first copy committed after the
-- transaction's snapshot raises serialization_failure (40001) instead of answering: retry the
-- transaction, as for any conflict at those levels.
--
-- Changing retention changes the slots: ids received before the change are found only where the
-- old and the new slots overlap. Change it while no redelivery is expected, or not at all.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE TABLE outbox_inbox_settings (
    -- A boolean primary key that must be true: the table can hold exactly one row.
    singleton                 boolean  PRIMARY KEY DEFAULT true CHECK (singleton),
    -- How long an id is remembered at least (at most twice as long): longer than any redelivery.
    -- Also the width of a partition. date_bin() takes no months or years.
    retention                 interval NOT NULL DEFAULT '7 days'
        CHECK (retention >= interval '1 second' AND date_part('month', retention) = 0
               AND date_part('year', retention) = 0),
    -- Partitions outbox_inbox_maintain keeps ready beyond the current one.
    partitions_ahead          integer  NOT NULL DEFAULT 1 CHECK (partitions_ahead BETWEEN 1 AND 100),
    -- How long outbox_inbox_maintain waits for a partition's lock before leaving it to the next run.
    maintenance_lock_timeout  interval NOT NULL DEFAULT '1s' CHECK (maintenance_lock_timeout > interval '0')
);

COMMENT ON TABLE outbox_inbox_settings IS
    'The inbox''s settings, one row: retention (how long ids are remembered, at least), partitions_ahead, maintenance_lock_timeout.';

INSERT INTO outbox_inbox_settings DEFAULT VALUES;

CREATE TABLE outbox_inbox (
    consumer     text        NOT NULL CHECK (consumer <> '' AND octet_length(consumer) <= 200),
    msg_id       text        NOT NULL CHECK (msg_id <> '' AND octet_length(msg_id) <= 1000),
    -- The start of a retention slot: the receive's own, or the one before it (see above).
    bucket       timestamptz NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT statement_timestamp(),
    PRIMARY KEY (consumer, msg_id, bucket)
) PARTITION BY RANGE (bucket);

COMMENT ON TABLE outbox_inbox IS
    'The ids of the messages each consumer processed, two rows each (its slot and the one before); written by outbox_inbox_receive, dropped by partition by outbox_inbox_maintain.';

-- Rows outside every partition (the partitions were not kept ahead) land here; the next
-- outbox_inbox_maintain() moves them into partitions of their own.
CREATE TABLE outbox_inbox_default PARTITION OF outbox_inbox DEFAULT;

-- One statement, runs as its caller (who needs INSERT on outbox_inbox and SELECT on the settings,
-- both granted to outbox_consumer by 90_privileges.sql, and nothing more: no SELECT, UPDATE or
-- DELETE on the ids). No RETURNING and no conflict target: those would need SELECT.
CREATE OR REPLACE FUNCTION outbox_inbox_receive(consumer text, msg_id text) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    width    interval;
    slot     timestamptz;
    inserted integer;
BEGIN
    SELECT s.retention INTO STRICT width FROM outbox_inbox_settings s;
    slot := date_bin(width, statement_timestamp(), timestamptz '2000-01-01 00:00:00+00');
    -- The older slot first: every receive takes its rows in time order, so two of them never
    -- wait for each other in a circle.
    INSERT INTO outbox_inbox (consumer, msg_id, bucket)
    VALUES ($1, $2, slot - width), ($1, $2, slot)
    ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    RETURN inserted = 2;
END;
$$;

COMMENT ON FUNCTION outbox_inbox_receive(text, text) IS
    'Record that consumer processes msg_id, in the caller''s transaction: true the first time, false when it was processed before (within retention). A concurrent duplicate waits for the first transaction: false if it commits, true if it rolls back.';
