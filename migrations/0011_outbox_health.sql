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
-- last_claim_at               when a worker last called outbox_claim, whatever the claim found
--                             (outbox_intake.last_claim_at, kept to the second by the claim: it can
--                             be up to a second earlier than the very last call); NULL: never
-- worker_claimed_last_minute  whether that was within the last minute; with a backlog, false means
--                             that no worker is claiming
-- open_producers              open transactions that have inserted into outbox (outbox_open_producers(),
--                             0013): each holds back, until it ends, the aggregates it wrote
-- oldest_producer_pid         the backend pid of the one open longest (pg_terminate_backend(pid) ends it)
-- oldest_producer_age         how long its transaction has been open; NULL when the installing role
--                             may not see other roles' sessions (grant it pg_read_all_stats)
-- held_by_open_transactions   pending events that the commit-order guard holds back right now: an
--                             open transaction may still commit an earlier event of their aggregate
--                             (or, having written too many aggregates, any earlier event). They are
--                             part of the backlog, and no worker can deliver them before it ends.
--
-- Unlike outbox_stats, which reads every row, this reads only the unfinished events (pending,
-- processing, dead: the rows of the partial index outbox_unfinished_by_aggregate_idx), the one row
-- of outbox_intake, and the server's lock table and activity (pg_locks, pg_stat_activity: memory,
-- no table). Its cost follows the backlog, not the size of the table: published events, the bulk
-- of it, are never scanned. What the guard holds back is decided by the claim's own rule
-- (outbox_commit_guard, 0005), checked on the unfinished events read anyway: one hash of the
-- aggregate per pending event, only while a producing transaction is open.
--
-- The row is computed by outbox_health_row(), a plpgsql function pinned to index scans like
-- outbox_next_wakeup(): statistics taken during a burst say "most rows are unfinished", and a
-- plain view was then planned as a parallel scan of whole partitions, long after the burst had
-- been delivered. No index is added: the partial indexes of 0002 cover every row it reads.
-- outbox_open_producers() comes with the producers' side of the guard (0013), after this step:
-- where 0013 is not applied, no producer announces itself and the four producer columns say none.
-- depends: 0010_outbox_next_wakeup 0009_outbox_stats 0005_outbox_claim
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
    worker_claimed_last_minute boolean,
    open_producers             integer,
    oldest_producer_pid        integer,
    oldest_producer_age        interval,
    held_by_open_transactions  bigint
)
LANGUAGE plpgsql
STABLE
ROWS 1
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
-- With sequential scans off, any plan with one (outbox_settings, the id sequence) is costed
-- above jit_above_cost: JIT compiled it on every call (8 ms a call here, 84 ms the first).
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    n_pending    bigint;
    n_processing bigint;
    n_waiting    bigint;
    n_dead       bigint;
    n_expired    bigint;
    n_held       bigint;
    oldest       timestamptz;
    last_claim   timestamptz;
    n_producers  integer := 0;
    p_pid        integer;
    p_age        interval;
    guard_on     boolean;
    -- What the claim holds back (outbox_commit_guard): ids above settled, unless at or below
    -- open_below and of an aggregate whose key is not in held_keys. NULL settled: nothing.
    settled      bigint;
    open_below   bigint;
    held_keys    integer[];
BEGIN
    SELECT i.last_claim_at INTO last_claim FROM outbox_intake i;

    IF to_regprocedure('outbox_open_producers()') IS NOT NULL THEN
        SELECT count(*)::integer,
               (array_agg(p.pid ORDER BY p.xact_age DESC NULLS LAST, p.held_above))[1],
               (array_agg(p.xact_age ORDER BY p.xact_age DESC NULLS LAST, p.held_above))[1]
          INTO n_producers, p_pid, p_age
          FROM outbox_open_producers() p;
    END IF;
    IF n_producers > 0 THEN
        SELECT s.commit_order_guard INTO guard_on FROM outbox_settings s;
        IF guard_on THEN
            SELECT g.settled, g.open_below, g.held_keys INTO settled, open_below, held_keys
              FROM outbox_commit_guard() g;
        END IF;
    END IF;

    -- One pass over the unfinished events (the partial index outbox_unfinished_by_aggregate_idx).
    SELECT count(*) FILTER (WHERE o.state = 'pending'),
           count(*) FILTER (WHERE o.state = 'processing'),
           count(*) FILTER (WHERE o.state = 'pending' AND o.next_attempt_at > now()),
           count(*) FILTER (WHERE o.state = 'dead'),
           count(*) FILTER (WHERE o.state = 'processing' AND o.locked_until < now()),
           count(*) FILTER (WHERE o.state = 'pending' AND o.id > settled
                              AND (o.id > open_below
                                   OR outbox_aggregate_key(o.aggregate_type, o.aggregate_id) = ANY (held_keys))),
           min(o.created_at) FILTER (WHERE o.state IN ('pending', 'processing'))
      INTO n_pending, n_processing, n_waiting, n_dead, n_expired, n_held, oldest
      FROM outbox o
     WHERE o.unfinished;

    RETURN QUERY SELECT n_pending + n_processing, n_pending, n_processing, n_waiting, n_dead, n_expired,
                        now() - oldest, last_claim,
                        coalesce(last_claim >= now() - interval '1 minute', false),
                        n_producers, p_pid, p_age, n_held;
END;
$$;

COMMENT ON FUNCTION outbox_health_row() IS
    'The row of the outbox_health view (computed with index scans only).';

CREATE VIEW outbox_health AS
SELECT * FROM outbox_health_row();

COMMENT ON VIEW outbox_health IS
    'One row, cheap (reads unfinished events, the intake row and the lock table, never the bulk of published ones): backlog, oldest pending age, dead letters, expired leases, last claim and whether a worker claimed within the last minute, open producing transactions and what they hold back.';
COMMENT ON COLUMN outbox_health.backlog IS 'Events pending (incl. waiting for a retry or held back) or leased.';
COMMENT ON COLUMN outbox_health.oldest_pending_age IS 'now() - created_at of the oldest pending or leased event; NULL when there is none.';
COMMENT ON COLUMN outbox_health.dead IS 'Dead letters: each holds back the later events of its aggregate until requeued or discarded.';
COMMENT ON COLUMN outbox_health.expired_leases IS 'Leases past locked_until (worker died or hung); the next outbox_claim() retries them.';
COMMENT ON COLUMN outbox_health.last_claim_at IS 'When a worker last called outbox_claim (outbox_intake, to the second), whatever it found; NULL: never.';
COMMENT ON COLUMN outbox_health.worker_claimed_last_minute IS 'last_claim_at within the last minute. With a backlog, false means no worker is claiming.';
COMMENT ON COLUMN outbox_health.open_producers IS 'Open transactions that have inserted into outbox (outbox_open_producers()).';
COMMENT ON COLUMN outbox_health.oldest_producer_pid IS 'Backend pid of the producing transaction open longest; NULL when none is open.';
COMMENT ON COLUMN outbox_health.oldest_producer_age IS 'How long that transaction has been open; NULL when none is, or when the owner may not see its session.';
COMMENT ON COLUMN outbox_health.held_by_open_transactions IS 'Pending events the commit-order guard holds back until open producing transactions end.';
