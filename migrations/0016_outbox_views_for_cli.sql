-- outboxpg 0016: what the operator's views lacked, so that the command line (outboxpg status,
-- outboxpg dead) and sql/ read the views instead of restating their own queries on the table.
--
--   SELECT id, aggregate_type, aggregate_id, held_back FROM outbox_dead_letters;
--   SELECT * FROM outbox_failing ORDER BY events DESC, max_attempts DESC, reason LIMIT 20;
--
-- 1. outbox_dead_letters.held_back: how many later events of the dead event's aggregate wait
--    behind it (pending or leased, with a higher id). They are delivered, in order, once it is
--    requeued or discarded. The query was written twice before (outboxpg dead show and
--    sql/dead_letters.sql). It is a correlated count per dead letter, read through the partial
--    index of unfinished events (outbox_unfinished_by_aggregate_idx: its predicate "unfinished"
--    is named for that, the state test alone implies it), never the published bulk; a query
--    that does not select held_back does not run it (the view is flattened into the query and
--    an unused column is never computed). The column is added last: CREATE OR REPLACE VIEW may
--    only add columns at the end, and keeps the view's owner, grants and comment.
--    The dead letters themselves are now found the same way (0007's view read every partition
--    whole for them, published events included).
--
-- 2. outbox_failing: events failing right now (failed at least once, not delivered yet: pending
--    and waiting for their retry, or leased again for one), grouped by their last error's first
--    line with the digits masked, so that "no ack for event 17" and "... 18" are one reason.
--    outboxpg status shows it and names the reasons that keep coming back. Like outbox_health
--    it reads only the unfinished events (WHERE unfinished: the partial indexes of 0002) and
--    no payload or headers. subjects: where those events go, resolved as the claim resolves
--    them, which names the subject that a "(no responders)" error lacks. Readable by
--    outbox_operator, as the other operator views (0012).
-- depends: 0007_outbox_dead_letters 0012_outbox_privileges
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE OR REPLACE VIEW outbox_dead_letters AS
SELECT d.id, d.aggregate_type, d.aggregate_id, d.event_type, d.subject, d.attempts, d.last_error, d.dead_at,
       d.created_at, d.msg_id,
       (SELECT count(*)
          FROM outbox h
         WHERE h.aggregate_type = d.aggregate_type AND h.aggregate_id = d.aggregate_id AND h.id > d.id
           AND h.unfinished AND h.state IN ('pending', 'processing')) AS held_back
  FROM outbox d
 WHERE d.state = 'dead'
   AND d.unfinished;   -- implied by the state test; named so that dead letters are found in the
                       -- partial index of unfinished events, not by reading the published bulk

COMMENT ON COLUMN outbox_dead_letters.held_back IS
    'Later events of the same aggregate waiting behind this dead one (pending or leased); delivered in order once it is requeued or discarded.';

CREATE VIEW outbox_failing AS
SELECT min(split_part(o.last_error, E'\n', 1))                        AS reason,
       count(*)                                                       AS events,
       min(o.attempts)                                                AS min_attempts,
       max(o.attempts)                                                AS max_attempts,
       count(*) FILTER (WHERE o.state = 'processing')                 AS retrying_now,
       min(o.next_attempt_at) FILTER (WHERE o.state = 'pending')      AS next_retry_at,
       array_agg(DISTINCT o.event_type::text ORDER BY o.event_type::text) AS event_types,
       (array_agg(o.id ORDER BY o.id))[1:20]                          AS ids,
       (array_agg(DISTINCT coalesce(o.subject::text,
                                    s.subject_prefix || '.' || o.aggregate_type || '.' || o.event_type)))[1:5]
                                                                      AS subjects
  FROM outbox o CROSS JOIN (SELECT subject_prefix FROM outbox_settings) s
 WHERE o.unfinished
   AND o.last_error IS NOT NULL
   AND ((o.state = 'pending' AND o.attempts > 0) OR (o.state = 'processing' AND o.attempts > 1))
 GROUP BY regexp_replace(split_part(o.last_error, E'\n', 1), '[0-9]+', 'N', 'g');

COMMENT ON VIEW outbox_failing IS
    'Events failing now (failed at least once, not delivered yet), one row per last error with its digits masked: how many, their attempts, the first 20 ids, up to 5 subjects. Reads only unfinished events.';

GRANT SELECT ON outbox_failing TO outbox_operator;
