-- Table changes of the next release, by hand: what CREATE OR REPLACE cannot do. Applied first;
-- the functions, views, triggers, comments and grants of schema/ follow (tools/schema_step.py).

-- The statement trigger that announced producing transactions goes: the row trigger
-- (outbox_assign_id) takes its locks with a transaction's first event.
DROP TRIGGER outbox_hold_horizon ON outbox;
DROP FUNCTION outbox_hold_horizon();

ALTER TABLE outbox_settings
    ADD COLUMN xmin_warn_after interval NOT NULL DEFAULT '1 minute'
        CONSTRAINT xmin_warn_after_positive CHECK (xmin_warn_after > interval '0');

ALTER TABLE outbox ADD COLUMN deliver_at timestamptz;
ALTER TABLE outbox ADD COLUMN idempotency_key text;
ALTER TABLE outbox ADD COLUMN expires_at timestamptz;

CREATE TABLE outbox_idempotency (
    idempotency_key text        PRIMARY KEY,
    event_id        bigint      NOT NULL,
    looked_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_idempotency_looked_at_idx ON outbox_idempotency (looked_at);

CREATE SEQUENCE outbox_heads_floor_us AS bigint MINVALUE 0 START 0;
CREATE SEQUENCE outbox_intake_mark AS bigint MINVALUE 0 START 0;
DO $$ BEGIN PERFORM setval('outbox_intake_mark', i.intake_id) FROM outbox_intake i WHERE i.intake_id > 0; END $$;

-- A head in flight keeps its ready_at at its lease's end, as the release had it: it is not due
-- before then, and the claim that takes it after the lease reclaims the run as before.
ALTER TABLE outbox_heads ADD COLUMN leased_until timestamptz;
ALTER TABLE outbox_heads ADD COLUMN opened_id bigint;
UPDATE outbox_heads SET opened_id = head_id;
ALTER TABLE outbox_heads ALTER COLUMN opened_id SET NOT NULL;
ALTER TABLE outbox_heads ADD COLUMN parked boolean NOT NULL DEFAULT false;
ALTER TABLE outbox_heads ADD COLUMN moves integer NOT NULL DEFAULT 0;
ALTER TABLE outbox_heads SET (fillfactor = 25);
-- The ready index orders by opened_id, never changed, instead of head_id, which reports move.
-- Made again, it locks outbox_heads against writes while it is built (one row per aggregate
-- with unfinished events: moments).
DROP INDEX outbox_heads_ready_idx;
CREATE INDEX outbox_heads_ready_idx ON outbox_heads (ready_at, opened_id) WHERE ready_at IS NOT NULL;
