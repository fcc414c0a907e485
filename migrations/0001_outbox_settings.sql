-- outboxpg 0001: the settings every outbox function reads.
--
-- One row, changed by a DBA with UPDATE; the functions read it on every call, so a change
-- takes effect at once, without a restart of any worker.
--
-- Every outboxpg migration pins search_path to the schema being installed into, with pg_temp
-- last, so that the functions created below (SET search_path FROM CURRENT) can never be
-- steered to a caller's look-alike table or function. Install into another schema by setting
-- search_path to it before running the files.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

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
    -- 1,000). A claim's batch_size caps a run too. Measured with one hot aggregate, worker batch
    -- 500 (BENCHMARKS.md): 6,673 events/s at 100, 8,476 at 1,000. 1 restores one event per
    -- aggregate at a time.
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

    -- The commit-order guard (0013): an event is handed out only once no open transaction can
    -- still commit an earlier event of its aggregate. Off: in id order among what is visible.
    commit_order_guard boolean  NOT NULL DEFAULT true,
    -- How many aggregates one producing transaction holds back by name (a lock each, in the
    -- shared lock table: max_locks_per_transaction * max_connections slots in all); beyond it, it
    -- holds back every newer event until it ends. Business transactions write a handful.
    commit_order_max_aggregates integer NOT NULL DEFAULT 16
                       CONSTRAINT commit_order_max_aggregates_not_negative CHECK (commit_order_max_aggregates >= 0),

    -- An event without its own subject is published to <subject_prefix>.<aggregate_type>.<event_type>.
    subject_prefix     text     NOT NULL DEFAULT 'outbox'
                       CONSTRAINT subject_prefix_is_valid_nats_subject CHECK (
                           -- as outbox's subjects (0002): no wildcards, nothing in $JS/$SYS/... or _INBOX
                           subject_prefix ~ '^(?!_INBOX(\.|$))[^.*>$[:space:][:cntrl:]][^.*>[:space:][:cntrl:]]*(\.[^.*>[:space:][:cntrl:]]+)*$')
);

COMMENT ON TABLE outbox_settings IS
    'outboxpg settings (one row). Change with UPDATE outbox_settings SET ...; read by every outbox function on each call.';

INSERT INTO outbox_settings DEFAULT VALUES;
