"""Every SQL statement outboxpg sends, by name, except the worker's claim-and-report path
(outboxpg/relay/gateway.py): the operator command line, the schema checks, the worker's
start-up checks, the wakeup connection, the metrics sample, the producer's inserts, the demo.

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

# -- outboxpg migrate --adopt (outboxpg.adopt) --------------------------------------------------

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
       AND has_column_privilege(to_regclass('outbox_settings'), 'backoff_cap', 'SELECT'),
       current_user::text, current_database()::text
"""
WORKER_SETTINGS = "SELECT subject_prefix, backoff_cap FROM outbox_settings"
# --standby-flushed: pg_stat_replication.flush_lsn is NULL to roles without pg_read_all_stats.
MAY_READ_ALL_STATS = "SELECT pg_has_role('pg_read_all_stats', 'USAGE')"
# Which backend ran it (outboxpg.relay.pooler: is there a transaction pooler in between?).
BACKEND_PID = "SELECT pg_backend_pid()"

# -- the worker's wakeup connection and metrics (outboxpg.relay.wakeup, .metrics) ---------------

# The channel 0003's insert trigger and 0007's repair functions notify while a worker is idle.
CHANNEL = "outbox"
LISTEN = "LISTEN outbox"
WORKER_IDLE = "SELECT outbox_worker_idle()"
WORKER_BUSY = "SELECT outbox_worker_busy()"
# outbox_health: cheap, and readable by the outbox_worker role (the table is not).
HEALTH_GAUGES = "SELECT backlog, dead, coalesce(extract(epoch FROM oldest_pending_age), 0) FROM outbox_health"

# -- the producer (outboxpg.producer) -----------------------------------------------------------

INSERT_EVENT = ("INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, subject, headers, msg_id, "
                "deliver_at, idempotency_key, expires_at) "
                "VALUES (%s, %s, %s, %s::jsonb, %s, coalesce(%s::jsonb, '{}'), coalesce(%s, gen_random_uuid()::text), "
                "%s::timestamptz, %s, %s::timestamptz) RETURNING id")
# An insert with an idempotency_key that wrote no row: the event that holds the key (0022).
IDEMPOTENCY_EVENT = "SELECT outbox_idempotency_event(%s)"
COPY_EVENTS = sql.SQL("COPY outbox ({}) FROM STDIN")   # {}: the columns given

# -- outboxpg demo (outboxpg.demo): the sample application's own table --------------------------

DEMO_CREATE_ORDERS = "CREATE TABLE orders (id text PRIMARY KEY, status text NOT NULL, amount numeric NOT NULL)"
DEMO_UPSERT_ORDER = "INSERT INTO orders VALUES (%s, %s, %s) ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status"
STATS = "SELECT * FROM outbox_stats"

# -- outboxpg replay and outboxpg.replay() (0018) -----------------------------------------------

REPLAY = sql.SQL("SELECT outbox_replay({})")   # {}: the filters given, as named arguments
REPLAY_CANDIDATES = sql.SQL(
    "SELECT c.id, c.created_at, o.aggregate_type, o.aggregate_id, o.event_type "
    "FROM outbox_replay_candidates({}) c "
    "JOIN outbox o ON o.id = c.id AND o.created_at = c.created_at ORDER BY c.id")
NAMED_ARGUMENT = sql.SQL("{} => {}::{}")      # name => %(name)s::type
