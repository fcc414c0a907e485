DROP FUNCTION outbox_release(bigint[], uuid);
DROP FUNCTION outbox_fail(bigint, uuid, text, boolean);
DROP FUNCTION outbox_complete(bigint[], uuid);
