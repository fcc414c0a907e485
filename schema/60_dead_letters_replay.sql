-- outboxpg schema: dead letters and replay, for operators.
--
--   SELECT * FROM outbox_dead_letters;                      -- what is dead, and why
--   SELECT outbox_requeue(ARRAY[42]);                       -- try again from attempt 1
--   SELECT outbox_discard(ARRAY[43], 'superseded by #44');   -- give up on it, keeping the reason
--   SELECT * FROM outbox_replay_candidates(aggregate_type => 'order', aggregate_id => 'o-7');  -- what would go
--   SELECT outbox_replay(aggregate_type => 'order', aggregate_id => 'o-7');                   -- how many went
--   SELECT outbox_replay(since => now() - interval '1 hour', new_msg_id => true);
--
-- A dead event holds back the later events of its aggregate (order beats liveness for one
-- aggregate) until it is requeued or discarded; other aggregates are not affected.
--
-- Requeue and discard make events claimable without an insert, so nothing else would wake an
-- idle worker: it would find them only at its fallback poll. They wake idle workers as the
-- insert trigger does (30_wakeup.sql): NOTIFY channel 'outbox' while some worker is idle,
-- otherwise take the wakeup lock shared until commit, so a worker about to go idle waits for
-- this transaction and then claims once more.
--
-- Replay. A consumer lost what it had read, a new consumer needs the history, a bug on the
-- consuming side was fixed: the events are still in the table while their partition is inside
-- retention, in state 'published'. outbox_replay copies the ones its filters match as NEW
-- events: a plain INSERT INTO outbox, in the original id order, in one statement. Nothing of
-- the published rows changes. Because it is an ordinary insert, every rule of the insert path
-- holds for the copies as for any event:
--   * they get new ids from the insert trigger, after their aggregate's lock, in the order of
--     the statement: an aggregate's copies reach the stream in their original order, after every
--     event of the aggregate written before the replay (a dead head holds the copies back too);
--   * the commit-order guard holds the aggregates back until the replay commits, and the
--     statement trigger wakes idle workers at commit;
--   * the columns' domains are checked again (the copies are what the originals were).
--
-- What a copy keeps: aggregate_type, aggregate_id, event_type, payload, subject (NULL stays
-- NULL: the default subject is resolved at claim time with the subject_prefix of the day),
-- headers plus 'Outbox-Replay-Of: <original id>' (a consumer, or a query on headers, can tell a
-- copy), the same id in replay_of (which producers may not write), and msg_id: the broker's deduplication key, the
-- same one by default, so JetStream drops a copy whose original it still remembers (within the
-- stream's duplicate window) and stores it again after; new_msg_id => true gives each copy a
-- fresh one, so the stream stores it whatever the window: a forced redelivery. created_at,
-- attempts and the rest start afresh: a copy is a new event of today's partition.
--
-- Filters (combined with AND; at least one, so that a slip cannot replay the whole retention):
-- ids, aggregate_type, aggregate_id, event_type, and created_at in [since, until). Ids that are
-- not published events (pending, dead, discarded, dropped with their partition) are left out.
-- No match: 0 events, no error. since after until: an error (a typo, not an empty range).
-- Copies made by earlier replays (replay_of set) are left out, even by id, unless
-- include_replays: replaying an aggregate a second time copies its events again, not its events
-- and the first replay's copies of them (3, then 6, then 12). With include_replays a copy of a
-- copy names the copy it was made from.
-- outbox_replay_candidates(...) takes the same filters and returns what outbox_replay would copy
-- (id, created_at, in id order): its dry run, and the one place the selection is written.
-- Published events are in no index but the primary key (the partial indexes hold only
-- unfinished events), so a filter on the aggregate or the event type reads the partitions that
-- since and until leave (the plan is made per call with the values given, so that partitions
-- outside [since, until) are pruned); ids are looked up by the key. A replay is an operator's
-- command, not a hot path: it adds no index that every producer would pay for. Operators only:
-- re-sending history is a repair, like outbox_requeue.
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

-- The dead letters, found in the partial index of unfinished events, with held_back: how many
-- later events of the aggregate wait behind each (pending or leased, with a higher id), a
-- correlated count through the same index, which a query that does not select it never runs
-- (the view is flattened into the query and an unused column is never computed).
CREATE OR REPLACE VIEW outbox_dead_letters AS
SELECT d.id, d.aggregate_type, d.aggregate_id, d.event_type, d.subject, d.attempts, d.last_error, d.dead_at,
       d.created_at, d.msg_id,
       (SELECT count(*)
          FROM outbox h
         WHERE h.aggregate_type = d.aggregate_type AND h.aggregate_id = d.aggregate_id AND h.id > d.id
           AND h.unfinished AND h.state IN ('pending', 'processing')) AS held_back
  FROM outbox d
 WHERE d.state = 'dead'
   AND d.unfinished;   -- implied by the state test; named so that dead letters are found in the
                       -- partial index of unfinished events, not by reading the published bulk

COMMENT ON VIEW outbox_dead_letters IS
    'Dead events (out of attempts or failed permanently), with the last error. Repair with outbox_requeue(ids) or outbox_discard(ids, reason).';
COMMENT ON COLUMN outbox_dead_letters.held_back IS
    'Later events of the same aggregate waiting behind this dead one (pending or leased); delivered in order once it is requeued or discarded.';

CREATE OR REPLACE FUNCTION outbox_requeue(ids bigint[]) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: operators may not update the table themselves.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    requeued integer;
    types    text[];
    aggs     text[];
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION 'outbox_requeue: ids must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- last_error is kept: it says why the event died the last time.
    WITH done AS (
        UPDATE outbox o
           SET state = 'pending', attempts = 0, next_attempt_at = clock_timestamp(), dead_at = NULL
         WHERE o.state = 'dead' AND o.id = ANY (ids)
     RETURNING o.aggregate_type, o.aggregate_id)
    SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO requeued, types, aggs FROM done d;
    IF requeued > 0 THEN
        -- The aggregate's head was held (ready_at NULL): it comes due now.
        PERFORM outbox_refresh_heads(types, aggs);
        IF NOT pg_try_advisory_xact_lock_shared(1868724336, 1) THEN   -- as outbox_wake_workers does
            PERFORM pg_notify('outbox', '');
        END IF;
    END IF;
    RETURN requeued;
END;
$$;

COMMENT ON FUNCTION outbox_requeue(bigint[]) IS
    'Send dead events back to pending with attempts reset; returns how many were dead (other ids are left alone).';

CREATE OR REPLACE FUNCTION outbox_discard(ids bigint[], reason text) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: operators may not update the table themselves.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    discarded integer;
    types     text[];
    aggs      text[];
BEGIN
    IF ids IS NULL THEN
        RAISE EXCEPTION 'outbox_discard: ids must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF reason IS NULL OR reason !~ '[^[:space:]]' THEN  -- blank: empty or only whitespace
        RAISE EXCEPTION 'outbox_discard: a reason is required (it is kept with the event)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Dead events, and pending ones an operator wants out of the way; never a leased one,
    -- whose worker may be publishing it right now.
    WITH done AS (
        UPDATE outbox o
           SET state = 'discarded', discarded_at = clock_timestamp(), discard_reason = left(reason, 8000)
         WHERE o.state IN ('dead', 'pending') AND o.id = ANY (ids)
     RETURNING o.aggregate_type, o.aggregate_id)
    SELECT count(*), array_agg(d.aggregate_type), array_agg(d.aggregate_id) INTO discarded, types, aggs FROM done d;
    IF discarded > 0 THEN
        -- Discarding a head releases the next event of its aggregate.
        PERFORM outbox_refresh_heads(types, aggs);
        IF NOT pg_try_advisory_xact_lock_shared(1868724336, 1) THEN   -- as outbox_wake_workers does
            PERFORM pg_notify('outbox', '');
        END IF;
    END IF;
    RETURN discarded;
END;
$$;

COMMENT ON FUNCTION outbox_discard(bigint[], text) IS
    'Take dead (or pending) events out of the flow for good, keeping the reason; returns how many changed. Leased events are left alone.';

-- The filters both outbox_replay and outbox_replay_candidates refuse, in one place.
CREATE OR REPLACE FUNCTION outbox_replay_check(ids bigint[], aggregate_type text, aggregate_id text,
                                               event_type text, since timestamptz, until timestamptz,
                                               include_replays boolean) RETURNS void
LANGUAGE plpgsql
IMMUTABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    IF num_nonnulls(ids, aggregate_type, aggregate_id, event_type, since, until) = 0 THEN
        RAISE EXCEPTION 'outbox_replay: no filter given: refusing to replay every published event'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Give ids, aggregate_type, aggregate_id, event_type, since or until (combined with AND).';
    END IF;
    IF since >= until THEN
        RAISE EXCEPTION 'outbox_replay: since (%) is not before until (%)', since, until
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF include_replays IS NULL THEN
        RAISE EXCEPTION 'outbox_replay: include_replays must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
END;
$$;

COMMENT ON FUNCTION outbox_replay_check(bigint[], text, text, text, timestamptz, timestamptz, boolean) IS
    'Called by outbox_replay and outbox_replay_candidates: refuses no filter at all, since not before until, a NULL include_replays.';

CREATE OR REPLACE FUNCTION outbox_replay_candidates(ids bigint[] DEFAULT NULL, aggregate_type text DEFAULT NULL,
                                         aggregate_id text DEFAULT NULL, event_type text DEFAULT NULL,
                                         since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
                                         include_replays boolean DEFAULT false)
RETURNS TABLE (id bigint, created_at timestamptz)
LANGUAGE plpgsql
STABLE
-- Runs as its owner, like outbox_replay, which reads its rows: the same selection for both.
SECURITY DEFINER
SET search_path FROM CURRENT
-- A plan per call, with the filters' values: "since IS NULL OR created_at >= since" folds away
-- and the partitions outside [since, until) are pruned, which a generic plan cannot do.
SET plan_cache_mode = force_custom_plan
AS $$
BEGIN
    PERFORM outbox_replay_check(ids, aggregate_type, aggregate_id, event_type, since, until, include_replays);
    RETURN QUERY
    SELECT o.id, o.created_at
      FROM outbox o
     WHERE o.state = 'published'
       AND (outbox_replay_candidates.ids IS NULL OR o.id = ANY (outbox_replay_candidates.ids))
       AND (outbox_replay_candidates.aggregate_type IS NULL OR o.aggregate_type = outbox_replay_candidates.aggregate_type)
       AND (outbox_replay_candidates.aggregate_id IS NULL OR o.aggregate_id = outbox_replay_candidates.aggregate_id)
       AND (outbox_replay_candidates.event_type IS NULL OR o.event_type = outbox_replay_candidates.event_type)
       AND (outbox_replay_candidates.since IS NULL OR o.created_at >= outbox_replay_candidates.since)
       AND (outbox_replay_candidates.until IS NULL OR o.created_at < outbox_replay_candidates.until)
       AND (outbox_replay_candidates.include_replays OR o.replay_of IS NULL)
     ORDER BY o.id;
END;
$$;

COMMENT ON FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz, boolean) IS
    'The published events outbox_replay would copy with the same filters (combined with AND, at least one; created_at in [since, until); copies made by earlier replays only with include_replays), in id order: its dry run.';

-- At most max_events copies a call, all or nothing: a filter that matches more (a slip such as
-- since => '-infinity') copies nothing and says how to go on.
CREATE OR REPLACE FUNCTION outbox_replay(ids bigint[] DEFAULT NULL, aggregate_type text DEFAULT NULL,
                              aggregate_id text DEFAULT NULL, event_type text DEFAULT NULL,
                              since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
                              new_msg_id boolean DEFAULT false, max_events integer DEFAULT 10000,
                              include_replays boolean DEFAULT false) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner: an operator may not insert events nor read payloads itself.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    replayed integer;
BEGIN
    -- outbox_replay_candidates' own checks, made here first: the INSERT below may never call it
    -- (a hash join whose outbox side comes out empty does not read the other side).
    PERFORM outbox_replay_check(ids, aggregate_type, aggregate_id, event_type, since, until, include_replays);
    IF new_msg_id IS NULL THEN
        RAISE EXCEPTION 'outbox_replay: new_msg_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF max_events IS NULL OR max_events < 1 THEN
        RAISE EXCEPTION 'outbox_replay: max_events must be 1 or more, got %', coalesce(max_events::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Through the insert path of every event (its trigger assigns the ids in this statement's
    -- order). A copy belongs to the original's producer. One more than the cap is read: finding
    -- it undoes the statement.
    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, subject, msg_id, produced_by,
                        replay_of)
    SELECT o.aggregate_type, o.aggregate_id, o.event_type, o.payload,
           o.headers || jsonb_build_object('Outbox-Replay-Of', o.id::text),
           o.subject,
           CASE WHEN outbox_replay.new_msg_id THEN gen_random_uuid()::text ELSE o.msg_id END,
           o.produced_by,
           o.id
      FROM (SELECT c.id, c.created_at
              FROM outbox_replay_candidates(outbox_replay.ids, outbox_replay.aggregate_type, outbox_replay.aggregate_id,
                                            outbox_replay.event_type, outbox_replay.since, outbox_replay.until,
                                            outbox_replay.include_replays) c
             ORDER BY c.id
             LIMIT max_events + 1) c
      JOIN outbox o ON o.id = c.id AND o.created_at = c.created_at
     ORDER BY c.id;
    GET DIAGNOSTICS replayed = ROW_COUNT;
    IF replayed > max_events THEN
        RAISE EXCEPTION 'outbox_replay: more than max_events (%) published events match: nothing was replayed', max_events
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Narrow the filters (since, until, aggregate_type, ...), or raise max_events.';
    END IF;
    RETURN replayed;
END;
$$;

COMMENT ON FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean, integer, boolean) IS
    'Re-send published events still in the table as new events, in their original order (filters as outbox_replay_candidates, at least one; copies of earlier replays only with include_replays; at most max_events, else none); same msg_id unless new_msg_id (JetStream drops a copy inside its duplicate window); replay_of and header Outbox-Replay-Of name the original. Returns how many.';
