-- outboxpg 0011: is it healthy? One cheap row, for people and for monitors.
--
--   SELECT * FROM outbox_health;
--
-- backlog                     events pending or leased (pending includes retries waiting for their
--                             backoff and events held back behind an earlier one of their aggregate)
-- oldest_pending_age          how long the oldest of them has been waiting (NULL: none)
-- dead                        dead letters waiting for an operator (each holds back its aggregate)
-- expired_leases              leases past locked_until: their worker died or hung; the next claim
--                             retries them
-- last_claim_at               when a worker last claimed events (see below for how it is found)
-- worker_claimed_last_minute  whether that was within the last minute; with a backlog, false means
--                             that no worker is delivering
--
-- Unlike outbox_stats, which reads every row, this reads only the unfinished events (pending,
-- processing, dead: the rows of the partial index outbox_unfinished_by_aggregate_idx) and the 1000
-- newest events by id. Its cost follows the backlog, not the size of the table: published events,
-- the bulk of it, are never scanned.
--
-- last_claim_at, without an index on claimed_at. Claim, fail and complete each write a new row
-- version; an index on claimed_at would add one more index insertion to every one of them (a
-- partial index could not leave out the published events, where the last claim usually is), all
-- for a monitoring query. The newest claim is looked for where it can be instead:
--   * on an event still leased, waiting for a retry, or dead: the unfinished events, read anyway;
--   * on an event published since: claims hand out the oldest due events first, so once the
--     backlog is drained the events published last are the newest ones, found by walking the
--     primary key backwards from the highest id (1000 rows, a few index pages per partition).
-- A claim whose events were all published since and lie below the 1000 newest ids (an old retry
-- published after everything newer, or the instant between two claims while a worker drains a
-- large backlog with nothing else leased) is missed: last_claim_at is then an earlier claim. It is
-- never later than the true last claim.
--
-- The row is computed by outbox_health_row(), a plpgsql function pinned to index scans like
-- outbox_next_wakeup(): statistics taken during a burst say "most rows are unfinished", and a
-- plain view was then planned as a parallel scan of whole partitions, long after the burst had
-- been delivered. No index is added: the partial indexes of 0002 cover every row it reads.
-- depends: 0010_outbox_next_wakeup 0009_outbox_stats
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE FUNCTION outbox_health_row()
RETURNS TABLE (
    backlog                    bigint,
    pending                    bigint,
    processing                 bigint,
    waiting_retry              bigint,
    dead                       bigint,
    expired_leases             bigint,
    oldest_pending_age         interval,
    last_claim_at              timestamptz,
    worker_claimed_last_minute boolean
)
LANGUAGE plpgsql
STABLE
ROWS 1
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
AS $$
#variable_conflict use_column
DECLARE
    n_pending    bigint;
    n_processing bigint;
    n_waiting    bigint;
    n_dead       bigint;
    n_expired    bigint;
    oldest       timestamptz;
    last_claim   timestamptz;
    recent_claim timestamptz;
BEGIN
    -- One pass over the unfinished events (the partial index outbox_unfinished_by_aggregate_idx).
    SELECT count(*) FILTER (WHERE o.state = 'pending'),
           count(*) FILTER (WHERE o.state = 'processing'),
           count(*) FILTER (WHERE o.state = 'pending' AND o.next_attempt_at > now()),
           count(*) FILTER (WHERE o.state = 'dead'),
           count(*) FILTER (WHERE o.state = 'processing' AND o.locked_until < now()),
           min(o.created_at) FILTER (WHERE o.state IN ('pending', 'processing')),
           max(o.claimed_at)
      INTO n_pending, n_processing, n_waiting, n_dead, n_expired, oldest, last_claim
      FROM outbox o
     WHERE o.unfinished;

    -- The newest events by id, whatever their state (a backward walk of each partition's primary key).
    SELECT max(r.claimed_at) INTO recent_claim
      FROM (SELECT o.claimed_at FROM outbox o ORDER BY o.id DESC LIMIT 1000) r;

    last_claim := greatest(last_claim, recent_claim);  -- greatest() ignores NULLs
    RETURN QUERY SELECT n_pending + n_processing, n_pending, n_processing, n_waiting, n_dead, n_expired,
                        now() - oldest, last_claim,
                        coalesce(last_claim >= now() - interval '1 minute', false);
END;
$$;

COMMENT ON FUNCTION outbox_health_row() IS
    'The row of the outbox_health view (computed with index scans only).';

CREATE VIEW outbox_health AS
SELECT * FROM outbox_health_row();

COMMENT ON VIEW outbox_health IS
    'One row, cheap (reads unfinished events and the 1000 newest ids, never the bulk of published ones): backlog, oldest pending age, dead letters, expired leases, last claim and whether a worker claimed within the last minute.';
COMMENT ON COLUMN outbox_health.backlog IS 'Events pending (incl. waiting for a retry or held back) or leased.';
COMMENT ON COLUMN outbox_health.oldest_pending_age IS 'now() - created_at of the oldest pending or leased event; NULL when there is none.';
COMMENT ON COLUMN outbox_health.dead IS 'Dead letters: each holds back the later events of its aggregate until requeued or discarded.';
COMMENT ON COLUMN outbox_health.expired_leases IS 'Leases past locked_until (worker died or hung); the next outbox_claim() retries them.';
COMMENT ON COLUMN outbox_health.last_claim_at IS 'Last claim found among unfinished events and the 1000 newest ids; never later than the true last claim.';
COMMENT ON COLUMN outbox_health.worker_claimed_last_minute IS 'last_claim_at within the last minute. With a backlog, false means no worker is delivering.';
