DROP FUNCTION outbox_claim(integer, interval, text);
DROP INDEX outbox_lease_token_idx;
