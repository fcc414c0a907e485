-- outboxpg: events leased right now, and who holds them.
--
--   psql -X -v ON_ERROR_STOP=1 -d yourdb -f sql/leases.sql      (or \i sql/leases.sql in psql)
--
-- Shows, read-only (it reads only events in flight, through the partial index outbox_in_flow_idx):
--   1. per owner (locked_by: the worker's --name, by default host:pid; or the claiming session's
--      application_name): leased events, the claims behind them (one claim time each), how many are past
--      locked_until, the oldest claim and the first and last expiry;
--   2. the expired leases one by one (at most 20): their worker died or hung. A claim hands out
--      a run (consecutive events of one aggregate) under one lease; the next outbox_claim() by
--      any worker reclaims an expired run: its first event counts a failed attempt and is
--      retried after a backoff (or dead-lettered once out of attempts), the events after it go
--      back to pending without an attempt counted. Nothing needs to be done by hand.
-- A lease that keeps running far longer than the others points at a worker stuck publishing.

\echo '== leases per owner'
SELECT locked_by,
       count(*)                                      AS leased,
       count(DISTINCT claimed_at)                    AS claims,
       count(*) FILTER (WHERE locked_until < now())  AS expired,
       min(claimed_at)                               AS oldest_claimed_at,
       date_trunc('second', now() - min(claimed_at)) AS oldest_claim_age,
       min(locked_until)                             AS first_locked_until,
       max(locked_until)                             AS last_locked_until
  FROM outbox
 WHERE in_flow AND state = 'processing'
 GROUP BY locked_by
 ORDER BY locked_by;

\echo '== expired leases (at most 20; the next claim reclaims their runs)'
SELECT id,
       aggregate_type,
       aggregate_id,
       event_type,
       attempts,
       locked_by,
       claimed_at,
       locked_until,
       date_trunc('second', now() - locked_until) AS expired_for
  FROM outbox
 WHERE in_flow AND state = 'processing' AND locked_until < now()
 ORDER BY locked_until, id
 LIMIT 20;
