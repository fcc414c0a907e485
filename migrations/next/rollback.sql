-- Back to the last release, by hand: what the next release added goes, and the tables are put
-- back. The released definitions of the functions, views and triggers follow (tools/schema_step.py).

DROP VIEW outbox_failing;
-- Views that lose columns (CREATE OR REPLACE VIEW cannot drop one): made again below.
DROP VIEW outbox_health;
DROP VIEW outbox_dead_letters;
DROP FUNCTION outbox_xmin_holders();
DROP FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean);
DROP FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz);
DROP FUNCTION outbox_cancel(bigint[]);
DROP FUNCTION outbox_idempotency_take(text, bigint);
DROP FUNCTION outbox_idempotency_event(text);
DROP FUNCTION outbox_idempotency_forget(integer);
DROP FUNCTION outbox_heads_floor();
DROP FUNCTION outbox_heads_writing();
DROP TABLE outbox_idempotency;
DROP SEQUENCE outbox_heads_floor_us;
DROP SEQUENCE outbox_intake_mark;

-- Runs in flight keep their place: their heads are ready when the lease ends, as the release
-- has them. Parked heads have no event left (one that came since is taken in again by the
-- intake, which makes its head anew).
UPDATE outbox_heads SET ready_at = leased_until WHERE leased_until > ready_at;
DELETE FROM outbox_heads WHERE parked;
DROP INDEX outbox_heads_ready_idx;
CREATE INDEX outbox_heads_ready_idx ON outbox_heads (ready_at, head_id) WHERE ready_at IS NOT NULL;
ALTER TABLE outbox_heads SET (fillfactor = 50);
ALTER TABLE outbox_heads DROP COLUMN leased_until, DROP COLUMN opened_id, DROP COLUMN parked, DROP COLUMN moves;

-- A dropped column keeps its grants (and its roles' dependencies on them): revoked first.
REVOKE INSERT (deliver_at, idempotency_key, expires_at) ON outbox FROM outbox_producer;
REVOKE SELECT (deliver_at, idempotency_key, expires_at) ON outbox FROM outbox_operator;
ALTER TABLE outbox DROP COLUMN deliver_at, DROP COLUMN idempotency_key, DROP COLUMN expires_at;
ALTER TABLE outbox_settings DROP COLUMN xmin_warn_after;
