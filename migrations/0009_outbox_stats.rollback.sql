DROP VIEW outbox_stats;
