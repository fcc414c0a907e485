-- outboxpg: is the outbox healthy?
--
--   psql -X -v ON_ERROR_STOP=1 -d yourdb -f sql/health.sql      (or \i sql/health.sql in psql)
--
-- Shows, read-only:
--   1. the outbox_health row: backlog (pending + leased), age of the oldest undelivered event,
--      dead letters, expired leases, the last claim and whether a worker claimed in the last minute
--      (cheap: reads only unfinished events);
--   2. events per state, every state listed even when it has none (reads the whole table, like
--      outbox_stats: a query for people, not for a monitoring loop);
--   3. the 10 oldest undelivered events and why each one waits.
-- Healthy: no dead letters, no expired leases, and with a backlog, worker_claimed_last_minute = t
-- and an oldest_pending_age that does not keep growing.

\echo '== outbox_health (SELECT * FROM outbox_health, one line per column)'
SELECT v.item, v.value
  FROM outbox_health h
 CROSS JOIN LATERAL (VALUES (1, 'backlog',                    h.backlog::text),
                            (2, 'pending',                    h.pending::text),
                            (3, 'processing',                 h.processing::text),
                            (4, 'waiting_retry',              h.waiting_retry::text),
                            (5, 'dead',                       h.dead::text),
                            (6, 'expired_leases',             h.expired_leases::text),
                            (7, 'oldest_pending_age',         h.oldest_pending_age::text),
                            (8, 'last_claim_at',              h.last_claim_at::text),
                            (9, 'worker_claimed_last_minute', h.worker_claimed_last_minute::text)) AS v(n, item, value)
 ORDER BY v.n;

\echo '== events per state (reads the whole table)'
SELECT s.state,
       coalesce(c.events, 0)                                       AS events,
       c.oldest_created_at,
       c.newest_created_at
  FROM unnest(enum_range(NULL::outbox_state)) AS s(state)
  LEFT JOIN (SELECT state, count(*) AS events, min(created_at) AS oldest_created_at, max(created_at) AS newest_created_at
               FROM outbox GROUP BY state) c USING (state)
 ORDER BY s.state;

\echo '== the 10 oldest undelivered events, and why they wait'
SELECT o.id,
       o.aggregate_type,
       o.aggregate_id,
       o.event_type,
       o.state,
       o.attempts,
       now() - o.created_at AS age,
       CASE
           WHEN o.state = 'processing' AND o.locked_until < now()
               THEN format('lease expired %s ago (held by %s): the next claim retries it',
                           date_trunc('second', now() - o.locked_until), o.locked_by)
           WHEN o.state = 'processing'
               THEN format('leased by %s until %s', o.locked_by, o.locked_until)
           WHEN blocker.id IS NOT NULL
               THEN format('held back behind event %s of its aggregate (%s)', blocker.id, blocker.state)
           WHEN o.next_attempt_at > now()
               THEN format('retry %s at %s', o.attempts + 1, o.next_attempt_at)
           ELSE 'due: waiting for a worker to claim it'
       END AS why,
       o.last_error
  FROM (SELECT id, created_at, aggregate_type, aggregate_id, event_type, state, attempts, next_attempt_at,
               locked_by, locked_until, last_error
          FROM outbox WHERE in_flow ORDER BY created_at, id LIMIT 10) o
  LEFT JOIN LATERAL (SELECT e.id, e.state
                       FROM outbox e
                      WHERE e.aggregate_type = o.aggregate_type AND e.aggregate_id = o.aggregate_id
                        AND e.id < o.id AND e.unfinished
                      ORDER BY e.id LIMIT 1) blocker ON o.state = 'pending'
 ORDER BY o.created_at, o.id;
