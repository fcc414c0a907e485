-- outboxpg 0002: the outbox table, partitioned by time.
--
-- Applications INSERT here in the same transaction as their business rows. Nothing else
-- writes to it except the outbox_* functions and outbox_maintain().
-- depends: 0001_outbox_settings
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- pending -> processing (leased) -> published
--                  \-> pending again (retry, after a backoff) ... -> dead (after max attempts)
-- dead -> pending (outbox_requeue) or discarded (outbox_discard).
-- pending, processing and dead are "unfinished": they hold back later events of their aggregate
-- and keep their partition from being dropped. published and discarded are finished.
CREATE TYPE outbox_state AS ENUM ('pending', 'processing', 'published', 'dead', 'discarded');

-- Identity columns are not allowed on partitioned tables before PostgreSQL 17: a plain sequence.
CREATE SEQUENCE outbox_id_seq AS bigint;

CREATE TABLE outbox (
    id              bigint       NOT NULL DEFAULT nextval('outbox_id_seq'),
    -- The partition key. now() is the producing transaction's start time.
    created_at      timestamptz  NOT NULL DEFAULT now(),

    -- Byte order ("C"): these are identifiers, compared for equality and kept in the order
    -- index; locale-aware comparison costs every claim's head-of-line probe for nothing.
    aggregate_type  text COLLATE "C" NOT NULL,
    aggregate_id    text COLLATE "C" NOT NULL,
    event_type      text         NOT NULL,
    payload         jsonb        NOT NULL,
    headers         jsonb        NOT NULL DEFAULT '{}',
    -- NULL: published to <subject_prefix>.<aggregate_type>.<event_type>, resolved at claim time.
    subject         text,
    -- The broker's deduplication key (JetStream's Nats-Msg-Id): fixed at insert, so every
    -- retry of this event carries the same one.
    msg_id          text         NOT NULL DEFAULT gen_random_uuid()::text,

    state           outbox_state NOT NULL DEFAULT 'pending',
    -- How many times the event has been handed out by outbox_claim().
    attempts        integer      NOT NULL DEFAULT 0,
    next_attempt_at timestamptz  NOT NULL DEFAULT now(),
    -- The current (or, once finished, the last) lease.
    locked_by       text,
    claimed_at      timestamptz,
    locked_until    timestamptz,
    lease_token     uuid,

    last_error      text,
    published_at    timestamptz,
    dead_at         timestamptz,
    discarded_at    timestamptz,
    discard_reason  text,

    -- A unique constraint on a partitioned table must contain the partition key.
    PRIMARY KEY (id, created_at),

    -- What can never be published is refused here, with the constraint's name as the reason,
    -- rather than dead-lettered later: the producer's transaction is the one place that can
    -- still correct it. Subjects follow the NATS rules for publishing: dot-separated non-empty
    -- tokens, no whitespace or control characters, no wildcards (* or >).
    CONSTRAINT outbox_aggregate_type_not_blank CHECK (aggregate_type <> '' AND octet_length(aggregate_type) <= 255),
    CONSTRAINT outbox_aggregate_id_not_blank   CHECK (aggregate_id <> '' AND octet_length(aggregate_id) <= 1024),
    CONSTRAINT outbox_event_type_not_blank     CHECK (event_type <> '' AND octet_length(event_type) <= 255),
    CONSTRAINT outbox_msg_id_not_blank         CHECK (msg_id <> '' AND octet_length(msg_id) <= 255),
    -- An explicit subject is checked as given; without one, the default subject built from
    -- aggregate_type and event_type must be valid ('p' stands in for the settings' prefix,
    -- which outbox_settings checks on its own).
    CONSTRAINT outbox_subject_is_valid_nats_subject CHECK (
        octet_length(coalesce(subject, '')) <= 1024
        AND coalesce(subject, 'p.' || aggregate_type || '.' || event_type)
            ~ '^[^.*>[:space:][:cntrl:]]+(\.[^.*>[:space:][:cntrl:]]+)*$'),
    -- NATS headers are name: value lines: names without whitespace or ':', values are strings.
    -- strict: in lax mode the filter would unwrap an array value and let ["a"] or [] through.
    CONSTRAINT outbox_headers_are_string_map CHECK (
        jsonb_typeof(headers) = 'object'
        AND NOT jsonb_path_exists(headers, 'strict $.* ? (@.type() != "string")')
        AND NOT jsonb_path_exists(headers, '$.keyvalue() ? (@.key like_regex "[[:space:][:cntrl:]:]|^$")')),
    CONSTRAINT outbox_attempts_not_negative CHECK (attempts >= 0)
) PARTITION BY RANGE (created_at);

ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id;

COMMENT ON TABLE outbox IS
    'outboxpg events. INSERT (aggregate_type, aggregate_id, event_type, payload[, subject, headers, msg_id]) in your business transaction; everything else goes through the outbox_* functions.';

-- Catches rows whose time range has no partition yet (maintenance lagging, or an explicit
-- created_at far from now), so an insert never fails at a partition boundary.
-- outbox_maintain() moves such rows into a proper partition when it creates one.
CREATE TABLE outbox_default PARTITION OF outbox DEFAULT;

-- Claim candidates, in id order.
CREATE INDEX outbox_pending_idx ON outbox (id) WHERE state = 'pending';

-- Head-of-line check: "is there an earlier unfinished event of this aggregate?" is one probe
-- here. Finished events leave this index, so it stays as small as the backlog.
CREATE INDEX outbox_unfinished_by_aggregate_idx ON outbox (aggregate_type, aggregate_id, id)
    WHERE state IN ('pending', 'processing', 'dead');

-- Expired leases, reclaimed by every outbox_claim().
CREATE INDEX outbox_leased_idx ON outbox (locked_until) WHERE state = 'processing';
