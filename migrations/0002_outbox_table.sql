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

-- The rules for the event's columns are domains rather than table CHECK constraints: a domain
-- is checked when a value is written to the column, where a CHECK constraint is evaluated again
-- on every UPDATE of the row, and every claim and every report updates it (the subject and
-- headers rules cost about 10% of a claim and its report). What can never be
-- published is refused at insert, with the constraint's name as the reason, rather than
-- dead-lettered later: the producer's transaction is the one place that can still correct it.
--
-- Identifiers, compared in byte order ("C"): compared for equality and kept in the order
-- index; locale-aware comparison costs every claim's head-of-line probe for nothing.
-- NATS subjects: dot-separated non-empty tokens, no whitespace or control characters, no
-- wildcards (* or >). An explicit subject must also stay out of the server's own namespaces: a
-- first token starting with $ ($JS.API..., $SYS..., $KV...) would make the worker send
-- JetStream or system requests (a purge, a delete) instead of an event, and one of _INBOX would
-- answer other clients' requests. aggregate_type and event_type name the default subject
-- (<subject_prefix>.<aggregate_type>.<event_type>, resolved at claim time), so they are subject
-- tokens too, even on an event with a subject of its own: one rule per column, checked once.
CREATE DOMAIN outbox_subject AS text
    CONSTRAINT outbox_subject_is_valid_nats_subject CHECK (
        octet_length(VALUE) <= 1024
        AND VALUE ~ '^(?!_INBOX(\.|$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*$');
CREATE DOMAIN outbox_aggregate_type AS text COLLATE "C"
    CONSTRAINT outbox_aggregate_type_not_blank CHECK (VALUE <> '' AND octet_length(VALUE) <= 255)
    CONSTRAINT outbox_subject_is_valid_nats_subject CHECK (
        VALUE ~ '^[^.*>[:space:][:cntrl:]]+(\.[^.*>[:space:][:cntrl:]]+)*$');
CREATE DOMAIN outbox_aggregate_id AS text COLLATE "C"
    CONSTRAINT outbox_aggregate_id_not_blank CHECK (VALUE <> '' AND octet_length(VALUE) <= 1024);
CREATE DOMAIN outbox_event_type AS text
    CONSTRAINT outbox_event_type_not_blank CHECK (VALUE <> '' AND octet_length(VALUE) <= 255)
    CONSTRAINT outbox_subject_is_valid_nats_subject CHECK (
        VALUE ~ '^[^.*>[:space:][:cntrl:]]+(\.[^.*>[:space:][:cntrl:]]+)*$');
CREATE DOMAIN outbox_msg_id AS text
    CONSTRAINT outbox_msg_id_not_blank CHECK (VALUE <> '' AND octet_length(VALUE) <= 255);
-- NATS headers are name: value lines: names without whitespace or ':', values are strings.
-- strict: in lax mode the filter would unwrap an array value and let ["a"] or [] through.
-- Names starting with Nats- are instructions to the server, not data (Nats-Rollup purges a
-- subject, Nats-Expected-* cannot hold across a retry, Nats-Msg-Id is the outbox's own): refused.
CREATE DOMAIN outbox_headers AS jsonb
    CONSTRAINT outbox_headers_are_string_map CHECK (
        jsonb_typeof(VALUE) = 'object'
        AND NOT jsonb_path_exists(VALUE, 'strict $.* ? (@.type() != "string")')
        AND NOT jsonb_path_exists(VALUE, '$.keyvalue() ? (@.key like_regex "[[:space:][:cntrl:]:]|^$|^nats-" flag "i")'));

-- Identity columns are not allowed on partitioned tables before PostgreSQL 17: a plain sequence.
CREATE SEQUENCE outbox_id_seq AS bigint;

CREATE TABLE outbox (
    id              bigint       NOT NULL DEFAULT nextval('outbox_id_seq'),
    -- The partition key. now() is the producing transaction's start time.
    created_at      timestamptz  NOT NULL DEFAULT now(),

    aggregate_type  outbox_aggregate_type NOT NULL,
    aggregate_id    outbox_aggregate_id   NOT NULL,
    event_type      outbox_event_type     NOT NULL,
    payload         jsonb        NOT NULL,
    headers         outbox_headers NOT NULL DEFAULT '{}',
    -- NULL: published to <subject_prefix>.<aggregate_type>.<event_type>, resolved at claim time.
    subject         outbox_subject,
    -- The broker's deduplication key (JetStream's Nats-Msg-Id): fixed at insert, so every
    -- retry of this event carries the same one.
    msg_id          outbox_msg_id NOT NULL DEFAULT gen_random_uuid()::text,

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

    -- Derived from state, for the partial indexes below, which use these instead of state:
    -- PostgreSQL can update a row in place (a HOT update: no new index entries) only when no
    -- indexed or index-predicate column changes. pending -> processing (a claim) and back
    -- (a retry, a release) keep both values, so leasing and retrying touch no index; only
    -- finishing an event or dead-lettering it does.
    -- in_flow: waiting, due, held back behind its aggregate, or leased (live or expired).
    in_flow         boolean      NOT NULL GENERATED ALWAYS AS (state IN ('pending', 'processing')) STORED,
    -- unfinished: holds back later events of its aggregate and keeps its partition.
    unfinished      boolean      NOT NULL GENERATED ALWAYS AS (state IN ('pending', 'processing', 'dead')) STORED,

    -- A unique constraint on a partitioned table must contain the partition key.
    PRIMARY KEY (id, created_at),

    CONSTRAINT outbox_attempts_not_negative CHECK (attempts >= 0)
) PARTITION BY RANGE (created_at);

ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id;

COMMENT ON TABLE outbox IS
    'outboxpg events. INSERT (aggregate_type, aggregate_id, event_type, payload[, subject, headers, msg_id]) in your business transaction; everything else goes through the outbox_* functions.';

-- Catches rows whose time range has no partition yet (maintenance lagging, or an explicit
-- created_at far from now), so an insert never fails at a partition boundary.
-- outbox_maintain() moves such rows into a proper partition when it creates one.
-- Its storage parameters are the template for every partition outbox_maintain() creates
-- (ALTER TABLE outbox_default SET (...) changes those made from then on). fillfactor: inserts
-- fill a third of each page, so that the claim's and the report's new row versions fit on the
-- same page: the claim's is then a HOT update, and neither spills to another page. Measured
-- (bench/sql_core.py, batch 100): 23.5 us of server CPU per event at 33, 26.5 at 50, 34 at 100.
-- The price is disk: a partition takes up to three times the space of a packed one.
CREATE TABLE outbox_default PARTITION OF outbox DEFAULT WITH (fillfactor = 33);

-- New events in id order, as claims take them in behind their cursor (0005). Also how
-- complete, fail and release find a batch by id: the index is as small as the backlog.
CREATE INDEX outbox_in_flow_idx ON outbox (id) WHERE in_flow;

-- An aggregate's line: its unfinished events in id order, where a claim reads a run and a
-- report finds the next head (0005). Finished events leave this index, so it stays as small as
-- the backlog.
CREATE INDEX outbox_unfinished_by_aggregate_idx ON outbox (aggregate_type, aggregate_id, id)
    WHERE unfinished;

-- No index on the lease columns or on state: they change with every claim, and an index on
-- them would turn each claim into a non-HOT update with new entries in every index.
