-- Back to the last release, by hand: what the next release added goes, and the tables are put
-- back. The released definitions of the functions, views and triggers the release replaced
-- follow (tools/schema_step.py, docs/migrations.md). Emptied when a release is made.

DROP TRIGGER outbox_take_idempotency_key ON outbox;
DROP FUNCTION outbox_take_idempotency_key();
DROP FUNCTION outbox_untrusted_creators();
DROP VIEW outbox_health;
DROP FUNCTION outbox_xmin_holders();
DROP FUNCTION outbox_open_claims();
DROP FUNCTION outbox_warm_up(text);
DROP FUNCTION outbox_claim(integer, interval, text, bigint, text, boolean);
DROP FUNCTION outbox_intake_wait();
DROP FUNCTION outbox_intake_remember(tid);
DROP FUNCTION outbox_intake_holders();
DROP FUNCTION outbox_fail(bigint, uuid, text, boolean, interval);
DROP FUNCTION outbox_next_wakeup(text);
DROP FUNCTION outbox_complete(bigint[], uuid, timestamptz, timestamptz);
DROP FUNCTION outbox_shards_disable();
DROP FUNCTION outbox_shards_enable();
DROP FUNCTION outbox_shard_buckets(text);
DROP FUNCTION outbox_aggregate_bucket(text, text);
DROP INDEX IF EXISTS outbox_heads_bucket_idx;
DROP FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean, integer, boolean);
DROP FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz, boolean);
DROP FUNCTION outbox_replay_check(bigint[], text, text, text, timestamptz, timestamptz, boolean);
DROP VIEW outbox_stats;
DROP FUNCTION outbox_health_row();
DROP SEQUENCE outbox_intake_tid;

-- Back to one namespace of keys: where two producers hold one key, the earlier event keeps it.
DELETE FROM outbox_idempotency k
 USING outbox_idempotency other
 WHERE other.idempotency_key = k.idempotency_key AND other.event_id < k.event_id;
ALTER TABLE outbox_idempotency DROP CONSTRAINT outbox_idempotency_pkey, DROP COLUMN produced_by,
    ADD CONSTRAINT outbox_idempotency_pkey PRIMARY KEY (idempotency_key);

-- A dropped column keeps its grants (and its roles' dependencies on them): revoked first.
REVOKE SELECT (produced_by, size_bytes, replay_of) ON outbox FROM outbox_operator;
GRANT SELECT (lease_token) ON outbox TO outbox_operator;
ALTER TABLE outbox DROP COLUMN produced_by, DROP COLUMN size_bytes, DROP COLUMN replay_of;
REVOKE SELECT (allowed_subject_prefixes) ON outbox_settings FROM outbox_worker;
ALTER TABLE outbox_settings DROP COLUMN allowed_subject_prefixes, DROP COLUMN max_event_bytes,
    DROP COLUMN max_deliver_delay, DROP COLUMN max_claim_bytes;
GRANT EXECUTE ON FUNCTION outbox_forget_deleted() TO PUBLIC;
ALTER TABLE outbox_intake DROP COLUMN newest_id;
