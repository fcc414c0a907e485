DROP FUNCTION outbox_claim(integer, interval, text);
DROP FUNCTION outbox_commit_horizon();
