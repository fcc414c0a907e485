-- outboxpg inbox: least privilege. One group role, and nothing for anybody else.
--
--   GRANT outbox_consumer TO billing_app;    -- may record the messages it processes, and maintain
--
-- outbox_consumer is a NOLOGIN group (roles belong to the cluster: created here only when
-- missing, shared by every database the inbox is installed into). Its members may:
--   - EXECUTE outbox_inbox_receive, which runs as the caller: INSERT into outbox_inbox (the
--     columns consumer, msg_id and bucket) and SELECT on outbox_inbox_settings, which it reads;
--   - EXECUTE outbox_inbox_maintain, which runs as the owner (SECURITY DEFINER): it creates and
--     drops partitions, by retention only;
--   - SELECT outbox_inbox_partitions (names, ranges, sizes).
-- They cannot read, change or delete ids, drop or truncate partitions, or change the settings.
-- Functions are executable by PUBLIC by default: that is revoked from both.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- 1. The group role, where missing.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_consumer') THEN
        BEGIN
            CREATE ROLE outbox_consumer NOLOGIN;
            COMMENT ON ROLE outbox_consumer IS 'outboxpg group role (docs/how-to/inbox.md); grant it to login roles';
        EXCEPTION
            -- Another database's install created it at the same moment.
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'outboxpg: role outbox_consumer does not exist and % may not create it', current_user
                    USING HINT = 'Have a DBA run: CREATE ROLE outbox_consumer NOLOGIN; then run this step again.';
        END;
    END IF;
END $$;

-- 2. The function that runs as its owner pins its search_path to this schema with pg_temp last,
--    and nobody but the owner (and roles that could act as it anyway) may create objects in this
--    schema, where it looks names up: refuse to go on otherwise.
DO $$
DECLARE
    bad text;
BEGIN
    SELECT string_agg(p.oid::regprocedure::text, ', ') INTO bad
      FROM pg_proc p
     WHERE p.pronamespace = current_schema()::regnamespace
       AND p.proname LIKE 'outbox\_inbox\_%'
       AND p.prosecdef
       AND NOT coalesce(p.proconfig @> ARRAY[format('search_path=%I, pg_temp', current_schema())], false);
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'outboxpg: SECURITY DEFINER functions without search_path = %, pg_temp: %',
                        quote_ident(current_schema()), bad;
    END IF;
    SELECT string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                      ', ' ORDER BY a.grantee <> 0, pg_get_userbyid(a.grantee)) INTO bad
      FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
     WHERE n.oid = current_schema()::regnamespace
       AND a.privilege_type = 'CREATE'
       AND (a.grantee = 0
            OR NOT (pg_has_role(a.grantee, n.nspowner, 'USAGE') OR pg_has_role(a.grantee, current_user, 'USAGE')
                    OR (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = a.grantee)));
    IF bad IS NOT NULL THEN
        RAISE EXCEPTION 'outboxpg: % may CREATE in schema %, where outbox_inbox_maintain looks up names: refusing to install',
                        bad, quote_ident(current_schema())
            USING ERRCODE = 'OBX01',
                  HINT = format('REVOKE CREATE ON SCHEMA %I FROM %s; then install again.', current_schema(), bad);
    END IF;
END $$;

-- 3. Nobody may call anything by default.
REVOKE EXECUTE ON FUNCTION outbox_inbox_receive(text, text), outbox_inbox_maintain(boolean) FROM PUBLIC;

-- 4. The schema itself: PUBLIC usually has USAGE (public schema); grant it where it has not.
DO $$
BEGIN
    IF NOT has_schema_privilege('outbox_consumer', current_schema(), 'USAGE') THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO outbox_consumer', current_schema());
    END IF;
END $$;

-- 5. Consumers: record ids (through the function, which runs as them), maintain, look at sizes.
GRANT EXECUTE ON FUNCTION outbox_inbox_receive(text, text), outbox_inbox_maintain(boolean) TO outbox_consumer;
GRANT INSERT (consumer, msg_id, bucket) ON outbox_inbox TO outbox_consumer;
GRANT SELECT ON outbox_inbox_settings TO outbox_consumer;
GRANT SELECT ON outbox_inbox_partitions TO outbox_consumer;
