DROP FUNCTION outbox_claim(integer, interval, text);
DROP FUNCTION outbox_commit_horizon();
DROP INDEX outbox_lease_token_idx;
