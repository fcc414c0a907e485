-- Back to outbox_health as 0011 made it (the 13 columns), its grants as 0012 made them, without
-- the xmin holders and their setting.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

DROP VIEW outbox_health;

CREATE VIEW outbox_health AS
SELECT * FROM outbox_health_row();

COMMENT ON VIEW outbox_health IS
    'One row, cheap (reads unfinished events, the intake row and the lock table, never the bulk of published ones): backlog, oldest pending age, dead letters, expired leases, last claim and whether a worker claimed within the last minute, open producing transactions and what they hold back.';
COMMENT ON COLUMN outbox_health.backlog IS 'Events pending (incl. waiting for a retry or held back) or leased.';
COMMENT ON COLUMN outbox_health.oldest_pending_age IS 'now() - created_at of the oldest pending or leased event; NULL when there is none.';
COMMENT ON COLUMN outbox_health.dead IS 'Dead letters: each holds back the later events of its aggregate until requeued or discarded.';
COMMENT ON COLUMN outbox_health.expired_leases IS 'Leases past locked_until (worker died or hung); the next outbox_claim() retries them.';
COMMENT ON COLUMN outbox_health.last_claim_at IS 'When a worker last called outbox_claim (outbox_intake, to the second), whatever it found; NULL: never.';
COMMENT ON COLUMN outbox_health.worker_claimed_last_minute IS 'last_claim_at within the last minute. With a backlog, false means no worker is claiming.';
COMMENT ON COLUMN outbox_health.open_producers IS 'Open transactions that have inserted into outbox (outbox_open_producers()).';
COMMENT ON COLUMN outbox_health.oldest_producer_pid IS 'Backend pid of the producing transaction open longest; NULL when none is open.';
COMMENT ON COLUMN outbox_health.oldest_producer_age IS 'How long that transaction has been open; NULL when none is, or when the owner may not see its session.';
COMMENT ON COLUMN outbox_health.held_by_open_transactions IS 'Pending events the commit-order guard holds back until open producing transactions end.';

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_worker') THEN
        GRANT SELECT ON outbox_health TO outbox_worker, outbox_operator;
    END IF;
END $$;

DROP FUNCTION outbox_xmin_holders();

ALTER TABLE outbox_settings DROP COLUMN xmin_warn_after;
