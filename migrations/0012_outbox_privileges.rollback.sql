-- Undo 0012: the grants of this database go, the functions run as their caller again and are
-- executable by PUBLIC again (PostgreSQL's default). The roles belong to the whole cluster: each
-- is dropped only when nothing else uses it, that is when no database still holds a grant to it
-- or an object of it (another outboxpg install, or a DBA's own grant) and no role is a member
-- of it (DROP ROLE would silently take that membership away from an application's login).
-- Otherwise it is kept, with a NOTICE saying why.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

DO $$
DECLARE
    r text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_worker', 'outbox_operator'] LOOP
        -- A role a DBA dropped by hand (after DROP OWNED) has nothing left to revoke here.
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r);
        EXECUTE format('REVOKE ALL ON outbox, outbox_settings, outbox_stats, outbox_dead_letters, outbox_partitions, outbox_health, '
                       'outbox_heads, outbox_intake FROM %I', r);
        EXECUTE format('REVOKE ALL ON SEQUENCE outbox_id_seq FROM %I', r);
        EXECUTE format('REVOKE ALL ON FUNCTION
            outbox_wake_workers(), outbox_worker_idle(), outbox_worker_busy(),
            outbox_retry_delay(integer, interval, interval),
            outbox_claim(integer, interval, text), outbox_complete(bigint[], uuid),
            outbox_fail(bigint, uuid, text, boolean), outbox_release(bigint[], uuid),
            outbox_requeue(bigint[]), outbox_discard(bigint[], text),
            outbox_maintain(boolean), outbox_next_wakeup(), outbox_health_row(), outbox_commit_horizon(),
            outbox_commit_guard(), outbox_take_in(bigint, bigint, integer), outbox_refresh_heads(text[], text[]),
            outbox_aggregate_key(text, text) FROM %I', r);
        IF to_regclass('_yoyo_migration') IS NOT NULL THEN
            EXECUTE format('REVOKE ALL ON _yoyo_migration FROM %I', r);
        END IF;
        -- Only where 0012 granted it (PUBLIC's USAGE on schema public is not touched).
        EXECUTE format('REVOKE USAGE ON SCHEMA %I FROM %I', current_schema(), r);
    END LOOP;
END $$;

GRANT EXECUTE ON FUNCTION
    outbox_wake_workers(), outbox_worker_idle(), outbox_worker_busy(),
    outbox_retry_delay(integer, interval, interval),
    outbox_claim(integer, interval, text), outbox_complete(bigint[], uuid),
    outbox_fail(bigint, uuid, text, boolean), outbox_release(bigint[], uuid),
    outbox_requeue(bigint[]), outbox_discard(bigint[], text),
    outbox_maintain(boolean), outbox_next_wakeup(), outbox_health_row(), outbox_commit_horizon(),
    outbox_commit_guard(), outbox_take_in(bigint, bigint, integer), outbox_refresh_heads(text[], text[]),
    outbox_aggregate_key(text, text)
TO PUBLIC;

ALTER FUNCTION outbox_claim(integer, interval, text) SECURITY INVOKER;
ALTER FUNCTION outbox_complete(bigint[], uuid) SECURITY INVOKER;
ALTER FUNCTION outbox_fail(bigint, uuid, text, boolean) SECURITY INVOKER;
ALTER FUNCTION outbox_release(bigint[], uuid) SECURITY INVOKER;
ALTER FUNCTION outbox_next_wakeup() SECURITY INVOKER;
ALTER FUNCTION outbox_maintain(boolean) SECURITY INVOKER;
ALTER FUNCTION outbox_requeue(bigint[]) SECURITY INVOKER;
ALTER FUNCTION outbox_discard(bigint[], text) SECURITY INVOKER;
ALTER FUNCTION outbox_health_row() SECURITY INVOKER;

DO $$
DECLARE
    r       text;
    oid_    oid;
    members text;
    uses    text;
BEGIN
    FOREACH r IN ARRAY ARRAY['outbox_producer', 'outbox_worker', 'outbox_operator'] LOOP
        SELECT oid INTO oid_ FROM pg_roles WHERE rolname = r;
        CONTINUE WHEN oid_ IS NULL;
        SELECT string_agg(m.member::regrole::text, ', ') INTO members
          FROM pg_auth_members m WHERE m.roleid = oid_;
        -- pg_shdepend is shared by all databases: grants and objects anywhere in the cluster.
        SELECT string_agg(DISTINCT coalesce(d.datname, 'the cluster'), ', ') INTO uses
          FROM pg_shdepend s LEFT JOIN pg_database d ON d.oid = s.dbid
         WHERE s.refclassid = 'pg_authid'::regclass AND s.refobjid = oid_;
        IF members IS NOT NULL OR uses IS NOT NULL THEN
            RAISE NOTICE 'outboxpg: keeping role %: %', r,
                concat_ws('; ', 'members: ' || members, 'still granted or owning objects in: ' || uses);
            CONTINUE;
        END IF;
        BEGIN
            EXECUTE format('DROP ROLE %I', r);
        EXCEPTION
            WHEN dependent_objects_still_exist OR insufficient_privilege THEN
                RAISE NOTICE 'outboxpg: keeping role %: %', r, SQLERRM;
        END;
    END LOOP;
END $$;
