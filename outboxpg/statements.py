"""Every SQL statement outboxpg sends, by name, except the worker's claim-and-report path
(outboxpg/relay/gateway.py): the operator command line, the schema checks, the worker's
start-up checks, the wakeup connection, the metrics sample, the producer's inserts, the demo,
the throwaway clusters.

The command line reads the views (outbox_health, outbox_stats, outbox_dead_letters,
outbox_failing, outbox_partitions) and calls the functions; it reads the table itself only for
what no view holds: one event's every column (``outboxpg dead show``), the state of ids that are
not dead, and the row locks a repair takes. tests/product/test_statements.py fails on a SQL literal
anywhere else in the package.

Statements with ``{}`` are psycopg ``sql.SQL`` templates: identifiers and fixed fragments are
composed into them, values always travel as parameters.
"""

from __future__ import annotations

from psycopg import sql

from outboxpg import sql_api

# -- outboxpg status ----------------------------------------------------------------------------

HEALTH = "SELECT now() AS checked_at, * FROM outbox_health"
# Who holds what back (0013), the oldest first; any of them may have ended meanwhile.
OPEN_PRODUCERS = ("SELECT pid, xact_age, state, held_above, aggregates, all_newer FROM outbox_open_producers() "
                  "ORDER BY xact_age DESC NULLS LAST, held_above")
# Claims left open in their transaction (0017): no claim takes new events in until they end.
OPEN_CLAIMS = "SELECT pid, xact_age, state, application_name FROM outbox_open_claims()"
# Events failing now, by reason (0016), the most frequent first.
FAILING = ("SELECT reason, events, min_attempts, max_attempts, retrying_now, next_retry_at, event_types, ids, "
           "subjects FROM outbox_failing ORDER BY events DESC, max_attempts DESC, reason LIMIT 20")
MAX_ATTEMPTS = "SELECT max_attempts FROM outbox_settings"
# Events per state (outbox_stats reads the whole table).
STATE_COUNTS = "SELECT pending, processing, published, dead, discarded FROM outbox_stats"
# The subjects of the unfinished events, the most used first (0015): --nats-url, and the worker's stream check.
UNFINISHED_SUBJECTS = "SELECT subject, explicit, events FROM outbox_unfinished_subjects(%s)"

# -- outboxpg maintain --------------------------------------------------------------------------

MAINTAIN = "SELECT * FROM outbox_maintain(%s)"

# -- outboxpg dead ------------------------------------------------------------------------------

# --since: a timestamp, else an interval ago (PostgreSQL reads both).
SINCE = ("SELECT %s::timestamptz", "SELECT now() - %s::interval")
# The same as text, for a time Python's datetime cannot hold (-infinity, before year 1): passed on
# as text, PostgreSQL reads it again.
SINCE_TEXT = ("SELECT %s::timestamptz::text", "SELECT (now() - %s::interval)::text")
DEAD_LIST_COLUMNS = ("id, dead_at, attempts, aggregate_type, aggregate_id, event_type, subject, last_error, "
                     "created_at, msg_id")
# The filters of outboxpg dead (list, and requeue/discard --all-matching), joined by AND.
FILTER_EQUALS = sql.SQL("{} = %s")          # {}: the column, event_type, aggregate_type or aggregate_id
FILTER_DEAD_SINCE = sql.SQL("dead_at >= %s")
LIMIT = sql.SQL("{} LIMIT %s")


def where(conditions: list[sql.Composable]) -> sql.Composed:
    """'WHERE a AND b', or 'WHERE true' without conditions."""
    return sql.SQL("WHERE {}").format(sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("true"))


# {} is a WHERE clause of fixed fragments (outboxpg.cli.dead._where), its values parameters.
DEAD_COUNT = sql.SQL("SELECT count(*) AS n FROM outbox_dead_letters {}")
DEAD_LIST = sql.SQL("SELECT " + DEAD_LIST_COLUMNS + " FROM outbox_dead_letters {} ORDER BY dead_at DESC, id DESC")
DEAD_MATCHING = sql.SQL("SELECT id, aggregate_type, event_type FROM outbox_dead_letters {} ORDER BY id")
DEAD_BY_ID = "SELECT id, aggregate_type, event_type FROM outbox_dead_letters WHERE id = ANY (%s) ORDER BY id"
# How many later events of its aggregate a dead event holds back (0016).
HELD_BACK = "SELECT held_back FROM outbox_dead_letters WHERE id = %s"
# The state of requested ids that are not dead (no view lists events in every state).
STATE_BY_ID = "SELECT id, state::text AS state FROM outbox WHERE id = ANY (%s)"
# Every column of outbox this role may read, in table order: an outbox_operator login may not
# read payload and headers.
READABLE_COLUMNS = ("SELECT attname::text AS attname FROM pg_attribute WHERE attrelid = 'outbox'::regclass "
                    "AND attnum > 0 AND NOT attisdropped AND has_column_privilege('outbox'::regclass, attnum, "
                    "'SELECT') ORDER BY attnum")
# One event, the columns composed in ({} above); the payload as the JSON text stored.
EVENT = sql.SQL("SELECT {} FROM outbox o WHERE o.id = %s ORDER BY o.created_at LIMIT 1")
EVENT_PAYLOAD_TEXT = sql.SQL("o.payload::text AS payload")
# The partition an event's created_at falls in, from the ranges (reading tableoid needs a right
# on the whole table).
PARTITION_OF = ("SELECT coalesce((SELECT partition FROM outbox_partitions WHERE NOT is_default "
                "AND range_start <= %(t)s AND %(t)s < range_end), "
                "(SELECT partition FROM outbox_partitions WHERE is_default)) AS p")
# Locking rows needs an UPDATE right, which an outbox_operator login has not.
MAY_LOCK = "SELECT has_any_column_privilege('outbox'::regclass, 'UPDATE')"
# The ones still dead, locked ({}: FOR UPDATE, or nothing without the right).
STILL_DEAD = sql.SQL("SELECT id FROM outbox WHERE id = ANY (%s) AND state = 'dead' ORDER BY id {}")
FOR_UPDATE = sql.SQL("FOR UPDATE")
REQUEUE = "SELECT outbox_requeue(%s::bigint[])"
DISCARD = "SELECT outbox_discard(%s::bigint[], %s)"

# -- the schema checks (outboxpg.schema, outboxpg.cli.common) -----------------------------------

# Is the schema there (its first object), and may this role read yoyo's bookkeeping?
INSTALLED = ("SELECT to_regclass('outbox_settings') IS NOT NULL, "
             "       coalesce(has_table_privilege(to_regclass('_yoyo_migration'), 'SELECT'), false)")
APPLIED_STEPS = "SELECT migration_id FROM _yoyo_migration"
# For databases installed by hand with psql (no yoyo bookkeeping): the objects the commands use,
# the newest first (the first one missing says how far behind the install is). (what, lookup)
REQUIRED_OBJECTS: tuple[tuple[str, str], ...] = (
    ("view outbox_failing", "to_regclass('outbox_failing')"),
    ("view outbox_health", "to_regclass('outbox_health')"),
    *((f"function {f.signature}", f"to_regprocedure('{f.signature}')") for f in sql_api.OPERATOR_CALLS),
    ("view outbox_dead_letters", "to_regclass('outbox_dead_letters')"),
)
# All of them in one statement, one round trip.
REQUIRED = "SELECT " + ", ".join(f"{lookup} IS NOT NULL" for _, lookup in REQUIRED_OBJECTS)

# Who besides superusers and the roles of the schema's owner and of the installing role may create
# objects in the install schema (the first of the search_path): outboxpg migrate refuses before it
# applies anything, as the install itself does (outbox_untrusted_creators, schema/80_observability.sql).
UNTRUSTED_CREATORS = """
SELECT n.nspname,
       string_agg(CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                  ', ' ORDER BY a.grantee <> 0, pg_get_userbyid(a.grantee))
  FROM pg_namespace n, aclexplode(coalesce(n.nspacl, acldefault('n', n.nspowner))) a
 WHERE n.oid = current_schema()::regnamespace
   AND a.privilege_type = 'CREATE'
   AND (a.grantee = 0
        OR NOT (pg_has_role(a.grantee, n.nspowner, 'USAGE') OR pg_has_role(a.grantee, current_user, 'USAGE')
                OR (SELECT r.rolsuper FROM pg_roles r WHERE r.oid = a.grantee)))
 GROUP BY n.nspname
"""

# The same question at a worker's start and in outboxpg status, asked of the install itself
# (outbox_untrusted_creators(), executable by workers and operators): who, or NULL, and the
# schema's name as an identifier (quoted where needed), for the REVOKE to suggest.
INSTALL_UNTRUSTED_CREATORS = ("SELECT outbox_untrusted_creators() AS who, "
                              "(SELECT p.pronamespace::regnamespace::text FROM pg_proc p "
                              "  WHERE p.oid = 'outbox_untrusted_creators()'::regprocedure) AS schema")



# -- what a schema holds (outboxpg.catalog: outboxpg migrate --adopt, tools/schema_step.py, tests) --

CURRENT_SCHEMA = "SELECT current_schema()"
QUOTE_IDENT = "SELECT quote_ident(%s)"
CREATE_SCHEMA = sql.SQL("CREATE SCHEMA {}")
SET_LOCAL_SEARCH_PATH = sql.SQL("SET LOCAL search_path = {}, pg_temp")
# One row per object, as text that does not depend on the schema's name (search_path is the
# schema while it runs, so names in it print unqualified). Partitions and their indexes and
# cloned triggers are left out.
FINGERPRINT = """
WITH s AS (SELECT %(schema)s::regnamespace AS oid),
rel AS (SELECT c.* FROM pg_class c, s WHERE c.relnamespace = s.oid AND NOT c.relispartition
          AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'i', 'I', 'c', 'f'))
SELECT 'relation ' || relname, relkind::text FROM rel
UNION ALL
SELECT 'column ' || rel.relname || '.' || a.attname,
       concat_ws(' ', format_type(a.atttypid, a.atttypmod), CASE WHEN a.attnotnull THEN 'NOT NULL' END,
                 CASE WHEN a.attgenerated <> '' THEN 'GENERATED ' || a.attgenerated::text END,
                 'DEFAULT ' || pg_get_expr(d.adbin, d.adrelid))
  FROM rel JOIN pg_attribute a ON a.attrelid = rel.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
 WHERE rel.relkind IN ('r', 'p', 'v', 'm', 'c', 'f')
UNION ALL
SELECT 'constraint ' || rel.relname || '.' || co.conname, pg_get_constraintdef(co.oid)
  FROM rel JOIN pg_constraint co ON co.conrelid = rel.oid
UNION ALL
SELECT 'index ' || i.relname, pg_get_indexdef(i.oid) FROM rel i WHERE i.relkind IN ('i', 'I')
UNION ALL
SELECT 'view ' || relname, pg_get_viewdef(oid) FROM rel WHERE relkind IN ('v', 'm')
UNION ALL
SELECT 'trigger ' || rel.relname || '.' || t.tgname, pg_get_triggerdef(t.oid)
  FROM rel JOIN pg_trigger t ON t.tgrelid = rel.oid AND NOT t.tgisinternal
UNION ALL
SELECT 'function ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ')',
       concat_ws(' | ', p.prokind::text, pg_get_function_result(p.oid), l.lanname, p.provolatile::text,
                 CASE WHEN p.prosecdef THEN 'SECURITY DEFINER' END, CASE WHEN p.proisstrict THEN 'STRICT' END,
                 p.prorows::text, array_to_string(p.proconfig, ', '), md5(p.prosrc))
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang, s WHERE p.pronamespace = s.oid
UNION ALL
SELECT 'type ' || t.typname,
       concat_ws(' ', t.typtype::text, CASE WHEN t.typtype = 'd' THEN format_type(t.typbasetype, t.typtypmod) END,
                 CASE WHEN t.typnotnull THEN 'NOT NULL' END, 'DEFAULT ' || pg_get_expr(t.typdefaultbin, 0),
                 (SELECT string_agg(co.conname || ' ' || pg_get_constraintdef(co.oid), ', ' ORDER BY co.conname)
                    FROM pg_constraint co WHERE co.contypid = t.oid),
                 (SELECT string_agg(e.enumlabel, ', ' ORDER BY e.enumsortorder)
                    FROM pg_enum e WHERE e.enumtypid = t.oid))
  FROM pg_type t, s
 WHERE t.typnamespace = s.oid AND t.typtype IN ('d', 'e')
"""

# The objects a release step restates whole (functions, views, triggers) and every comment, one
# row each as (kind, name, definition), in the schema given: what tools/schema_step.py compares
# between the released steps and schema/ to decide what the next step holds.
CODE_OBJECTS = """
WITH s AS (SELECT %(schema)s::regnamespace AS oid)
SELECT 'function', p.proname::text,
       concat_ws(' | ', pg_get_function_identity_arguments(p.oid), pg_get_function_result(p.oid), p.prokind::text,
                 l.lanname, p.provolatile::text, p.proparallel::text, p.prosecdef::text, p.proisstrict::text,
                 p.proleakproof::text, p.procost::text, p.prorows::text, array_to_string(p.proconfig, ', '),
                 p.prosrc)
  FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang, s WHERE p.pronamespace = s.oid
UNION ALL
SELECT 'view', c.relname::text, pg_get_viewdef(c.oid)
  FROM pg_class c, s WHERE c.relnamespace = s.oid AND c.relkind IN ('v', 'm')
UNION ALL
SELECT 'trigger', t.tgname::text, pg_get_triggerdef(t.oid)
  FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid, s
 WHERE c.relnamespace = s.oid AND NOT c.relispartition AND NOT t.tgisinternal
UNION ALL
SELECT 'comment', 'function ' || p.proname, obj_description(p.oid, 'pg_proc')
  FROM pg_proc p, s WHERE p.pronamespace = s.oid AND obj_description(p.oid, 'pg_proc') IS NOT NULL
UNION ALL
SELECT 'comment', 'relation ' || c.relname, obj_description(c.oid, 'pg_class')
  FROM pg_class c, s
 WHERE c.relnamespace = s.oid AND NOT c.relispartition AND obj_description(c.oid, 'pg_class') IS NOT NULL
UNION ALL
SELECT 'comment', 'column ' || c.relname || '.' || a.attname, col_description(c.oid, a.attnum)
  FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid, s
 WHERE c.relnamespace = s.oid AND NOT c.relispartition AND a.attnum > 0 AND NOT a.attisdropped
   AND col_description(c.oid, a.attnum) IS NOT NULL
UNION ALL
SELECT 'comment', 'type ' || t.typname, obj_description(t.oid, 'pg_type')
  FROM pg_type t, s WHERE t.typnamespace = s.oid AND obj_description(t.oid, 'pg_type') IS NOT NULL
"""

# Everything two installs of the outbox are compared by (a fresh one, one installed with psql, one
# upgraded from a release, one rolled back), in the schema first on the search_path: tables,
# columns with defaults, collations and comments, constraints, indexes, storage options,
# triggers, views, types and domains with their rules, functions (definition, SECURITY DEFINER,
# SET clauses, volatility, cost, comment), sequences, the settings row, and every grant. yoyo's
# own tables and the time-named partitions are left out (the partitions are counted).
_OWN = ("c.relnamespace = current_schema()::regnamespace AND NOT c.relispartition "
        "AND c.relname NOT LIKE '%%yoyo%%'")
CATALOG: dict[str, str] = {
    "relations": f"""SELECT c.relname, c.relkind::text, obj_description(c.oid, 'pg_class')
                      FROM pg_class c WHERE {_OWN} ORDER BY 1""",
    "columns": f"""SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                          pg_get_expr(d.adbin, d.adrelid)
                     FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                     LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                    WHERE {_OWN} AND a.attnum > 0 AND NOT a.attisdropped ORDER BY 1, 2""",
    "constraints": f"""SELECT c.relname, k.conname, pg_get_constraintdef(k.oid)
                         FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid WHERE {_OWN} ORDER BY 1, 2""",
    "indexes": f"""SELECT c.relname, pg_get_indexdef(c.oid) FROM pg_class c WHERE {_OWN} AND c.relkind IN ('i', 'I')
                   ORDER BY 1""",
    "functions": """SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid),
                           obj_description(p.oid, 'pg_proc')
                      FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace ORDER BY 1, 2""",
    "triggers": f"""SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
                      FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
                     WHERE {_OWN} AND NOT t.tgisinternal ORDER BY 1, 2""",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = current_schema() ORDER BY 1",
    "types": """SELECT t.typname, array_agg(e.enumlabel::text ORDER BY e.enumsortorder)
                  FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid
                 WHERE t.typnamespace = current_schema()::regnamespace GROUP BY 1 ORDER BY 1""",
    "sequences": """SELECT sequencename, data_type::text, start_value, increment_by
                      FROM pg_sequences WHERE schemaname = current_schema() ORDER BY 1""",
    "settings": "SELECT to_jsonb(s) FROM outbox_settings s",
    "partitions": """SELECT count(*) FILTER (WHERE is_default), count(*) FILTER (WHERE NOT is_default)
                       FROM outbox_partitions""",
    "relation_options": f"""SELECT c.relname, c.reloptions, c.relpersistence::text, pg_get_partkeydef(c.oid),
                                   c.relrowsecurity, c.relreplident::text
                              FROM pg_class c WHERE {_OWN} ORDER BY 1""",
    "column_details": f"""SELECT c.relname, a.attname, col_description(c.oid, a.attnum),
                                 a.attcollation::regcollation::text, a.attgenerated::text, a.attidentity::text
                            FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                           WHERE {_OWN} AND a.attnum > 0 AND NOT a.attisdropped ORDER BY 1, 2""",
    "domains": """SELECT t.typname, t.typtype::text, format_type(t.typbasetype, t.typtypmod), t.typnotnull,
                         t.typdefault, t.typcollation::regcollation::text, obj_description(t.oid, 'pg_type'),
                         (SELECT array_agg(k.conname || ' ' || pg_get_constraintdef(k.oid) ORDER BY k.conname)
                            FROM pg_constraint k WHERE k.contypid = t.oid)
                    FROM pg_type t
                   WHERE t.typnamespace = current_schema()::regnamespace AND t.typtype IN ('d', 'e') ORDER BY 1""",
    "function_attributes": """SELECT p.oid::regprocedure::text, p.prokind::text, p.prosecdef, p.proconfig,
                                     p.provolatile::text, p.proparallel::text, p.proisstrict, p.proleakproof,
                                     p.procost, p.prorows, pg_get_userbyid(p.proowner) = current_user
                                FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace ORDER BY 1""",
    # The owner's own rights are left out (its name differs between installs), and so is the
    # schema's name.
    "grants": f"""
        WITH acl(object, owner, acl) AS (
            SELECT 'relation ' || c.relname, c.relowner,
                   coalesce(c.relacl, acldefault(CASE c.relkind WHEN 'S' THEN 's' ELSE 'r' END::"char", c.relowner))
              FROM pg_class c WHERE {_OWN}
            UNION ALL
            SELECT 'column ' || c.relname || '.' || a.attname, c.relowner, a.attacl
              FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
             WHERE {_OWN} AND a.attnum > 0 AND NOT a.attisdropped AND a.attacl IS NOT NULL
            UNION ALL
            SELECT 'function ' || p.oid::regprocedure::text, p.proowner, coalesce(p.proacl, acldefault('f', p.proowner))
              FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace
            UNION ALL
            SELECT 'type ' || t.typname, t.typowner, coalesce(t.typacl, acldefault('T', t.typowner))
              FROM pg_type t WHERE t.typnamespace = current_schema()::regnamespace AND t.typtype IN ('d', 'e')
            UNION ALL
            SELECT 'schema', n.nspowner, coalesce(n.nspacl, acldefault('n', n.nspowner))
              FROM pg_namespace n WHERE n.oid = current_schema()::regnamespace)
        SELECT object, CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE pg_get_userbyid(g.grantee) END,
               g.privilege_type, g.is_grantable
          FROM acl, aclexplode(acl.acl) g
         WHERE g.grantee <> acl.owner
         ORDER BY 1, 2, 3""",
}

# -- outboxpg-worker start-up checks (outboxpg.cli.outboxpg_worker) -----------------------------

# For each signature (sql_api.WORKER_CALLS, IDLE_CALLS): does it exist, may this login execute it?
CHECK_FUNCTIONS = """
SELECT f, to_regprocedure(f) IS NOT NULL,
       coalesce(has_function_privilege(to_regprocedure(f), 'EXECUTE'), false)
  FROM unnest(%s::text[]) AS f
"""
CHECK_SETTINGS = """
SELECT to_regclass('outbox_settings') IS NOT NULL
       AND has_column_privilege(to_regclass('outbox_settings'), 'subject_prefix', 'SELECT')
       AND has_column_privilege(to_regclass('outbox_settings'), 'backoff_cap', 'SELECT')
       AND has_column_privilege(to_regclass('outbox_settings'), 'allowed_subject_prefixes', 'SELECT'),
       current_user::text, current_database()::text
"""
# The stream check: where the events go, how long a duplicate window they need, which prefixes
# --ensure-stream may add.
WORKER_SETTINGS = "SELECT subject_prefix, backoff_cap, allowed_subject_prefixes FROM outbox_settings"
# --standby-flushed: pg_stat_replication.flush_lsn is NULL to roles without pg_read_all_stats.
MAY_READ_ALL_STATS = "SELECT pg_has_role('pg_read_all_stats', 'USAGE')"
# --shard: the index shard claims read is there (outbox_shards_enable(), schema/40_claim.sql).
SHARDS_ENABLED = "SELECT to_regclass('outbox_heads_bucket_idx') IS NOT NULL"
# Which backend ran it (outboxpg.relay.pooler: is there a transaction pooler in between?).
BACKEND_PID = "SELECT pg_backend_pid()"

# -- the worker's wakeup connection and metrics (outboxpg.relay.wakeup, .metrics) ---------------

# The channel 0003's insert trigger and 0007's repair functions notify while a worker is idle.
CHANNEL = "outbox"
LISTEN = "LISTEN outbox"
WORKER_IDLE = "SELECT outbox_worker_idle()"
# The wakeup lock's connection queues a second at a time: a statement waiting for a lock holds
# its snapshot, and with it the xmin horizon (VACUUM of every table of the database).
WAKEUP_LOCK_WAIT = "SET lock_timeout = '1s'"
WORKER_BUSY = "SELECT outbox_worker_busy()"
# outbox_health: cheap, and readable by the outbox_worker role (the table is not).
HEALTH_GAUGES = ("SELECT backlog, dead, coalesce(extract(epoch FROM oldest_pending_age), 0), scheduled, waiting_retry "
                 "FROM outbox_health")

# -- the producer (outboxpg.producer) -----------------------------------------------------------

INSERT_EVENT = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, subject, headers, msg_id, "
                "deliver_at, idempotency_key, expires_at) "
                "VALUES (%s, %s, %s, %s::jsonb, %s, coalesce(%s::jsonb, '{}'), coalesce(%s, gen_random_uuid()::text), "
                "%s::timestamptz, %s, %s::timestamptz) RETURNING id")
# An insert with an idempotency_key that wrote no row: the event that holds the key (0022).
IDEMPOTENCY_EVENT = "SELECT outbox_idempotency_event(%s)"
COPY_EVENTS = sql.SQL("COPY outbox ({}) FROM STDIN")   # {}: the columns given
# savepoint=True: an outbox error rolls back to here, and the caller's transaction goes on.
SAVEPOINT = "SAVEPOINT outboxpg_enqueue"
RELEASE_SAVEPOINT = "RELEASE SAVEPOINT outboxpg_enqueue"
ROLLBACK_TO_SAVEPOINT = "ROLLBACK TO SAVEPOINT outboxpg_enqueue"
# outboxpg.drivers.sqlalchemy: a statement that makes SQLAlchemy's asyncpg adapter begin its transaction.
NOTHING = "SELECT 1"

# -- the transactional inbox (outboxpg.inbox): one statement, in the consumer's transaction ------

INBOX_RECEIVE = "SELECT outbox_inbox_receive(%s, %s)"


# -- outboxpg demo (outboxpg.demo): the sample application's own table --------------------------

# The demo writes once its worker has claimed (after its claims' connection warmed up).
DEMO_WORKER_CLAIMED = "SELECT last_claim_at IS NOT NULL FROM outbox_intake"
DEMO_CREATE_ORDERS = "CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL, amount numeric NOT NULL)"
DEMO_UPSERT_ORDER = "INSERT INTO orders VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status"
STATS = "SELECT * FROM outbox_stats"

# -- shard groups (outboxpg.relay.shard_group): a session advisory lock per member -----------------

# The group's key: the first of the two advisory lock keys (the slot is the second).
SHARD_GROUP_KEY = "SELECT hashtext('outboxpg shard group ' || %s)"
SHARD_GROUP_TAKE = "SELECT pg_try_advisory_lock(%s, %s)"
# The slots held in this database, in order. objsubid 2: the two-integer form of the key.
SHARD_GROUP_MEMBERS = """
SELECT coalesce(array_agg(l.objid::bigint ORDER BY l.objid::bigint), '{}')
  FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
   AND l.classid::bigint = (%s::bigint & 4294967295)
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""

# -- throwaway clusters (outboxpg.embedded): PUBLIC may not create in schema public, as from 15 on --

SECURE_PUBLIC_SCHEMA = "REVOKE CREATE ON SCHEMA public FROM PUBLIC"

# -- outboxpg replay and outboxpg.replay() (0018) -----------------------------------------------

REPLAY = sql.SQL("SELECT outbox_replay({})")   # {}: the filters given, as named arguments
# How many match, and the first of them (at most %(first)s: the cap, past which the replay is refused).
REPLAY_COUNT = sql.SQL("SELECT count(*) FROM outbox_replay_candidates({})")
REPLAY_CANDIDATES = sql.SQL(
    "SELECT c.id, c.created_at, o.aggregate_type, o.aggregate_id, o.event_type, o.msg_id, o.replay_of "
    "FROM (SELECT * FROM outbox_replay_candidates({}) ORDER BY id LIMIT %(first)s) c "
    "JOIN outbox o ON o.id = c.id AND o.created_at = c.created_at ORDER BY c.id")
NAMED_ARGUMENT = sql.SQL("{} => {}::{}")      # name => %(name)s::type
# The given ids' states, and of a copy made by an earlier replay the event it copies.
REPLAY_STATE_BY_ID = "SELECT id, state::text, replay_of FROM outbox WHERE id = ANY (%s)"
