-- outboxpg schema: the tables, their types and their indexes.
--
-- This is the state of the outbox; every other file of schema/ defines the code that reads and
-- writes it. Applications INSERT into outbox in the same transaction as their business rows.
-- Nothing else writes to these tables except the outbox_* functions and outbox_maintain().
--
-- Every file of schema/ first pins search_path to the schema being installed into, with
-- pg_temp last, so that the functions it creates (SET search_path FROM CURRENT) can never be
-- steered to a caller's look-alike table or function. Install into another schema by setting
-- search_path to it before running the files.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- == Settings ====================================================================================

-- One row, changed by a DBA with UPDATE; the functions read it on every call, so a change takes
-- effect at once, without a restart of any worker.
CREATE TABLE outbox_settings (
    -- A boolean primary key that must be true: the table can hold exactly one row.
    singleton          boolean  PRIMARY KEY DEFAULT true CHECK (singleton),

    -- Retries: attempt n (1-based) that fails waits least(backoff_cap, backoff_base * 2^(n-1)),
    -- with "equal jitter" (a random 50-100% of it) so that a burst of failures does not retry
    -- in lockstep. After max_attempts handed-out attempts the event is dead.
    max_attempts       integer  NOT NULL DEFAULT 10
                       CONSTRAINT max_attempts_at_least_one CHECK (max_attempts >= 1),
    backoff_base       interval NOT NULL DEFAULT '1 second'
                       CONSTRAINT backoff_base_positive CHECK (backoff_base > interval '0'),
    backoff_cap        interval NOT NULL DEFAULT '5 minutes'
                       CONSTRAINT backoff_cap_not_below_base CHECK (backoff_cap >= backoff_base),

    -- Lease given by outbox_claim() when the caller passes none. A worker must finish (or
    -- extend) a batch within it; after it, the event counts as a failed attempt and is retried.
    default_lease      interval NOT NULL DEFAULT '30 seconds'
                       CONSTRAINT default_lease_positive CHECK (default_lease > interval '0'),

    -- outbox_claim() hands out at most this many events per call; larger requests are
    -- clamped (a claim may always return fewer rows than asked).
    max_claim_batch    integer  NOT NULL DEFAULT 10000
                       CONSTRAINT max_claim_batch_positive CHECK (max_claim_batch >= 1),

    -- outbox_claim() hands out up to max_run consecutive events of one aggregate under one
    -- lease (a run), so that a busy aggregate moves more than one event per claim -> publish ->
    -- report round trip. Still at most one run per aggregate is in flight, and a worker
    -- publishes a run's events one after another (or as JetStream atomic batches of up to
    -- 1,000). A claim's batch_size caps a run too. 1 hands out one event per aggregate at a time.
    max_run            integer  NOT NULL DEFAULT 1000
                       CONSTRAINT max_run_positive CHECK (max_run >= 1),

    -- Partitions: outbox_maintain() keeps partitions_ahead partitions of partition_width ready
    -- beyond the current one, and drops partitions whose whole range is older than retention
    -- and that hold only finished (published or discarded) events.
    partition_width    interval NOT NULL DEFAULT '1 day'
                       -- date_bin() cannot bin by months or years: widths are fixed lengths.
                       CONSTRAINT partition_width_fixed_length CHECK (
                           partition_width > interval '0'
                           AND extract(month FROM partition_width) = 0
                           AND extract(year FROM partition_width) = 0),
    partitions_ahead   integer  NOT NULL DEFAULT 3
                       CONSTRAINT partitions_ahead_not_negative CHECK (partitions_ahead >= 0),
    retention          interval NOT NULL DEFAULT '7 days'
                       CONSTRAINT retention_not_negative CHECK (retention >= interval '0'),
    -- How long outbox_maintain() waits for a table lock before it skips a partition and
    -- leaves it for the next run: a queued ACCESS EXCLUSIVE lock stalls every claim behind it.
    maintenance_lock_timeout interval NOT NULL DEFAULT '1 second',

    -- The commit-order guard (20_producing.sql, 40_claim.sql): an event is handed out only once
    -- no open transaction can still commit an earlier event of its aggregate. Off: in id order
    -- among what is visible.
    commit_order_guard boolean  NOT NULL DEFAULT true,
    -- How many aggregates one producing transaction holds back by name (a lock each, in the
    -- shared lock table: max_locks_per_transaction * max_connections slots in all); beyond it, it
    -- holds back every newer event until it ends. Business transactions write a handful.
    commit_order_max_aggregates integer NOT NULL DEFAULT 16
                       CONSTRAINT commit_order_max_aggregates_not_negative CHECK (commit_order_max_aggregates >= 0),

    -- An event without its own subject is published to <subject_prefix>.<aggregate_type>.<event_type>.
    subject_prefix     text     NOT NULL DEFAULT 'outbox'
                       CONSTRAINT subject_prefix_is_valid_nats_subject CHECK (
                           -- as outbox's subjects (below): no wildcards, nothing in $JS/$SYS/... or _INBOX
                           subject_prefix ~ '^(?!_INBOX(\.|$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*$'),

    -- A session or prepared transaction that holds the xmin horizon back for longer than this
    -- is named (outbox_xmin_holders, 80_observability.sql): while it holds, VACUUM removes no
    -- dead row version, and every claim and report steps over more of them.
    xmin_warn_after    interval NOT NULL DEFAULT '1 minute'
                       CONSTRAINT xmin_warn_after_positive CHECK (xmin_warn_after > interval '0'),

    -- What producers may write, checked at INSERT (outbox_assign_id), where the producer's
    -- transaction can still correct it; the worker never sees it.
    -- An explicit subject must be under subject_prefix or one of these prefixes (a prefix names
    -- whole tokens: 'payments' admits 'payments.capture', not 'paymentsX.capture'). Producers
    -- share the worker's connection to the broker: a subject is an instruction to publish
    -- somewhere, and the streams the operator set up capture these prefixes only.
    allowed_subject_prefixes text[] NOT NULL DEFAULT '{}'
                       CONSTRAINT allowed_subject_prefixes_are_valid_nats_subjects CHECK (
                           -- each one as subject_prefix (subjects hold no space: joined by one,
                           -- the elements stay apart)
                           array_position(allowed_subject_prefixes, NULL) IS NULL
                           AND array_to_string(allowed_subject_prefixes, ' ') ~ ('^((?!_INBOX(\.| |$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*'
                                                                                 '( (?!_INBOX(\.| |$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*)*)?$')),
    -- The largest event (payload and headers, as stored in jsonb) an INSERT may write: the
    -- broker's limit (NATS max_payload, 1 MiB by default, headers included, less the headers
    -- the worker adds). Events below 64 KiB are never checked (the setting cannot go lower).
    max_event_bytes    integer  NOT NULL DEFAULT 1000000
                       CONSTRAINT max_event_bytes_at_least_64_kib CHECK (max_event_bytes >= 65536),
    -- How far ahead deliver_at may be: an event a year off is rarely meant, and one never due
    -- holds its aggregate back for good.
    max_deliver_delay  interval NOT NULL DEFAULT '1 year'
                       CONSTRAINT max_deliver_delay_positive CHECK (max_deliver_delay > interval '0'),
    -- The bytes of events one outbox_claim hands out when its caller names no budget: what a
    -- worker holds in memory for a batch (an event larger than this still goes, alone).
    max_claim_bytes    bigint   NOT NULL DEFAULT 67108864
                       CONSTRAINT max_claim_bytes_positive CHECK (max_claim_bytes > 0)
);

COMMENT ON TABLE outbox_settings IS
    'outboxpg settings (one row). Change with UPDATE outbox_settings SET ...; read by every outbox function on each call.';
COMMENT ON COLUMN outbox_settings.xmin_warn_after IS
    'A session or prepared transaction holding back the xmin horizon longer than this is named by outbox_health, outboxpg status and the worker''s log.';
COMMENT ON COLUMN outbox_settings.allowed_subject_prefixes IS
    'Prefixes (whole tokens) an explicit subject may have besides subject_prefix; any other subject is refused at INSERT.';
COMMENT ON COLUMN outbox_settings.max_event_bytes IS
    'The largest payload plus headers (jsonb bytes) an INSERT may write; at least 65536.';
COMMENT ON COLUMN outbox_settings.max_deliver_delay IS
    'How far ahead of now an INSERT may set deliver_at.';
COMMENT ON COLUMN outbox_settings.max_claim_bytes IS
    'The bytes of events (size_bytes) one outbox_claim hands out when the caller gives no max_bytes; one event always goes.';

INSERT INTO outbox_settings DEFAULT VALUES;

-- == Events ======================================================================================

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
    -- Assigned by the insert trigger (outbox_assign_id), after the aggregate's commit-order
    -- lock: no default, which would take the id before the trigger runs.
    id              bigint       NOT NULL,
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
    -- When the next attempt is due: deliver_at for the first one, then after each failure's
    -- backoff. A scheduled event is a pending event whose first attempt is not due yet.
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

    -- Not handed out before this time (NULL: at once): the insert trigger copies it into
    -- next_attempt_at, the column every claim already waits on for retries. Order beats time:
    -- later events of the aggregate wait behind a scheduled one.
    deliver_at      timestamptz,
    -- While an unfinished event holds this key, another event with it is not inserted (the
    -- insert writes no row); outbox_idempotency holds the keys, as a unique key cannot span
    -- the partitions.
    idempotency_key text,
    -- Not handed out by then: discarded with reason 'expired' instead of being published late.
    -- An event already handed out when its time runs out is on the wire and is left alone.
    expires_at      timestamptz,
    -- The login that wrote the event (session_user, which SET ROLE does not change), for
    -- outbox_cancel and the idempotency keys: a producer acts on its own events only. Producers
    -- may not write this column; a replay copies the original's.
    produced_by     text         NOT NULL DEFAULT session_user,
    -- payload and headers in bytes, as the insert trigger measured them (the jsonb datums before
    -- compression): what max_event_bytes and a claim's byte budget count.
    size_bytes      integer,
    -- A copy made by outbox_replay: the id of the event it copies (NULL: an event a producer
    -- wrote). Replays copy only events where it is NULL unless asked (include_replays), so that
    -- replaying an aggregate twice sends its events twice, not its events and the first copies.
    -- Producers may not write it. No foreign key: a partitioned table's key includes
    -- created_at, and the original's partition may be dropped before the copy's.
    replay_of       bigint,

    -- A unique constraint on a partitioned table must contain the partition key.
    PRIMARY KEY (id, created_at),

    CONSTRAINT outbox_attempts_not_negative CHECK (attempts >= 0)
) PARTITION BY RANGE (created_at);

ALTER SEQUENCE outbox_id_seq OWNED BY outbox.id;

COMMENT ON TABLE outbox IS
    'outboxpg events. INSERT (aggregate_type, aggregate_id, event_type, payload[, subject, headers, msg_id]) in your business transaction; everything else goes through the outbox_* functions.';
COMMENT ON COLUMN outbox.deliver_at IS
    'Not handed out before this time (NULL: at once). Copied into next_attempt_at at insert.';
COMMENT ON COLUMN outbox.replay_of IS
    'The event this one is a copy of (outbox_replay); NULL: written by a producer.';
COMMENT ON COLUMN outbox.idempotency_key IS
    'Optional: while an event with this key is unfinished, another one with it is not inserted.';
COMMENT ON COLUMN outbox.expires_at IS
    'Discarded with reason ''expired'' if not handed out by then (NULL: never).';
COMMENT ON COLUMN outbox.produced_by IS
    'The login that wrote the event (session_user); set by the insert, never by the producer.';
COMMENT ON COLUMN outbox.size_bytes IS
    'payload and headers in bytes (jsonb), measured at insert.';

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

-- New events in id order, as claims take them in behind their cursor (outbox_take_in). Also how
-- complete, fail and release find a batch by id: the index is as small as the backlog.
CREATE INDEX outbox_in_flow_idx ON outbox (id) WHERE in_flow;

-- An aggregate's line: its unfinished events in id order, where a claim reads a run and a
-- report finds the next head. Finished events leave this index, so it stays as small as the
-- backlog.
CREATE INDEX outbox_unfinished_by_aggregate_idx ON outbox (aggregate_type, aggregate_id, id)
    WHERE unfinished;

-- No index on the lease columns or on state: they change with every claim, and an index on
-- them would turn each claim into a non-HOT update with new entries in every index.

-- == The queue of aggregates =====================================================================

-- One row per aggregate (aggregate_type, aggregate_id) with unfinished events: the head of its
-- line. A claim takes due heads and hands out a run from each, so its work is bounded by what
-- it hands out, whatever the depth of the backlog (40_claim.sql).
-- Written only by the outbox_* functions.
CREATE TABLE outbox_heads (
    aggregate_type outbox_aggregate_type NOT NULL,
    aggregate_id   outbox_aggregate_id   NOT NULL,
    lock_key       integer      NOT NULL,
    -- No unfinished event of the aggregate has a lower id: where a claim starts reading its
    -- line (so it never steps over the published events before it). Usually the head event.
    -- In no index: every report raises it, and each such update stays HOT.
    head_id        bigint       NOT NULL,
    -- When the head can be claimed: its first event's next_attempt_at, or the time a report
    -- put it back in the queue. NULL: its first event is dead; requeue or discard it.
    ready_at       timestamptz,
    -- The end of the lease of the run in flight: the head is not claimable before it. NULL:
    -- none. In no index, so that leasing a head is a HOT update.
    leased_until   timestamptz,
    -- The id of the event the head was made for, never changed: orders the heads that one
    -- intake makes (all due at its time) oldest first.
    opened_id      bigint       NOT NULL,
    -- The aggregate has no unfinished event left, and its head is kept (until leased_until)
    -- for the intake to bring back, rather than dropped and made anew: a busy aggregate between
    -- two events. Under a held snapshot every head made anew adds an index entry of its key
    -- that no one can remove.
    parked         boolean      NOT NULL DEFAULT false,
    -- How many times a report moved the head on to a next event: 3 or more and it is parked
    -- rather than dropped when its line runs empty.
    moves          integer      NOT NULL DEFAULT 0,
    PRIMARY KEY (aggregate_type, aggregate_id)
-- Three quarters of each page free, for the row versions of the claim's and the report's HOT
-- updates. Under a held snapshot no version can be pruned: a head's update stays HOT only while
-- its page has room; otherwise the new version goes to another page and adds an entry to
-- outbox_heads_pkey, whose uniqueness check reads every earlier entry of the key. With
-- fillfactor 50 a report parking 9 heads read 1,780 buffers (10 busy aggregates at 2,000
-- events/s, 70 s into a held snapshot). The price: the table takes about twice the pages.
) WITH (fillfactor = 25);

COMMENT ON TABLE outbox_heads IS
    'outboxpg: the head of each aggregate''s line of unfinished events (ready_at: when it can be claimed; NULL: held by a dead letter). Kept by the outbox_* functions.';
COMMENT ON COLUMN outbox_heads.leased_until IS
    'When the run in flight stops holding the head (its lease''s end); NULL: none. Not indexed, so that leasing a head is a HOT update.';
COMMENT ON COLUMN outbox_heads.opened_id IS
    'The id of the event the head was made for; never changed. Orders heads due at the same time.';
COMMENT ON COLUMN outbox_heads.parked IS
    'The aggregate has no unfinished event; its head is kept for leased_until, for the intake to bring back.';
COMMENT ON COLUMN outbox_heads.moves IS
    'How many times a report moved the head on to a next event; 3 or more and it is parked rather than dropped.';

-- Due heads in claim order: the longest waiting first, the oldest head first among equals.
CREATE INDEX outbox_heads_ready_idx ON outbox_heads (ready_at, opened_id) WHERE ready_at IS NOT NULL;

CREATE TABLE outbox_intake (
    singleton     boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- Every committed event with an id up to this has its aggregate in outbox_heads (or is finished).
    intake_id     bigint       NOT NULL DEFAULT 0,
    -- When a worker last called outbox_claim (to the second), whatever the claim found.
    last_claim_at timestamptz,
    -- While a backlog lies above intake_id: the events up to this have had their aggregates
    -- given heads ahead of the cursor (outbox_take_in), so that they are not read twice.
    newest_id     bigint       NOT NULL DEFAULT 0
);

COMMENT ON TABLE outbox_intake IS
    'outboxpg: how far claims have taken new events into outbox_heads, and when a worker last claimed.';

INSERT INTO outbox_intake DEFAULT VALUES;

-- Values that every claim or report reads, kept in sequences rather than table rows: a
-- sequence has one version, where a row updated by every claim piles up versions that a held
-- snapshot keeps alive and every reader then walks.
--
-- No head in outbox_heads is due before this time (microseconds since the epoch): the lower
-- end of the claim's index range over the due heads (outbox_heads_floor, 40_claim.sql).
CREATE SEQUENCE outbox_heads_floor_us AS bigint MINVALUE 0 START 0;
COMMENT ON SEQUENCE outbox_heads_floor_us IS
    'outboxpg: no head in outbox_heads is due before this time (microseconds since the epoch); raised by the claims.';
-- A committed value of outbox_intake.intake_id, never above the current one: what readers that
-- do not move the cursor (a report) read instead of the row (outbox_take_in, 40_claim.sql).
CREATE SEQUENCE outbox_intake_mark AS bigint MINVALUE 0 START 0;
COMMENT ON SEQUENCE outbox_intake_mark IS
    'outboxpg: a committed value of outbox_intake.intake_id, never above the current one; read by reports instead of the row.';
-- Where the intake row's current version lies (its ctid, block * 65536 + line), as the last
-- intake wrote or found it: outbox_take_in reads the row there rather than by a scan, which looks
-- at every version a held snapshot keeps (a claim's intake writes one). Set outside the
-- transaction: a claim that rolls back leaves it naming a version nobody sees, and the next
-- claim scans once (40_claim.sql).
CREATE SEQUENCE outbox_intake_tid AS bigint MINVALUE 0 START 0;
COMMENT ON SEQUENCE outbox_intake_tid IS
    'outboxpg: where the intake row''s current version lies (block * 65536 + line), as the last intake found it; read by outbox_take_in instead of a scan.';

-- == Idempotency keys ============================================================================

-- Which event holds each idempotency key (outbox.idempotency_key) of each producer. A unique
-- key cannot span the partitions of outbox (a unique index of a partitioned table must hold the
-- partition key), so the keys live here. Keys are a producer's own: the same key from two
-- logins names two events. Written by the insert trigger (outbox_take_idempotency_key) only;
-- keys of finished events are forgotten by outbox_idempotency_forget (70_partitions.sql).
CREATE TABLE outbox_idempotency (
    idempotency_key text        NOT NULL,
    event_id        bigint      NOT NULL,
    -- When the key was taken, or outbox_idempotency_forget() last found its event unfinished.
    looked_at       timestamptz NOT NULL DEFAULT now(),
    -- The event's outbox.produced_by: whose key it is.
    produced_by     text        NOT NULL,
    CONSTRAINT outbox_idempotency_pkey PRIMARY KEY (produced_by, idempotency_key)
);
CREATE INDEX outbox_idempotency_looked_at_idx ON outbox_idempotency (looked_at);
COMMENT ON TABLE outbox_idempotency IS
    'outboxpg: which event holds each producer''s idempotency key. Written by the insert trigger only.';
