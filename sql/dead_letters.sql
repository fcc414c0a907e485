-- outboxpg: dead letters, grouped, and what they hold back.
--
--   psql -X -v ON_ERROR_STOP=1 -d yourdb -f sql/dead_letters.sql    (or \i sql/dead_letters.sql)
--
-- Shows, read-only, from the view outbox_dead_letters (dead and held-back events are found through
-- the partial index of unfinished events, never by reading published ones):
--   1. dead letters per (event_type, aggregate_type): how many, how many aggregates they block,
--      the first and last death, and the error of the newest one;
--   2. per aggregate type: the later events held back behind a dead one of their aggregate (they
--      are delivered, in order, once it is requeued or discarded);
--   3. the 20 newest dead letters with their ids, for sql/repair.sql or `outboxpg dead`.
-- An event dies when it ran out of attempts (outbox_settings.max_attempts) or failed permanently
-- (a payload over the broker's limit, a subject or header it refuses).

\echo '== dead letters by event type and aggregate type'
SELECT event_type,
       aggregate_type,
       count(*)                                              AS dead,
       count(DISTINCT aggregate_id)                          AS aggregates,
       min(dead_at)                                          AS first_dead_at,
       max(dead_at)                                          AS last_dead_at,
       (array_agg(split_part(last_error, E'\n', 1) ORDER BY dead_at DESC, id DESC))[1] AS newest_error
  FROM outbox_dead_letters
 GROUP BY event_type, aggregate_type
 ORDER BY count(*) DESC, event_type, aggregate_type;

\echo '== events held back behind a dead letter of their aggregate'
-- held_back: the pending and leased events after a dead letter in its aggregate. The
-- aggregate's first dead letter is the one that holds back all of them: counted once, from it.
SELECT d.aggregate_type,
       count(*)                  AS blocked_aggregates,
       sum(d.held_back)::bigint  AS held_back_events
  FROM (SELECT DISTINCT ON (aggregate_type, aggregate_id) aggregate_type, aggregate_id, held_back
          FROM outbox_dead_letters
         ORDER BY aggregate_type, aggregate_id, id) d
 GROUP BY d.aggregate_type
 ORDER BY d.aggregate_type;

\echo '== the 20 newest dead letters'
SELECT id,
       dead_at,
       attempts,
       aggregate_type,
       aggregate_id,
       event_type,
       left(split_part(last_error, E'\n', 1), 120) AS last_error
  FROM outbox_dead_letters
 ORDER BY dead_at DESC, id DESC
 LIMIT 20;
