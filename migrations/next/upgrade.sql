-- Table changes of the next release, by hand: what CREATE OR REPLACE cannot do (tables, columns,
-- indexes, sequences, types, data, and DROPs of objects that go or change their signature).
-- Applied first; the functions, views, triggers, comments and grants of schema/ that changed
-- follow (tools/schema_step.py, docs/migrations.md). Emptied when a release is made.

-- The idempotency keys get a trigger of their own, in place of the function the insert trigger
-- called and producers could call themselves; outbox_claim and outbox_replay gain an argument,
-- and outbox_xmin_holders names a holder's role instead of its query. Made again below.
DROP FUNCTION outbox_idempotency_take(text, bigint);
DROP VIEW outbox_health;
DROP FUNCTION outbox_xmin_holders();
DROP FUNCTION outbox_claim(integer, interval, text);
DROP FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean);
-- outbox_fail takes the wait a destination asked for (retry_after).
DROP FUNCTION outbox_fail(bigint, uuid, text, boolean);
-- outbox_next_wakeup takes a shard.
DROP FUNCTION outbox_next_wakeup();
-- outbox_complete takes the events' created_at range (created_min, created_max).
DROP FUNCTION outbox_complete(bigint[], uuid);

-- outbox_stats and outbox_health count scheduled events apart from those waiting for a retry (a
-- column more, in the middle); outbox_replay_candidates takes include_replays. Made again below.
DROP VIEW outbox_stats;
DROP FUNCTION outbox_health_row();
DROP FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz);

ALTER TABLE outbox_settings
    ADD COLUMN allowed_subject_prefixes text[] NOT NULL DEFAULT '{}'
                       CONSTRAINT allowed_subject_prefixes_are_valid_nats_subjects CHECK (
                           -- each one as subject_prefix (subjects hold no space: joined by one,
                           -- the elements stay apart)
                           array_position(allowed_subject_prefixes, NULL) IS NULL
                           AND array_to_string(allowed_subject_prefixes, ' ') ~ ('^((?!_INBOX(\.| |$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*'
                                                                                 '( (?!_INBOX(\.| |$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*)*)?$')),
    ADD COLUMN max_event_bytes integer NOT NULL DEFAULT 1000000
                       CONSTRAINT max_event_bytes_at_least_64_kib CHECK (max_event_bytes >= 65536),
    ADD COLUMN max_deliver_delay interval NOT NULL DEFAULT '1 year'
                       CONSTRAINT max_deliver_delay_positive CHECK (max_deliver_delay > interval '0'),
    ADD COLUMN max_claim_bytes bigint NOT NULL DEFAULT 67108864
                       CONSTRAINT max_claim_bytes_positive CHECK (max_claim_bytes > 0);

-- The events and keys written before are the upgrading role's (their producers are not known):
-- producers cannot cancel them, an operator can discard them. No table rewrite: a default
-- that is not volatile is stored once for the rows there.
ALTER TABLE outbox ADD COLUMN produced_by text NOT NULL DEFAULT current_user;
ALTER TABLE outbox ALTER COLUMN produced_by SET DEFAULT session_user;
ALTER TABLE outbox ADD COLUMN size_bytes integer;
ALTER TABLE outbox_idempotency ADD COLUMN produced_by text NOT NULL DEFAULT current_user;
ALTER TABLE outbox_idempotency ALTER COLUMN produced_by DROP DEFAULT;
ALTER TABLE outbox_idempotency DROP CONSTRAINT outbox_idempotency_pkey,
    ADD CONSTRAINT outbox_idempotency_pkey PRIMARY KEY (produced_by, idempotency_key);

-- Operators no longer read lease tokens: whoever holds one can report on a worker's events.
REVOKE SELECT (lease_token) ON outbox FROM outbox_operator;

-- The intake gives the aggregates of the newest events heads ahead of a backlog; this marks how
-- far it has read them (outbox_take_in).
ALTER TABLE outbox_intake ADD COLUMN newest_id bigint NOT NULL DEFAULT 0;

-- A replay's copy names the event it copies, so that a replay copies originals only. Nullable
-- without a default: a change of the catalog alone, no table rewrite.
ALTER TABLE outbox ADD COLUMN replay_of bigint;

-- The intake reads its row where the last intake left it (outbox_take_in), not by a scan.
CREATE SEQUENCE outbox_intake_tid AS bigint MINVALUE 0 START 0;
