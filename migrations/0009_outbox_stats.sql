-- outboxpg 0009: the state of the outbox at a glance.
--
--   SELECT * FROM outbox_stats;
--
-- One row: events per state, the age of the oldest event still waiting to be delivered, the
-- oldest running lease, and when a worker last claimed. It reads the whole table (published
-- events included), so it is a tool for people, not for a tight monitoring loop.
-- depends: 0002_outbox_table
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE VIEW outbox_stats AS
SELECT count(*) FILTER (WHERE state = 'pending')                                AS pending,
       count(*) FILTER (WHERE state = 'pending' AND next_attempt_at > now())    AS waiting_retry,
       count(*) FILTER (WHERE state = 'processing')                             AS processing,
       count(*) FILTER (WHERE state = 'published')                              AS published,
       count(*) FILTER (WHERE state = 'dead')                                   AS dead,
       count(*) FILTER (WHERE state = 'discarded')                              AS discarded,
       now() - min(created_at) FILTER (WHERE state IN ('pending', 'processing')) AS oldest_pending_age,
       now() - min(claimed_at) FILTER (WHERE state = 'processing')              AS oldest_lease_age,
       max(claimed_at)                                                          AS last_claim_at
  FROM outbox;

COMMENT ON VIEW outbox_stats IS
    'One row: events per state, oldest undelivered event''s age, oldest running lease''s age, last claim time.';
