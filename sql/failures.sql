-- outboxpg: how often delivery failed in the last hour, and why.
--
--   psql -X -v ON_ERROR_STOP=1 -d yourdb -f sql/failures.sql    (or \i sql/failures.sql in psql)
--   psql ... -v window='15 minutes' -f sql/failures.sql          (another window than 1 hour)
--
-- Read-only; it reads the whole table (claims and publications are not indexed by time).
--
-- The outbox keeps the state of each event, not a log of its attempts, so these figures are
-- derived from the columns each event keeps, and are approximations:
--   * attempted: events whose LAST claim (claimed_at), publication or death falls in the window.
--     An event claimed several times in the window counts once.
--   * published: events published (published_at) in the window; published_after_retry are those
--     among them that needed more than one attempt (attempts > 1; their earlier failures may lie
--     before the window).
--   * failed_waiting_retry: events whose last attempt failed in the window (pending with attempts
--     and a last_error, last claimed in the window) and that wait for their retry. This includes leases
--     that expired (last_error 'lease expired ...').
--   * dead: events dead-lettered in the window (dead_at): exact, unless requeued or discarded since.
--   * failure_rate_pct: (failed_waiting_retry + dead) / attempted, the share of recently attempted
--     events whose latest attempt failed. It leaves out failures that a later attempt in the window
--     then delivered (published_after_retry gives an idea of those), and events requeued or
--     discarded since.
-- The second query groups the last errors of those events by their first line.

\if :{?window}
\else
\set window '1 hour'
\endif

\echo '== attempts and failures in the last' :window
WITH recent AS (
    SELECT o.attempts,
           o.claimed_at >= now() - :'window'::interval                                  AS claimed,
           o.published_at >= now() - :'window'::interval                                AS published,
           o.state = 'pending' AND o.attempts > 0 AND o.last_error IS NOT NULL
               AND o.claimed_at >= now() - :'window'::interval                          AS failed_waiting_retry,
           o.state = 'dead' AND o.dead_at >= now() - :'window'::interval                AS died
      FROM outbox o
)
SELECT now() - :'window'::interval                                      AS since,
       count(*) FILTER (WHERE claimed OR published OR died)             AS attempted,
       count(*) FILTER (WHERE published)                                AS published,
       count(*) FILTER (WHERE published AND attempts > 1)               AS published_after_retry,
       count(*) FILTER (WHERE failed_waiting_retry)                     AS failed_waiting_retry,
       count(*) FILTER (WHERE died)                                     AS dead,
       round(100.0 * count(*) FILTER (WHERE failed_waiting_retry OR died)
             / nullif(count(*) FILTER (WHERE claimed OR published OR died), 0), 1) AS failure_rate_pct
  FROM recent;

\echo '== last errors in the last' :window '(events waiting for a retry or dead-lettered in it)'
SELECT split_part(last_error, E'\n', 1)                    AS error,
       count(*) FILTER (WHERE state = 'pending')           AS waiting_retry,
       count(*) FILTER (WHERE state = 'dead')              AS dead,
       array_agg(DISTINCT event_type ORDER BY event_type)  AS event_types,
       max(coalesce(dead_at, claimed_at))                  AS latest
  FROM outbox
 WHERE last_error IS NOT NULL
   AND ((state = 'pending' AND attempts > 0 AND claimed_at >= now() - :'window'::interval)
        OR (state = 'dead' AND dead_at >= now() - :'window'::interval))
 GROUP BY 1
 ORDER BY count(*) DESC, 1
 LIMIT 20;
