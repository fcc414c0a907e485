DROP FUNCTION outbox_extend(bigint[], uuid, interval);
