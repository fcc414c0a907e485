-- outboxpg inbox: rolls back its first step (0001_inbox_1.sql). The role outbox_consumer stays:
-- roles belong to the cluster, and other databases may use it.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;
DROP FUNCTION outbox_inbox_maintain(boolean);
DROP VIEW outbox_inbox_partitions;
DROP FUNCTION outbox_inbox_receive(text, text);
DROP TABLE outbox_inbox;
DROP TABLE outbox_inbox_settings;
