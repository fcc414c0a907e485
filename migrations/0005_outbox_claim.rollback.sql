DROP FUNCTION outbox_claim(integer, interval, text);
DROP FUNCTION outbox_refresh_heads(text[], text[]);
DROP FUNCTION outbox_take_in(bigint, bigint, integer);
DROP FUNCTION outbox_commit_horizon();
DROP FUNCTION outbox_commit_guard();
DROP TABLE outbox_intake;
DROP TABLE outbox_heads;
DROP FUNCTION outbox_aggregate_key(text, text);
