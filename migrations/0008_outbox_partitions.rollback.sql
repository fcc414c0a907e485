DROP FUNCTION outbox_maintain(boolean);
DROP VIEW outbox_partitions;
