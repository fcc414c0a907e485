-- outboxpg 0017: who holds back the xmin horizon, and since when.
--
--   SELECT * FROM outbox_xmin_holders();                  -- every holder, the oldest first
--   SELECT xmin_holders, xmin_holder_kind, xmin_holder_pid, xmin_holder_age FROM outbox_health;
--
-- VACUUM removes a dead row version only once no snapshot or transaction can still see it: the
-- oldest xmin of the cluster's sessions, prepared transactions and replication slots (the "xmin
-- horizon") decides. The outbox churns: every event is inserted, leased, marked published, and
-- its aggregate's head (outbox_heads) is updated a few times, so a relay at 2,000 events/s leaves
-- thousands of dead row versions a second. While something holds the horizon back, none of them
-- can go, and every claim steps over the ones in its indexes: measured (issue 13) with a
-- REPEATABLE READ transaction left idle, at 2,000 events/s the mean outbox_claim went from 0.84 to
-- 147 ms after 80 s and to 290 ms after 180 s, delivery fell below the producers' rate, and
-- nothing said why. This step names the culprit; it does not make the claim cheaper.
--
-- The holders, one row each (outbox_xmin_holders()):
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
--
-- "Past the threshold" (outbox_settings.xmin_warn_after, 1 minute by default): a session or
-- prepared transaction older than that; an inactive replication slot with an xmin (nothing moves
-- it until the slot is dropped or its standby comes back). A slot or walsender in use has no
-- start time to read here (its xmin comes from a query on the standby): it is listed with its age
-- in transactions (xmin_age) but not counted as past; look at the standby's pg_stat_activity.
-- Why 1 minute: a healthy outbox workload's transactions last milliseconds, and the claim cost
-- grows with the dead versions kept, so about linearly with the time held (37 ms a claim after
-- 80 s at 800 events/s): one minute is early enough to act before the relay falls behind, and
-- long enough not to name every slow report query. pg_dump holds one snapshot for its whole run:
-- it is named too, rightly.
--
-- outbox_health gets the count of holders past the threshold and the oldest of them (kind, pid,
-- slot or prepared transaction name, age, state, the start of its query, application_name);
-- NULLs when there is none. outboxpg status warns with it, the worker logs it once per holder
-- (event=xmin_held, checked every --xmin-check-interval), sql/health.sql lists all holders.
--
-- Why the view is extended rather than outbox_health_row() replaced: the new columns read no
-- outbox table (pg_stat_activity, pg_prepared_xacts, pg_replication_slots are memory), so they
-- need none of the row's pinned index plans; a function whose result changes must be dropped and
-- made anew (its grants, SECURITY DEFINER and SET clauses restated), while CREATE OR REPLACE VIEW
-- may add columns at the end and keeps the view's grants and comments. outbox_health_row() stays
-- as 0011 and 0012 made it.
--
-- Least privilege: reading other roles' sessions in pg_stat_activity (xact_start, state, query)
-- needs pg_read_all_stats or a superuser, as for outbox_open_producers (0013): the function runs
-- as its owner, and workers and operators may call it. An owner without that right sees the
-- holders (backend_xid and backend_xmin are shown to everyone) but not their age: they are then
-- listed with age NULL and never past the threshold (GRANT pg_read_all_stats TO the owner).
-- depends: 0001_outbox_settings 0011_outbox_health 0012_outbox_privileges
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

ALTER TABLE outbox_settings
    ADD COLUMN xmin_warn_after interval NOT NULL DEFAULT '1 minute'
        CONSTRAINT xmin_warn_after_positive CHECK (xmin_warn_after > interval '0');

COMMENT ON COLUMN outbox_settings.xmin_warn_after IS
    'A session or prepared transaction holding back the xmin horizon longer than this is named by outbox_health, outboxpg status and the worker''s log (0017).';

CREATE FUNCTION outbox_xmin_holders()
RETURNS TABLE (kind text, pid integer, name text, since timestamptz, age interval, xmin_age integer,
               state text, query text, application_name text, past_threshold boolean)
LANGUAGE sql
STABLE
-- Reads other roles' sessions in pg_stat_activity: runs as its owner (see the header).
SECURITY DEFINER
SET search_path FROM CURRENT
-- pg_stat_activity and the others are functions estimated at 1,000 rows each: keep the planner
-- from compiling a query that reads a few dozen rows of memory.
SET jit = off
AS $$
    WITH holder AS (
        SELECT 'session'::text AS kind, a.pid, NULL::text AS name, a.xact_start AS since,
               greatest(age(a.backend_xmin), age(a.backend_xid)) AS xmin_age,
               a.state, left(a.query, 200) AS query, a.application_name
          FROM pg_stat_activity a
         WHERE a.datname = current_database()
           AND (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
           AND a.pid <> pg_backend_pid()
           AND a.backend_type IS DISTINCT FROM 'autovacuum worker'
        UNION ALL
        SELECT 'walsender', a.pid, a.client_addr::text, NULL, age(a.backend_xmin),
               a.state, NULL, a.application_name
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
    SELECT h.kind, h.pid, h.name, h.since, now() - h.since, h.xmin_age, h.state, h.query, h.application_name,
           CASE WHEN h.kind = 'replication slot' THEN h.state = 'inactive'
                WHEN h.kind = 'walsender' THEN false
                ELSE coalesce(now() - h.since > s.xmin_warn_after, false)
           END
      FROM holder h CROSS JOIN outbox_settings s
     ORDER BY h.xmin_age DESC NULLS LAST, h.since NULLS LAST, h.pid
$$;

COMMENT ON FUNCTION outbox_xmin_holders() IS
    'What holds back the xmin horizon (VACUUM of the outbox) in this database, the oldest first: sessions, prepared transactions, replication slots, walsenders; past_threshold: held longer than outbox_settings.xmin_warn_after (a slot: inactive).';

-- The view keeps its 13 columns and their order (CREATE OR REPLACE VIEW may only add at the end).
CREATE OR REPLACE VIEW outbox_health AS
SELECT h.backlog, h.pending, h.processing, h.waiting_retry, h.dead, h.expired_leases, h.oldest_pending_age,
       h.last_claim_at, h.worker_claimed_last_minute, h.open_producers, h.oldest_producer_pid,
       h.oldest_producer_age, h.held_by_open_transactions,
       coalesce(x.holders, 0)::integer AS xmin_holders,
       x.kind              AS xmin_holder_kind,
       x.pid               AS xmin_holder_pid,
       x.name              AS xmin_holder_name,
       x.age               AS xmin_holder_age,
       x.state             AS xmin_holder_state,
       x.query             AS xmin_holder_query,
       x.application_name  AS xmin_holder_application
  FROM outbox_health_row() h
  LEFT JOIN LATERAL (SELECT x.kind, x.pid, x.name, x.age, x.state, x.query, x.application_name,
                            count(*) OVER () AS holders
                       FROM outbox_xmin_holders() x
                      WHERE x.past_threshold
                      ORDER BY x.xmin_age DESC NULLS LAST
                      LIMIT 1) x ON true;

COMMENT ON VIEW outbox_health IS
    'One row, cheap (reads unfinished events, the intake row, the lock table and the server''s activity, never the bulk of published ones): backlog, oldest pending age, dead letters, expired leases, last claim and whether a worker claimed within the last minute, open producing transactions and what they hold back, and what holds back the xmin horizon past outbox_settings.xmin_warn_after.';
COMMENT ON COLUMN outbox_health.xmin_holders IS 'Holders of the xmin horizon past outbox_settings.xmin_warn_after (outbox_xmin_holders()): while they hold it, VACUUM removes no dead row version of the outbox and claims slow down.';
COMMENT ON COLUMN outbox_health.xmin_holder_kind IS 'The oldest of them: session, prepared transaction, replication slot; NULL when none.';
COMMENT ON COLUMN outbox_health.xmin_holder_pid IS 'Its backend pid (a session; a slot''s walsender); pg_terminate_backend(pid) ends a session.';
COMMENT ON COLUMN outbox_health.xmin_holder_name IS 'The prepared transaction''s gid or the replication slot''s name.';
COMMENT ON COLUMN outbox_health.xmin_holder_age IS 'How long it has held: since its transaction began (a session), since PREPARE (a prepared transaction); NULL for a slot.';
COMMENT ON COLUMN outbox_health.xmin_holder_state IS 'pg_stat_activity.state (e.g. idle in transaction); prepared; a slot: active or inactive.';
COMMENT ON COLUMN outbox_health.xmin_holder_query IS 'The start (200 characters) of the session''s current or last query.';
COMMENT ON COLUMN outbox_health.xmin_holder_application IS 'The session''s application_name.';

-- As 0012 and 0013: nobody by default; workers (the xmin_held log line, outbox_health) and
-- operators (outboxpg status, sql/health.sql) by their group roles, where they exist.
REVOKE EXECUTE ON FUNCTION outbox_xmin_holders() FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_worker') THEN
        GRANT EXECUTE ON FUNCTION outbox_xmin_holders() TO outbox_worker, outbox_operator;
    END IF;
END $$;
