DROP FUNCTION outbox_discard(bigint[], text);
DROP FUNCTION outbox_requeue(bigint[]);
DROP VIEW outbox_dead_letters;
