"""What a database holds of the outbox, as rows to compare two installs by (a fresh one, one
installed with psql, one upgraded from a release)."""

from __future__ import annotations

from typing import Any

import psycopg

# What a database holds of the outbox, for comparing installs (yoyo's own tables and the
# time-named partitions left out; the partitions are compared by count).
OWN = ("c.relnamespace = current_schema()::regnamespace AND NOT c.relispartition "
        "AND c.relname NOT LIKE '%%yoyo%%'")
CATALOG = {
    "relations": f"""SELECT c.relname, c.relkind::text, obj_description(c.oid, 'pg_class')
                      FROM pg_class c WHERE {OWN} ORDER BY 1""",
    "columns": f"""SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                          pg_get_expr(d.adbin, d.adrelid)
                     FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                     LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                    WHERE {OWN} AND a.attnum > 0 AND NOT a.attisdropped ORDER BY 1, 2""",
    "constraints": f"""SELECT c.relname, k.conname, pg_get_constraintdef(k.oid)
                         FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid WHERE {OWN} ORDER BY 1, 2""",
    "indexes": f"""SELECT c.relname, pg_get_indexdef(c.oid) FROM pg_class c WHERE {OWN} AND c.relkind IN ('i', 'I')
                   ORDER BY 1""",
    "functions": """SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid),
                           obj_description(p.oid, 'pg_proc')
                      FROM pg_proc p WHERE p.pronamespace = current_schema()::regnamespace ORDER BY 1, 2""",
    "triggers": f"""SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
                      FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
                     WHERE {OWN} AND NOT t.tgisinternal ORDER BY 1, 2""",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = current_schema() ORDER BY 1",
    "types": """SELECT t.typname, array_agg(e.enumlabel::text ORDER BY e.enumsortorder)
                  FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid
                 WHERE t.typnamespace = current_schema()::regnamespace GROUP BY 1 ORDER BY 1""",
    "sequences": """SELECT sequencename, data_type::text, start_value, increment_by
                      FROM pg_sequences WHERE schemaname = current_schema() ORDER BY 1""",
    "settings": "SELECT to_jsonb(s) FROM outbox_settings s",
    "partitions": "SELECT count(*) FILTER (WHERE is_default), count(*) FILTER (WHERE NOT is_default) FROM outbox_partitions",
}


def catalog(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(dsn) as c:
        return {k: c.execute(q).fetchall() for k, q in CATALOG.items()}
