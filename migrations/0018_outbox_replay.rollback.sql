DROP FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean);
DROP FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz);
