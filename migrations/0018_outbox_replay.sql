-- outboxpg 0018: replay published events, for operators.
--
--   SELECT * FROM outbox_replay_candidates(aggregate_type => 'order', aggregate_id => 'o-7');  -- what would go
--   SELECT outbox_replay(aggregate_type => 'order', aggregate_id => 'o-7');                   -- how many went
--   SELECT outbox_replay(since => now() - interval '1 hour', new_msg_id => true);
--
-- A consumer lost what it had read, a new consumer needs the history, a bug on the consuming side
-- was fixed: the events are still in the table while their partition is inside retention
-- (outbox_maintain drops whole partitions, 0008), in state 'published'. outbox_replay copies the
-- ones its filters match as NEW events: a plain INSERT INTO outbox, in the original id order, in
-- one statement. Nothing of the published rows changes. Because it is an ordinary insert, every
-- rule of the insert path holds for the copies as for any event:
--   * they get new ids from the insert trigger of 0013, after their aggregate's lock, in the
--     order of the statement (ORDER BY the original id): an aggregate's copies reach the stream
--     in their original order, after every event of the aggregate written before the replay
--     (its pending, retrying and dead events included: a dead head holds the copies back too);
--   * the commit-order guard (0013) holds the aggregates back until the replay commits, and the
--     statement trigger of 0003 wakes idle workers at commit;
--   * the domains of 0002 are checked again (the copies are what the originals were).
--
-- What a copy keeps: aggregate_type, aggregate_id, event_type, payload, subject (NULL stays
-- NULL: the default subject is resolved at claim time with the subject_prefix of the day),
-- headers plus 'Outbox-Replay-Of: <original id>' (a consumer, or a query on headers, can tell a
-- copy; a copy of a copy names its own source), and msg_id. The msg_id is the broker's
-- deduplication key (Nats-Msg-Id, 0002): the same one by default, so JetStream drops a copy
-- whose original it still remembers (within the stream's duplicate window) and stores it again
-- after; new_msg_id => true gives each copy a fresh one (as the column default does), so the
-- stream stores it whatever the window: a forced redelivery. No header trick is needed: the
-- column travels with the event and the worker already sends it as Nats-Msg-Id.
-- created_at, attempts and the rest start afresh: a copy is a new event of today's partition.
--
-- Filters (combined with AND; at least one, so that a slip cannot replay the whole retention):
-- ids, aggregate_type, aggregate_id, event_type, and created_at in [since, until). Ids that are
-- not published events (pending, dead, discarded, dropped with their partition) are left out.
-- No match: 0 events, no error. since after until: an error (a typo, not an empty range).
-- outbox_replay_candidates(...) takes the same filters and returns what outbox_replay would copy
-- (id, created_at, in id order): its dry run, and the one place the selection is written.
--
-- Cost: published events are in no index but the primary key (the partial indexes of 0002 hold
-- only unfinished events), so a filter on the aggregate or the event type reads the partitions
-- that since/until leave (the plan is made per call with the values given, so that partitions
-- outside [since, until) are pruned); ids are looked up by the key. A replay is an operator's
-- command, not a hot path: it adds no index that every producer would pay for.
--
-- Privileges: operators only (0012's pattern: run as the owner, nobody by default). Workers and
-- producers may not: re-sending history is a repair, like outbox_requeue.
-- depends: 0002_outbox_table 0012_outbox_privileges 0013_outbox_commit_order
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE FUNCTION outbox_replay_candidates(ids bigint[] DEFAULT NULL, aggregate_type text DEFAULT NULL,
                                         aggregate_id text DEFAULT NULL, event_type text DEFAULT NULL,
                                         since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL)
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
    IF num_nonnulls(ids, aggregate_type, aggregate_id, event_type, since, until) = 0 THEN
        RAISE EXCEPTION 'outbox_replay: no filter given: refusing to replay every published event'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Give ids, aggregate_type, aggregate_id, event_type, since or until (combined with AND).';
    END IF;
    IF since >= until THEN
        RAISE EXCEPTION 'outbox_replay: since (%) is not before until (%)', since, until
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
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
     ORDER BY o.id;
END;
$$;

COMMENT ON FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz) IS
    'The published events outbox_replay would copy with the same filters (combined with AND, at least one; created_at in [since, until)), in id order: its dry run.';

CREATE FUNCTION outbox_replay(ids bigint[] DEFAULT NULL, aggregate_type text DEFAULT NULL,
                              aggregate_id text DEFAULT NULL, event_type text DEFAULT NULL,
                              since timestamptz DEFAULT NULL, until timestamptz DEFAULT NULL,
                              new_msg_id boolean DEFAULT false) RETURNS integer
LANGUAGE plpgsql
-- Runs as its owner (0012): an operator may not insert events nor read payloads itself.
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    replayed integer;
BEGIN
    IF new_msg_id IS NULL THEN
        RAISE EXCEPTION 'outbox_replay: new_msg_id must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    -- Through the insert path of every event (0013 assigns the ids in this statement's order).
    INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, subject, msg_id)
    SELECT o.aggregate_type, o.aggregate_id, o.event_type, o.payload,
           o.headers || jsonb_build_object('Outbox-Replay-Of', o.id::text),
           o.subject,
           CASE WHEN outbox_replay.new_msg_id THEN gen_random_uuid()::text ELSE o.msg_id END
      FROM outbox_replay_candidates(outbox_replay.ids, outbox_replay.aggregate_type, outbox_replay.aggregate_id,
                                    outbox_replay.event_type, outbox_replay.since, outbox_replay.until) c
      JOIN outbox o ON o.id = c.id AND o.created_at = c.created_at
     ORDER BY c.id;
    GET DIAGNOSTICS replayed = ROW_COUNT;
    RETURN replayed;
END;
$$;

COMMENT ON FUNCTION outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean) IS
    'Re-send published events still in the table as new events, in their original order (filters as outbox_replay_candidates, at least one); same msg_id unless new_msg_id (JetStream drops a copy inside its duplicate window); header Outbox-Replay-Of names the original. Returns how many.';

-- As 0012 does for the other functions: nobody by default, the operators by their group role
-- (when it exists: a DBA may have installed without it).
REVOKE EXECUTE ON FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz),
                           outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean)
    FROM PUBLIC;
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_operator') THEN
        GRANT EXECUTE ON FUNCTION outbox_replay_candidates(bigint[], text, text, text, timestamptz, timestamptz),
                                  outbox_replay(bigint[], text, text, text, timestamptz, timestamptz, boolean)
            TO outbox_operator;
    END IF;
END $$;
