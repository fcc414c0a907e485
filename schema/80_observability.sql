-- outboxpg schema: is it healthy, and why not? Views and functions for people and monitors.
--
--   SELECT * FROM outbox_health;                 -- one cheap row, for monitors
--   SELECT * FROM outbox_stats;                  -- every event counted: a tool for people
--   SELECT * FROM outbox_failing ORDER BY events DESC LIMIT 20;   -- what keeps failing, and why
--   SELECT * FROM outbox_open_producers();       -- open producing transactions, what they hold back
--   SELECT * FROM outbox_open_claims();          -- claims left open: no claim takes new events in
--   SELECT * FROM outbox_xmin_holders();         -- what holds back VACUUM, the oldest first
--   SELECT * FROM outbox_unfinished_subjects();  -- where the next events go
--
-- outbox_health reads only the unfinished events (pending, processing, dead: the rows of the
-- partial index outbox_unfinished_by_aggregate_idx), the one row of outbox_intake, and the
-- server's lock table and activity (memory, no table): its cost follows the backlog, not the
-- size of the table. Its row is computed by outbox_health_row(), a plpgsql function pinned to
-- index scans: statistics taken during a burst say "most rows are unfinished", and a plain view
-- was then planned as a parallel scan of whole partitions, long after the burst was delivered.
-- What the guard holds back is decided by the claim's own rule (outbox_commit_guard), checked
-- on the unfinished events read anyway: one hash of the aggregate per pending event, only while
-- a producing transaction is open.
--
-- The xmin horizon. VACUUM removes a dead row version only once no snapshot or transaction can
-- still see it. The outbox churns: every event is inserted, leased, marked published, and its
-- aggregate's head is updated a few times, so a relay at 2,000 events/s leaves thousands of dead
-- row versions a second. While something holds the horizon back, none of them can go, and the
-- claims and reports step over more of them. outbox_xmin_holders() names the holders:
--   session               a backend of this database whose snapshot (backend_xmin: a REPEATABLE
--                         READ or SERIALIZABLE transaction, a running query, an open cursor) or
--                         transaction id (backend_xid: it has written) is in pg_stat_activity;
--                         age: since its transaction began (xact_start). Autovacuum workers are
--                         left out (other vacuums ignore their xmin), and so is the caller.
--   prepared transaction  pg_prepared_xacts of this database (two-phase commit left undecided);
--                         it holds until COMMIT PREPARED or ROLLBACK PREPARED; age: since PREPARE.
--   replication slot      pg_replication_slots.xmin (a physical slot with hot_standby_feedback:
--                         the standby's oldest query), for every database of the cluster.
--   walsender             a standby's hot_standby_feedback without a slot (backend_xmin of a
--                         walsender).
-- A slot's catalog_xmin (logical decoding) is not listed: it holds back only the system
-- catalogs' dead rows, never the outbox's. Sessions of other databases are not listed either:
-- since PostgreSQL 14 their snapshots do not hold back this database's tables.
-- "Past the threshold" (outbox_settings.xmin_warn_after, 1 minute by default): a session or
-- prepared transaction older than that; an inactive replication slot with an xmin (nothing moves
-- it until the slot is dropped or its standby comes back). A slot or walsender in use has no
-- start time to read here (its xmin comes from a query on the standby): it is listed with its age
-- in transactions (xmin_age) but not counted as past; look at the standby's pg_stat_activity.
-- A healthy outbox workload's transactions last milliseconds: one minute is early enough to act
-- before the relay falls behind, and long enough not to name every slow report query. pg_dump
-- holds one snapshot for its whole run: it is named too, rightly.
--
-- Reading other roles' sessions in pg_stat_activity (xact_start, state) needs
-- pg_read_all_stats or a superuser: outbox_open_producers() and outbox_xmin_holders() run as
-- their owner. An owner without that right sees the holders (backend_xid and backend_xmin are
-- shown to everyone) but not their age: they are then listed with age NULL and never past the
-- threshold (GRANT pg_read_all_stats TO the owner). A holder is named by its pid, role, state,
-- age and application_name, never by its query: the text of another session's query may hold
-- another application's data, and workers and operators see these functions.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- Every event counted, published ones included: a tool for people, not for a tight loop.
-- Of the pending events, two kinds wait for a time: scheduled ones (never tried, deliver_at
-- ahead) and those waiting for a retry (failed at least once, backoff ahead). A scheduled event
-- is not a failure: counted apart, so that a dashboard of retries shows failures only. Nor is
-- it late: the oldest undelivered event's age counts from when an event is due
-- (greatest(created_at, deliver_at)), and a scheduled event not due yet has no age.
CREATE OR REPLACE VIEW outbox_stats AS
SELECT count(*) FILTER (WHERE state = 'pending')                                AS pending,
       count(*) FILTER (WHERE state = 'pending' AND attempts = 0 AND next_attempt_at > now()) AS scheduled,
       count(*) FILTER (WHERE state = 'pending' AND attempts > 0 AND next_attempt_at > now()) AS waiting_retry,
       count(*) FILTER (WHERE state = 'processing')                             AS processing,
       count(*) FILTER (WHERE state = 'published')                              AS published,
       count(*) FILTER (WHERE state = 'dead')                                   AS dead,
       count(*) FILTER (WHERE state = 'discarded')                              AS discarded,
       now() - min(greatest(created_at, deliver_at))
                 FILTER (WHERE state = 'processing' OR (state = 'pending'
                               AND NOT (attempts = 0 AND next_attempt_at > now())))   AS oldest_pending_age,
       now() - min(claimed_at) FILTER (WHERE state = 'processing')              AS oldest_lease_age,
       max(claimed_at)                                                          AS last_claim_at
  FROM outbox;

COMMENT ON VIEW outbox_stats IS
    'One row: events per state (of the pending ones: scheduled, never tried and not due yet; waiting_retry, failed and waiting for their next attempt), age of the oldest undelivered event that is due (from its due time), oldest running lease''s age, last claim time.';

-- Events failing right now (failed at least once, not delivered yet: pending and waiting for
-- their retry, or leased again for one), grouped by their last error's first line with the
-- digits masked, so that "no ack for event 17" and "... 18" are one reason. Only unfinished
-- events are read, and no payload or headers. subjects: where those events go, resolved as the
-- claim resolves them, which names the subject that a "(no responders)" error lacks.
CREATE OR REPLACE VIEW outbox_failing AS
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

-- Who holds what back right now: one row per open producing transaction (for outbox_health,
-- `outboxpg status` and sql/health.sql). aggregates: how many it names (NULL: too many, it holds
-- back every event above held_above); held_above: it may still commit ids above this.
CREATE OR REPLACE FUNCTION outbox_open_producers()
RETURNS TABLE (pid integer, xact_age interval, state text, held_above bigint, aggregates integer, all_newer boolean)
LANGUAGE plpgsql
STABLE
-- Runs as its owner: reads other roles' sessions in pg_stat_activity.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY
    WITH l AS MATERIALIZED (
        SELECT l.pid, l.classid, l.objid, l.objsubid
          FROM pg_locks l
         WHERE l.locktype = 'advisory'
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()))
    SELECT p.pid, now() - a.xact_start, a.state,
           (SELECT min(-((x.classid::bigint << 32) | x.objid::bigint) - 1) FROM l x
             WHERE x.pid = p.pid AND x.objsubid = 1 AND x.classid >= 2147483648),
           (SELECT count(*)::integer FROM l x WHERE x.pid = p.pid AND x.objsubid = 2 AND x.classid = 1868724337),
           EXISTS (SELECT 1 FROM l x WHERE x.pid = p.pid AND x.objsubid = 2 AND x.classid = 1868724336 AND x.objid = 4)
      FROM (SELECT DISTINCT x.pid FROM l x WHERE x.objsubid = 2 AND x.classid = 1868724336 AND x.objid = 3) p
      LEFT JOIN pg_stat_activity a ON a.pid = p.pid
     ORDER BY a.xact_start;
END;
$$;

COMMENT ON FUNCTION outbox_open_producers() IS
    'Open transactions that have inserted into outbox, with what they hold back: the aggregates they wrote (all_newer: every event above held_above).';

-- Claims whose transaction has stayed open for more than a second, one row per session. Such a
-- transaction holds the intake row: until it ends, no claim takes new events in, and the
-- claims' last_claim_at (written on that row) stands still. A worker's claim is a transaction
-- of milliseconds; one left open is a session that claimed after BEGIN (psql, a driver that
-- does not autocommit), which the server ends once it has been idle for its lease
-- (outbox_claim). Found by its lock on the intake row (outbox_intake_holders), named by pid,
-- state, age and application_name, never by its query. Without pg_read_all_stats for the owner
-- the age of other roles' sessions is unknown, and none of them is listed.
CREATE OR REPLACE FUNCTION outbox_open_claims()
RETURNS TABLE (pid integer, xact_age interval, state text, application_name text)
LANGUAGE plpgsql
STABLE
-- Runs as its owner: reads other roles' sessions in pg_stat_activity.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN QUERY
    SELECT a.pid, now() - a.xact_start, a.state, a.application_name::text
      FROM outbox_intake_holders() h(holder)
      JOIN pg_stat_activity a ON a.pid = h.holder
     WHERE a.xact_start < now() - interval '1 second'
     ORDER BY a.xact_start;
END;
$$;

COMMENT ON FUNCTION outbox_open_claims() IS
    'Sessions whose claim has held its transaction open for over a second: until they end, no claim takes new events in (the server ends one idle for its lease).';

CREATE OR REPLACE FUNCTION outbox_health_row()
RETURNS TABLE (
    backlog                    bigint,
    pending                    bigint,
    processing                 bigint,
    scheduled                  bigint,
    waiting_retry              bigint,
    dead                       bigint,
    expired_leases             bigint,
    oldest_pending_age         interval,
    last_claim_at              timestamptz,
    worker_claimed_last_minute boolean,
    open_producers             integer,
    oldest_producer_pid        integer,
    oldest_producer_age        interval,
    held_by_open_transactions  bigint
)
LANGUAGE plpgsql
STABLE
ROWS 1
-- Runs as its owner: the view that calls it runs it as the one who reads the view.
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
-- With sequential scans off, any plan with one (outbox_settings, the id sequence) is costed
-- above jit_above_cost: JIT compiled it on every call (8 ms a call here, 84 ms the first).
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    n_pending    bigint;
    n_processing bigint;
    n_scheduled  bigint;
    n_waiting    bigint;
    n_dead       bigint;
    n_expired    bigint;
    n_held       bigint;
    oldest       timestamptz;
    last_claim   timestamptz;
    n_producers  integer := 0;
    p_pid        integer;
    p_age        interval;
    guard_on     boolean;
    -- What the claim holds back (outbox_commit_guard): ids above settled, unless at or below
    -- open_below and of an aggregate whose key is not in held_keys. NULL settled: nothing.
    settled      bigint;
    open_below   bigint;
    held_keys    integer[];
BEGIN
    SELECT i.last_claim_at INTO last_claim FROM outbox_intake i;

    IF to_regprocedure('outbox_open_producers()') IS NOT NULL THEN
        SELECT count(*)::integer,
               (array_agg(p.pid ORDER BY p.xact_age DESC NULLS LAST, p.held_above))[1],
               (array_agg(p.xact_age ORDER BY p.xact_age DESC NULLS LAST, p.held_above))[1]
          INTO n_producers, p_pid, p_age
          FROM outbox_open_producers() p;
    END IF;
    IF n_producers > 0 THEN
        SELECT s.commit_order_guard INTO guard_on FROM outbox_settings s;
        IF guard_on THEN
            SELECT g.settled, g.open_below, g.held_keys INTO settled, open_below, held_keys
              FROM outbox_commit_guard() g;
        END IF;
    END IF;

    -- One pass over the unfinished events (the partial index outbox_unfinished_by_aggregate_idx).
    SELECT count(*) FILTER (WHERE o.state = 'pending'),
           count(*) FILTER (WHERE o.state = 'processing'),
           count(*) FILTER (WHERE o.state = 'pending' AND o.attempts = 0 AND o.next_attempt_at > now()),
           count(*) FILTER (WHERE o.state = 'pending' AND o.attempts > 0 AND o.next_attempt_at > now()),
           count(*) FILTER (WHERE o.state = 'dead'),
           count(*) FILTER (WHERE o.state = 'processing' AND o.locked_until < now()),
           count(*) FILTER (WHERE o.state = 'pending' AND o.id > settled
                              AND (o.id > open_below
                                   OR outbox_aggregate_key(o.aggregate_type, o.aggregate_id) = ANY (held_keys))),
           -- Due time, not creation; a scheduled event not due yet is not late (outbox_stats).
           min(greatest(o.created_at, o.deliver_at))
               FILTER (WHERE o.state = 'processing' OR (o.state = 'pending'
                             AND NOT (o.attempts = 0 AND o.next_attempt_at > now())))
      INTO n_pending, n_processing, n_scheduled, n_waiting, n_dead, n_expired, n_held, oldest
      FROM outbox o
     WHERE o.unfinished;

    RETURN QUERY SELECT n_pending + n_processing, n_pending, n_processing, n_scheduled, n_waiting, n_dead, n_expired,
                        now() - oldest, last_claim,
                        coalesce(last_claim >= now() - interval '1 minute', false),
                        n_producers, p_pid, p_age, n_held;
END;
$$;

COMMENT ON FUNCTION outbox_health_row() IS
    'The row of the outbox_health view (computed with index scans only).';

CREATE OR REPLACE FUNCTION outbox_xmin_holders()
RETURNS TABLE (kind text, pid integer, name text, since timestamptz, age interval, xmin_age integer,
               state text, role text, application_name text, past_threshold boolean)
LANGUAGE sql
STABLE
-- Reads other roles' sessions in pg_stat_activity: runs as its owner (see above).
SECURITY DEFINER
SET search_path FROM CURRENT
-- pg_stat_activity and the others are functions estimated at 1,000 rows each: keep the planner
-- from compiling a query that reads a few dozen rows of memory.
SET jit = off
AS $$
    WITH holder AS (
        SELECT 'session'::text AS kind, a.pid, NULL::text AS name, a.xact_start AS since,
               greatest(age(a.backend_xmin), age(a.backend_xid)) AS xmin_age,
               a.state, a.usename::text AS role, a.application_name
          FROM pg_stat_activity a
         WHERE a.datname = current_database()
           AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
           AND a.pid <> pg_backend_pid()
           AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
        UNION ALL
        SELECT 'walsender', a.pid, a.client_addr::text, NULL, age(a.backend_xmin),
               a.state, a.usename::text, a.application_name
          FROM pg_stat_activity a
         WHERE a.backend_type = 'walsender' AND a.backend_xmin IS NOT NULL
        UNION ALL
        SELECT 'prepared transaction', NULL, p.gid, p.prepared, age(p.transaction),
               'prepared', NULL, NULL
          FROM pg_prepared_xacts p
         WHERE p.database = current_database()
        UNION ALL
        SELECT 'replication slot', r.active_pid, r.slot_name, NULL, age(r.xmin),
               CASE WHEN r.active THEN 'active' ELSE 'inactive' END, NULL, NULL
          FROM pg_replication_slots r
         WHERE r.xmin IS NOT NULL)
    SELECT h.kind, h.pid, h.name, h.since, now() - h.since, h.xmin_age, h.state, h.role, h.application_name,
           CASE WHEN h.kind = 'replication slot' THEN h.state = 'inactive'
                WHEN h.kind = 'walsender' THEN false
                ELSE coalesce(now() - h.since > s.xmin_warn_after, false)
           END
      FROM holder h CROSS JOIN outbox_settings s
     ORDER BY h.xmin_age DESC NULLS LAST, h.since NULLS LAST, h.pid
$$;

COMMENT ON FUNCTION outbox_xmin_holders() IS
    'What holds back the xmin horizon (VACUUM of the outbox) in this database, the oldest first: sessions, prepared transactions, replication slots, walsenders; past_threshold: held longer than outbox_settings.xmin_warn_after (a slot: inactive).';

-- The row of outbox_health_row(), and the oldest xmin holder past the threshold with how many
-- there are: those columns read no outbox table, so they need none of the row's pinned plans.
CREATE OR REPLACE VIEW outbox_health AS
SELECT h.backlog, h.pending, h.processing, h.scheduled, h.waiting_retry, h.dead, h.expired_leases, h.oldest_pending_age,
       h.last_claim_at, h.worker_claimed_last_minute, h.open_producers, h.oldest_producer_pid,
       h.oldest_producer_age, h.held_by_open_transactions,
       coalesce(x.holders, 0)::integer AS xmin_holders,
       x.kind              AS xmin_holder_kind,
       x.pid               AS xmin_holder_pid,
       x.name              AS xmin_holder_name,
       x.age               AS xmin_holder_age,
       x.state             AS xmin_holder_state,
       x.role              AS xmin_holder_role,
       x.application_name  AS xmin_holder_application
  FROM outbox_health_row() h
  LEFT JOIN LATERAL (SELECT x.kind, x.pid, x.name, x.age, x.state, x.role, x.application_name,
                            count(*) OVER () AS holders
                       FROM outbox_xmin_holders() x
                      WHERE x.past_threshold
                      ORDER BY x.xmin_age DESC NULLS LAST
                      LIMIT 1) x ON true;

COMMENT ON VIEW outbox_health IS
    'One row, cheap (reads unfinished events, the intake row, the lock table and the server''s activity, never the bulk of published ones): backlog, oldest pending age, dead letters, expired leases, last claim and whether a worker claimed within the last minute, open producing transactions and what they hold back, and what holds back the xmin horizon past outbox_settings.xmin_warn_after.';
COMMENT ON COLUMN outbox_health.backlog IS 'Events pending (incl. scheduled, waiting for a retry or held back) or leased.';
COMMENT ON COLUMN outbox_health.scheduled IS 'Pending events never tried whose deliver_at is ahead: waiting for their time, not failing.';
COMMENT ON COLUMN outbox_health.waiting_retry IS 'Pending events that failed and wait for their next attempt (backoff).';
COMMENT ON COLUMN outbox_health.oldest_pending_age IS 'now() - due time (greatest(created_at, deliver_at)) of the oldest pending or leased event that is due; scheduled events not due yet do not count; NULL when there is none.';
COMMENT ON COLUMN outbox_health.dead IS 'Dead letters: each holds back the later events of its aggregate until requeued or discarded.';
COMMENT ON COLUMN outbox_health.expired_leases IS 'Leases past locked_until (worker died or hung); the next outbox_claim() retries them.';
COMMENT ON COLUMN outbox_health.last_claim_at IS 'When a worker last called outbox_claim (outbox_intake, to the second), whatever it found; NULL: never.';
COMMENT ON COLUMN outbox_health.worker_claimed_last_minute IS 'last_claim_at within the last minute. With a backlog, false means no worker is claiming.';
COMMENT ON COLUMN outbox_health.open_producers IS 'Open transactions that have inserted into outbox (outbox_open_producers()).';
COMMENT ON COLUMN outbox_health.oldest_producer_pid IS 'Backend pid of the producing transaction open longest; NULL when none is open.';
COMMENT ON COLUMN outbox_health.oldest_producer_age IS 'How long that transaction has been open; NULL when none is, or when the owner may not see its session.';
COMMENT ON COLUMN outbox_health.held_by_open_transactions IS 'Pending events the commit-order guard holds back until open producing transactions end.';
COMMENT ON COLUMN outbox_health.xmin_holders IS 'Holders of the xmin horizon past outbox_settings.xmin_warn_after (outbox_xmin_holders()): while they hold it, VACUUM removes no dead row version of the outbox and claims slow down.';
COMMENT ON COLUMN outbox_health.xmin_holder_kind IS 'The oldest of them: session, prepared transaction, replication slot; NULL when none.';
COMMENT ON COLUMN outbox_health.xmin_holder_pid IS 'Its backend pid (a session; a slot''s walsender); pg_terminate_backend(pid) ends a session.';
COMMENT ON COLUMN outbox_health.xmin_holder_name IS 'The prepared transaction''s gid or the replication slot''s name.';
COMMENT ON COLUMN outbox_health.xmin_holder_age IS 'How long it has held: since its transaction began (a session), since PREPARE (a prepared transaction); NULL for a slot.';
COMMENT ON COLUMN outbox_health.xmin_holder_state IS 'pg_stat_activity.state (e.g. idle in transaction); prepared; a slot: active or inactive.';
COMMENT ON COLUMN outbox_health.xmin_holder_role IS 'The role the session (or walsender) logged in as.';
COMMENT ON COLUMN outbox_health.xmin_holder_application IS 'The session''s application_name.';

-- The subjects the next events to go out will be published to. A JetStream stream must capture
-- each of them, or every publish of the event fails ("no responders") until it dies; a stream
-- made for <subject_prefix>.> captures the default subjects, not an explicit
-- 'billing.invoice.issued'. The worker checks them at start (--ensure-stream adds the explicit
-- ones to its stream), and outboxpg status --nats-url checks them all. A worker login may not
-- read the table, hence a function that runs as its owner and returns no event data but
-- subjects and counts. It reads the next 10,000 events to go out at most (pending and leased,
-- in id order, from outbox_in_flow_idx), never the published bulk: reading a whole backlog of a
-- million events at every worker start took seconds. Dead letters are not read: they go
-- nowhere until requeued.
CREATE OR REPLACE FUNCTION outbox_unfinished_subjects(max_subjects integer DEFAULT 100)
RETURNS TABLE (subject text, explicit boolean, events bigint)
LANGUAGE sql STABLE
-- Runs as its owner: a worker has no rights on the table.
SECURITY DEFINER
SET search_path FROM CURRENT
-- Cheap by design, but estimated dear (the planner guesses hundreds of settings rows): without
-- this, JIT compiled it on every call (150 ms of a 156 ms call).
SET jit = off
AS $$
    SELECT coalesce(o.subject::text, s.subject_prefix || '.' || o.aggregate_type || '.' || o.event_type),
           o.subject IS NOT NULL,
           count(*)
      FROM (SELECT o.subject, o.aggregate_type, o.event_type
              FROM outbox o
             WHERE o.in_flow
             ORDER BY o.id
             LIMIT 10000) o
     CROSS JOIN outbox_settings s
     GROUP BY 1, 2
     ORDER BY 3 DESC, 1
     LIMIT max_subjects
$$;

COMMENT ON FUNCTION outbox_unfinished_subjects(integer) IS
    'The subjects the next events to go out (pending and leased, the first 10,000 in id order) go to: explicit (the event''s own) or the default <subject_prefix>.<aggregate_type>.<event_type>, with how many events each; the most used first, at most max_subjects.';

-- Who, besides superusers and the roles of the schema's and the outbox's owners, may create
-- objects in the install schema:
-- such a role can plant a function or operator that the SECURITY DEFINER functions, whose
-- search_path is this schema, would pick over a built-in (an exact format(text, timestamptz,
-- text) wins over format(text, VARIADIC "any")), and so run its code as the owner. The install
-- refuses then (90_privileges.sql), and so does the worker at start: an install opened up later
-- is caught when the worker next starts. NULL: nobody.
CREATE OR REPLACE FUNCTION outbox_untrusted_creators() RETURNS text
LANGUAGE sql
STABLE
SET search_path FROM CURRENT
AS $$
    -- The schema's own grants of CREATE, so that the answer names whom to REVOKE it from (a
    -- grant to PUBLIC is one name, not every role).
    SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                      ', ' ORDER BY a.grantee <> 0, pg_get_userbyid(a.grantee))
      FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
     WHERE n.oid = current_schema()::regnamespace
       AND a.privilege_type = 'CREATE'
       AND (a.grantee = 0
            OR NOT (pg_has_role(a.grantee, n.nspowner, 'USAGE')
                    OR pg_has_role(a.grantee, (SELECT c.relowner FROM pg_class c WHERE c.oid = 'outbox'::regclass),
                                   'USAGE')
                    OR (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = a.grantee)))
$$;

COMMENT ON FUNCTION outbox_untrusted_creators() IS
    'Roles other than the schema owner''s and superusers that may CREATE in the install schema, where they could plant objects the SECURITY DEFINER functions would use (NULL: none). The install and the worker refuse while there are any.';
