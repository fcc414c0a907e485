-- outboxpg: is the outbox healthy?
--
--   psql -X -v ON_ERROR_STOP=1 -d yourdb -f sql/health.sql      (or \i sql/health.sql in psql)
--
-- Shows, read-only:
--   1. the outbox_health row: backlog (pending + leased), age of the oldest undelivered event,
--      dead letters, expired leases, when a worker last called outbox_claim and whether that was
--      in the last minute, open producing transactions and the events they hold back
--      (cheap: reads only unfinished events);
--   2. the open producing transactions (outbox_open_producers()): backend pid, who, how long open,
--      and what each holds back until it commits or rolls back: the aggregates it wrote, or every
--      event above an id once it wrote more than outbox_settings.commit_order_max_aggregates;
--      then the claims left open in their transaction for over a second (outbox_open_claims()):
--      until one ends, no claim takes new events in (the server ends it once idle for its lease);
--   3. what holds back the xmin horizon (outbox_xmin_holders()), the oldest first: sessions (pid,
--      application, state, since when, the start of the query), prepared transactions, replication
--      slots; past_threshold: older than outbox_settings.xmin_warn_after. While one holds, VACUUM
--      removes no dead row version of the outbox and every claim steps over more of them;
--   4. events per state, every state listed even when it has none (reads the whole table, like
--      outbox_stats: a query for people, not for a monitoring loop);
--   5. the 10 oldest undelivered events and why each one waits: leased (until when, by whom),
--      lease expired, held back behind an earlier event of its aggregate (a dead letter: requeue
--      or discard it), waiting for a retry, held back by an open producing transaction (which pid,
--      open how long), or due and waiting for a worker's claim (with the time of the last claim);
--      a due event whose aggregate's head (outbox_heads) is not ready says until when.
-- Healthy: no dead letters, no expired leases, and with a backlog, worker_claimed_last_minute = t
-- and an oldest_pending_age that does not keep growing. held_by_open_transactions > 0 for long
-- means a producing transaction stays open: end it in the application, or pg_terminate_backend(pid).
-- xmin_holders > 0 names a session, prepared transaction or replication slot that has kept VACUUM
-- from the outbox's dead rows for longer than xmin_warn_after: end it (pg_terminate_backend(pid);
-- COMMIT/ROLLBACK PREPARED 'gid'; pg_drop_replication_slot('name') for a slot nothing uses).

\echo '== outbox_health (SELECT * FROM outbox_health, one line per column)'
SELECT v.item, v.value
  FROM outbox_health h
 CROSS JOIN LATERAL (VALUES (1,  'backlog',                    h.backlog::text),
                            (2,  'pending',                    h.pending::text),
                            (3,  'processing',                 h.processing::text),
                            (4,  'scheduled',                  h.scheduled::text),
                            (5,  'waiting_retry',              h.waiting_retry::text),
                            (6,  'dead',                       h.dead::text),
                            (7,  'expired_leases',             h.expired_leases::text),
                            (8,  'oldest_pending_age',         h.oldest_pending_age::text),
                            (9,  'last_claim_at',              h.last_claim_at::text),
                            (10, 'worker_claimed_last_minute', h.worker_claimed_last_minute::text),
                            (11, 'open_producers',             h.open_producers::text),
                            (12, 'oldest_producer_pid',        h.oldest_producer_pid::text),
                            (13, 'oldest_producer_age',        h.oldest_producer_age::text),
                            (14, 'held_by_open_transactions',  h.held_by_open_transactions::text),
                            (15, 'xmin_holders',               h.xmin_holders::text),
                            (16, 'xmin_holder_kind',           h.xmin_holder_kind),
                            (17, 'xmin_holder_pid',            h.xmin_holder_pid::text),
                            (18, 'xmin_holder_name',           h.xmin_holder_name),
                            (19, 'xmin_holder_age',            h.xmin_holder_age::text),
                            (20, 'xmin_holder_state',          h.xmin_holder_state),
                            (21, 'xmin_holder_role',           h.xmin_holder_role),
                            (22, 'xmin_holder_application',    h.xmin_holder_application)) AS v(n, item, value)
 ORDER BY v.n;

\echo '== open producing transactions, oldest first (outbox_open_producers())'
SELECT p.pid,
       a.usename,
       a.application_name,
       date_trunc('second', p.xact_age) AS open_for,
       p.state,
       CASE WHEN p.all_newer
            THEN format('every event newer than id %s (it wrote more than %s aggregates)',
                        p.held_above, s.commit_order_max_aggregates)
            ELSE format('the %s aggregate(s) it wrote, events newer than id %s', p.aggregates, p.held_above)
       END AS holds_back
  FROM outbox_open_producers() p
  LEFT JOIN pg_stat_activity a ON a.pid = p.pid
 CROSS JOIN outbox_settings s
 ORDER BY p.xact_age DESC NULLS LAST, p.held_above;

\echo '== claims left open in their transaction: no claim takes new events in until they end (outbox_open_claims())'
SELECT c.pid, c.application_name, date_trunc('second', c.xact_age) AS open_for, c.state
  FROM outbox_open_claims() c
 ORDER BY c.xact_age DESC;

\echo '== what holds back the xmin horizon (VACUUM), the oldest first (outbox_xmin_holders())'
SELECT x.kind,
       x.pid,
       x.name,
       x.application_name,
       x.state,
       date_trunc('second', x.age) AS held_for,
       x.xmin_age                  AS xmin_age_xacts,
       x.past_threshold            AS past_xmin_warn_after,
       x.role
  FROM outbox_xmin_holders() x;

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
-- The commit-order guard as outbox_claim applies it (outbox_commit_guard): a pending event
-- is held back when its id is above the horizon of an open producing transaction and either
-- that transaction names its aggregate (an advisory lock (1868724337, outbox_aggregate_key(...)))
-- or one that wrote too many aggregates has a horizon below it.
WITH producers AS MATERIALIZED (
    SELECT p.pid, p.xact_age, p.state, p.held_above, p.all_newer FROM outbox_open_producers() p),
guard AS MATERIALIZED (
    SELECT s.commit_order_guard AS active, (SELECT min(p.held_above) FROM producers p) AS settled
      FROM outbox_settings s),
held_keys AS MATERIALIZED (
    SELECT l.pid,
           (l.objid::bigint - CASE WHEN l.objid::bigint >= 2147483648 THEN 4294967296 ELSE 0 END)::integer AS key
      FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.classid = 1868724337 AND l.objsubid = 2
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())),
intake AS (
    SELECT i.last_claim_at FROM outbox_intake i)
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
           WHEN blocker.state = 'dead'
               THEN format('held back behind event %s of its aggregate (dead): requeue or discard it', blocker.id)
           WHEN blocker.id IS NOT NULL
               THEN format('held back behind event %s of its aggregate (%s)', blocker.id, blocker.state)
           WHEN o.next_attempt_at > now()
               THEN format('retry %s at %s', o.attempts + 1, o.next_attempt_at)
           WHEN holder.pid IS NOT NULL AND holder.everything
               THEN format('held back by open transaction pid %s (open %s, %s): it wrote too many aggregates and holds back every event newer than id %s',
                           holder.pid, coalesce(date_trunc('second', holder.xact_age)::text, 'for an unknown time'),
                           coalesce(holder.state, 'state unknown'), holder.held_above)
           WHEN holder.pid IS NOT NULL
               THEN format('held back by open transaction pid %s (open %s, %s): it may still commit an earlier event of this aggregate',
                           holder.pid, coalesce(date_trunc('second', holder.xact_age)::text, 'for an unknown time'),
                           coalesce(holder.state, 'state unknown'))
           WHEN blocker.id IS NULL AND hd.aggregate_id IS NOT NULL AND hd.ready_at IS NULL
               THEN 'due, but its aggregate''s head in outbox_heads says held by a dead letter (ready_at NULL)'
           WHEN blocker.id IS NULL AND hd.ready_at > now()
               THEN format('due, but its aggregate''s head in outbox_heads is not ready before %s', hd.ready_at)
           WHEN blocker.id IS NULL AND hd.parked
               THEN 'due: its aggregate''s head in outbox_heads is parked; the next claim takes the event in and brings the head back'
           WHEN blocker.id IS NULL AND hd.leased_until > now()
               THEN format('due, but its aggregate''s head in outbox_heads is leased to a run until %s', hd.leased_until)
           WHEN (SELECT last_claim_at FROM intake) IS NULL
               THEN 'due: waiting for a worker to claim it (no worker has ever claimed)'
           ELSE format('due: waiting for a worker to claim it (last claim %s ago)',
                       date_trunc('second', now() - (SELECT last_claim_at FROM intake)))
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
  LEFT JOIN outbox_heads hd ON hd.aggregate_type = o.aggregate_type AND hd.aggregate_id = o.aggregate_id
  LEFT JOIN LATERAL (SELECT p.pid, p.xact_age, p.state, p.held_above,
                            p.all_newer AND o.id > p.held_above AS everything
                       FROM producers p, guard g
                      WHERE g.active AND o.id > g.settled
                        AND ((p.all_newer AND o.id > p.held_above)
                             OR EXISTS (SELECT 1 FROM held_keys k
                                         WHERE k.pid = p.pid
                                           AND k.key = outbox_aggregate_key(o.aggregate_type, o.aggregate_id)))
                      ORDER BY p.all_newer AND o.id > p.held_above DESC, p.xact_age DESC NULLS LAST
                      LIMIT 1) holder ON o.state = 'pending'
 ORDER BY o.created_at, o.id;
