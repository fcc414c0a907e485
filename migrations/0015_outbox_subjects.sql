-- outboxpg 0015: which subjects the unfinished events will be published to.
--
--   SELECT * FROM outbox_unfinished_subjects();       -- subject, explicit, events
--
-- An event goes to its own subject when it has one, else to <subject_prefix>.<aggregate_type>.
-- <event_type> (resolved here as the claim resolves it). A JetStream stream must capture each of
-- them, or every publish of the event fails ("no responders") until it dies. A stream created for
-- <subject_prefix>.> captures the default subjects, not an explicit 'billing.invoice.issued'. So
-- the worker checks the explicit subjects at start (and outboxpg-worker --ensure-stream adds them
-- to the stream), and outboxpg status --nats-url checks them all. A worker login may not read the
-- table (0012), hence a function that runs as its owner and returns no event data but subjects
-- and counts.
--
-- Cost: it reads the next 10,000 events to go out at most (pending and leased, in id order, from
-- the partial index outbox_in_flow_idx), never the published bulk, and groups them. A worker
-- calls it before its first claim: reading a whole backlog of a million events took seconds
-- (350 ms for 200,000 here), every start. An explicit subject first used further back is found
-- when its first publish fails (outboxpg status names the subject of events failing with "no
-- responders"). Dead letters are not read: they go nowhere until requeued. At most max_subjects
-- rows, the most used subjects first.
-- depends: 0012_outbox_privileges
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE FUNCTION outbox_unfinished_subjects(max_subjects integer DEFAULT 100)
RETURNS TABLE (subject text, explicit boolean, events bigint)
LANGUAGE sql STABLE
-- Runs as its owner, like the other functions a worker calls (0012): a worker has no rights on the table.
SECURITY DEFINER
SET search_path FROM CURRENT
-- Cheap by design, but estimated dear (the planner guesses hundreds of settings rows): without
-- this, JIT compiled it on every call (150 ms of a 156 ms call).
SET jit = off
AS $$
    SELECT coalesce(o.subject::text, s.subject_prefix || '.' || o.aggregate_type || '.' || o.event_type),
           o.subject IS NOT NULL,
           count(*)
      FROM (SELECT o.subject, o.aggregate_type, o.event_type
              FROM outbox o
             WHERE o.in_flow
             ORDER BY o.id
             LIMIT 10000) o
     CROSS JOIN outbox_settings s
     GROUP BY 1, 2
     ORDER BY 3 DESC, 1
     LIMIT max_subjects
$$;

COMMENT ON FUNCTION outbox_unfinished_subjects(integer) IS
    'The subjects the next events to go out (pending and leased, the first 10,000 in id order) go to: explicit (the event''s own) or the default <subject_prefix>.<aggregate_type>.<event_type>, with how many events each; the most used first, at most max_subjects.';

-- As 0012 does for the other functions: nobody by default; workers (start-up stream check) and
-- operators (outboxpg status) by their group roles.
REVOKE EXECUTE ON FUNCTION outbox_unfinished_subjects(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION outbox_unfinished_subjects(integer) TO outbox_worker, outbox_operator;
