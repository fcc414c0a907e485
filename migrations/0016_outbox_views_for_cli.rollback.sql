-- outboxpg 0016, rolled back: outbox_failing goes; outbox_dead_letters loses held_back. A view
-- cannot drop a column in place: it is made anew as 0007 made it, with 0012's grant and its comment.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

DROP VIEW outbox_failing;

DROP VIEW outbox_dead_letters;
CREATE VIEW outbox_dead_letters AS
SELECT id, aggregate_type, aggregate_id, event_type, subject, attempts, last_error, dead_at, created_at, msg_id
  FROM outbox
 WHERE state = 'dead';

COMMENT ON VIEW outbox_dead_letters IS
    'Dead events (out of attempts or failed permanently), with the last error. Repair with outbox_requeue(ids) or outbox_discard(ids, reason).';

GRANT SELECT ON outbox_dead_letters TO outbox_operator;
