-- outboxpg: repairing dead letters. Copy-paste statements; running this file changes nothing.
--
-- Running the file only previews: it lists the dead letters a selection matches, so you can
-- check it before pasting a statement below.
--   psql -X -v ON_ERROR_STOP=1 -d yourdb -f sql/repair.sql                          (every dead letter)
--   psql ... -v event_type=created -f sql/repair.sql                                 (one event type)
--   psql ... -v aggregate_type=order -v aggregate_id=o-17 -f sql/repair.sql          (one aggregate)
--   psql ... -v ids=42,43 -f sql/repair.sql                                          (by id)
-- (or \set the variables in psql, then \i sql/repair.sql). Selections combine with AND.
--
-- Two ways out for a dead event; both return how many events they changed, and both go
-- through outbox_dead_letters below, so they touch dead events only:
--   requeue  back to pending with attempts reset (last_error kept): it is delivered again, and
--            the later events of its aggregate, held back behind it, follow in order.
--   discard  out of the flow for good, with a reason kept in discard_reason; the held-back
--            events of its aggregate are then delivered without it.
-- Fix the cause first (broker limits, the consumer, the payload): a requeued event that fails
-- again goes through all its attempts again.
--
-- In psql, set the variables, preview with \i sql/repair.sql, then paste one statement.
-- :'name' inserts a variable as a quoted SQL literal, so no value can change the statement.
--
-- By id (one or several, comma-separated):
--   \set ids 42,43
--   SELECT outbox_requeue(ARRAY(SELECT id FROM outbox_dead_letters WHERE id = ANY (string_to_array(:'ids', ',')::bigint[])));
--   \set reason 'superseded by event 44'
--   SELECT outbox_discard(ARRAY(SELECT id FROM outbox_dead_letters WHERE id = ANY (string_to_array(:'ids', ',')::bigint[])), :'reason');
--
-- By event type:
--   \set event_type 'created'
--   SELECT outbox_requeue(ARRAY(SELECT id FROM outbox_dead_letters WHERE event_type = :'event_type'));
--   SELECT outbox_discard(ARRAY(SELECT id FROM outbox_dead_letters WHERE event_type = :'event_type'), :'reason');
--
-- By aggregate type (every aggregate of that type):
--   \set aggregate_type 'order'
--   SELECT outbox_requeue(ARRAY(SELECT id FROM outbox_dead_letters WHERE aggregate_type = :'aggregate_type'));
--   SELECT outbox_discard(ARRAY(SELECT id FROM outbox_dead_letters WHERE aggregate_type = :'aggregate_type'), :'reason');
--
-- By aggregate (one aggregate: its dead events, oldest first, are what blocks it):
--   \set aggregate_type 'order'
--   \set aggregate_id 'o-17'
--   SELECT outbox_requeue(ARRAY(SELECT id FROM outbox_dead_letters
--                                WHERE aggregate_type = :'aggregate_type' AND aggregate_id = :'aggregate_id'));
--   SELECT outbox_discard(ARRAY(SELECT id FROM outbox_dead_letters
--                                WHERE aggregate_type = :'aggregate_type' AND aggregate_id = :'aggregate_id'), :'reason');
--
-- Every dead letter (e.g. after a broker outage that outlasted max_attempts):
--   SELECT outbox_requeue(ARRAY(SELECT id FROM outbox_dead_letters));
--
-- Dead letters that died recently only: add  AND dead_at >= now() - interval '1 hour'.
-- The same from the command line, with a confirmation prompt: outboxpg dead requeue / discard.

-- The preview. Unset variables select everything ('' cannot be a real event_type,
-- aggregate_type or aggregate_id: the outbox refuses blank ones).
\if :{?ids}
\else
\set ids ''
\endif
\if :{?event_type}
\else
\set event_type ''
\endif
\if :{?aggregate_type}
\else
\set aggregate_type ''
\endif
\if :{?aggregate_id}
\else
\set aggregate_id ''
\endif

\echo '== selection (empty: any)' ids=:ids event_type=:event_type aggregate_type=:aggregate_type aggregate_id=:aggregate_id
\echo '== dead letters it matches, by event type and aggregate type'
SELECT event_type, aggregate_type, count(*) AS dead, count(DISTINCT aggregate_id) AS aggregates,
       min(id) AS first_id, max(id) AS last_id
  FROM outbox_dead_letters
 WHERE (cardinality(string_to_array(:'ids', ',')::bigint[]) = 0 OR id = ANY (string_to_array(:'ids', ',')::bigint[]))
   AND (:'event_type' = '' OR event_type = :'event_type')
   AND (:'aggregate_type' = '' OR aggregate_type = :'aggregate_type')
   AND (:'aggregate_id' = '' OR aggregate_id = :'aggregate_id')
 GROUP BY event_type, aggregate_type
 ORDER BY count(*) DESC, event_type, aggregate_type;

\echo '== the first 50 of them, oldest first'
SELECT id, aggregate_type, aggregate_id, event_type, attempts, dead_at,
       left(split_part(last_error, E'\n', 1), 100) AS last_error
  FROM outbox_dead_letters
 WHERE (cardinality(string_to_array(:'ids', ',')::bigint[]) = 0 OR id = ANY (string_to_array(:'ids', ',')::bigint[]))
   AND (:'event_type' = '' OR event_type = :'event_type')
   AND (:'aggregate_type' = '' OR aggregate_type = :'aggregate_type')
   AND (:'aggregate_id' = '' OR aggregate_id = :'aggregate_id')
 ORDER BY id
 LIMIT 50;
