-- outboxpg: partitions, and what maintenance will do next.
--
--   psql -X -v ON_ERROR_STOP=1 -d yourdb -f sql/partitions.sql    (or \i sql/partitions.sql)
--
-- Shows, read-only:
--   1. the settings that shape partitions (width, how many ahead, retention);
--   2. every partition of outbox: its created_at range, size on disk, estimated rows (planner
--      statistics: no table scan), and whether its range is already past retention;
--   3. SELECT * FROM outbox_maintain(true): a dry run of the next maintenance, one row per
--      action it would take: create (a partition ahead, or for rows that fell into
--      outbox_default), drop (past retention, only finished events), keep (past retention but
--      holding pending, leased or dead events: those need a worker or an operator), skip.
--      The dry run changes nothing; it counts the unfinished events of each expired partition.
-- Workers run outbox_maintain() themselves (every --maintenance-interval); to run it now:
-- SELECT * FROM outbox_maintain();   or   outboxpg maintain

\echo '== partition settings'
SELECT partition_width, partitions_ahead, retention, maintenance_lock_timeout FROM outbox_settings;

\echo '== partitions'
SELECT p.partition,
       p.is_default,
       p.range_start,
       p.range_end,
       p.total_size,
       CASE WHEN c.reltuples < 0 THEN NULL ELSE c.reltuples::bigint END AS estimated_rows,
       p.range_end <= now() - s.retention                              AS past_retention
  FROM outbox_partitions p
  JOIN pg_inherits i ON i.inhparent = 'outbox'::regclass
  JOIN pg_class c ON c.oid = i.inhrelid AND c.relname = p.partition
 CROSS JOIN outbox_settings s
 ORDER BY p.is_default DESC, p.range_start;

\echo '== what outbox_maintain() would do now (dry run)'
SELECT * FROM outbox_maintain(true);
