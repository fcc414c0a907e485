-- outboxpg 0031: a busy aggregate's head is parked, not dropped, when its line runs empty.
--
-- Why. A head lives as long as its aggregate has unfinished events (0005): a report that finds
-- no event left drops it, and the intake makes it again when the next event comes. A busy
-- aggregate does that all the time, between two of its events. Each new head adds an entry of
-- its key to outbox_heads_pkey, and under a held snapshot (a REPEATABLE READ transaction, a
-- session idle in a transaction) none of them can be removed; the intake's INSERT ... ON
-- CONFLICT then reads every entry of the key, from the oldest, before it makes the head again or
-- reaches the live one. Measured with 10 busy aggregates at 2,000 events/s and a snapshot held
-- 120 s (BENCHMARKS.md, seventh session): 20,493 heads made and 20,486 dropped in the first half
-- of the hold, the intake 2.4-2.6 ms a claim, commit -> JetStream p99 54.9 and 58.4 ms.
--
-- What.
--   * A head counts its runs: each report that moves it on to a next event adds one (runs, a
--     column in no index).
--   * A report that finds no event left keeps the head, parked, when it was leased to the run
--     being reported and has counted 3 runs or more: a busy aggregate between two events.
--     Parking changes only columns in no index (parked, leased_until: one second from now,
--     head_id), so it is a HOT update. Other heads are dropped as before: an aggregate with an
--     event now and then, or a short burst, leaves no parked head behind.
--   * The intake brings a parked head back with a HOT update (parked false, leased_until
--     NULL): due again at the ready_at it kept, and its key gains no entry. It looks the heads of
--     busy aggregates (those with an event among the ones just below its cursor) up from the
--     newest entry of their key, as the reports do since 0030, and finds a parked one at once;
--     the other keys go straight to its INSERT ... ON CONFLICT, whose conflict update brings a
--     parked head back too. Looking every key up first would read a key with no live head twice
--     (the look walks all its entries, then the insert's check).
--   * Lock order: reports lock their heads in one pass in key order. The intake waits only in its
--     insert, which comes first and locks in key order too; the busy heads come after it and
--     are never waited for (SKIP LOCKED, ON CONFLICT DO NOTHING). One held by another
--     transaction keeps the cursor below its aggregate's first event: the next intake takes
--     that event in again. (A first version looked the busy heads up first, waiting: holding
--     one, it could wait in its insert for a head that a report held while it waited for that
--     one, a deadlock.)
--   * A parked head is no claim candidate. One whose second is up is dropped by a claim that
--     finds it among the first 16 due heads (those under which the floor, 0026, waits), after
--     outbox_refresh_heads has looked at its events, like a head found empty. It keeps its
--     ready_at while parked, so the floor stays at or below it: a head that comes back is never
--     below the floor.
--   * outbox_next_wakeup leaves parked heads out: their second running out makes nothing due.
--   * outbox_heads leaves three quarters of a page free (fillfactor 25, 50 before), for the
--     versions of heads that now live long (see the ALTER TABLE below).
--
-- What it costs: outbox_heads takes about twice the pages (fillfactor). A parked head is read (one
-- index entry, not locked) by the claims that pass it in the due heads, for about a second after
-- its aggregate's last event, and the floor waits under it that long. A head that comes back is due
-- at the ready_at it kept, at most a second and one turn (0029) old: ahead of heads that came due
-- since, as a busy head within its turn is. An intake that has caught up reads the ids just below
-- its cursor (twice as many as it takes in, 50 to 500) to know which aggregates are busy. Tried
-- first and measured (BENCHMARKS.md, eighth session): parking every head moved on once, and an
-- intake that looked every key up from its newest entry. With 10,000 aggregates at 2,000 events/s
-- and a held snapshot, many heads were parked and then waited to be dropped with the floor under
-- them (9,124 entries of outbox_heads_ready_idx read per claim), and every head made anew had its
-- key read twice.
-- depends: 0030_outbox_heads_newest_first
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

ALTER TABLE outbox_heads ADD COLUMN parked boolean NOT NULL DEFAULT false;
COMMENT ON COLUMN outbox_heads.parked IS
    'The aggregate has no unfinished event; its head is kept for leased_until, for the intake to bring back (0031).';
ALTER TABLE outbox_heads ADD COLUMN runs integer NOT NULL DEFAULT 0;
-- Room for HOT updates of the heads that live long now. Under a held snapshot no row version can
-- be pruned: a head's update is HOT only while its page has room, and when it has none the new
-- version goes to another page, adds an entry to outbox_heads_pkey, and that insert's uniqueness
-- check reads every entry of the key, from the oldest, and the version each points at. A parked
-- head is updated three times a run and never made anew, so its key's entries pile up: with
-- fillfactor 50 a report parking 9 heads read 1,780 buffers (auto_explain; 10 busy aggregates at
-- 2,000 events/s, 70 s into a hold). A version that moves lands only on a page filled less than
-- this, with the rest left for the head's next versions. The price: inserts fill a page to a
-- quarter, so the table takes about twice the pages of fillfactor 50 (BENCHMARKS.md, ninth
-- session: 10,000 aggregates at 2,000 events/s, two minutes into a held snapshot, 184 MB against
-- 101 MB, and 399 MB with fillfactor 10).
ALTER TABLE outbox_heads SET (fillfactor = 25);
COMMENT ON COLUMN outbox_heads.runs IS
    'How many times a report moved the head on to a next event; 3 or more and it is parked rather than dropped (0031).';

-- 0029's intake: busy heads found from the newest entry of their key, parked ones brought back (marked 0031).
CREATE OR REPLACE FUNCTION outbox_take_in(settled bigint, last_id bigint, chunk integer) RETURNS bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
-- Group the new events by aggregate in a hash table, not by sorting all of them.
SET enable_sort = off
SET jit = off
AS $$
DECLARE
    upto    bigint;
    row_tid tid;                                -- 0027: the version of the intake row locked
    noted   timestamptz;                        -- 0027: its last_claim_at
    types   text[];
    ids     text[];
    firsts  bigint[];
    busy      bigint[] := '{}';                 -- 0031: places in types / ids / firsts of busy aggregates
    live_tids tid[];                            -- 0031: their heads, found and locked
    live_ns   bigint[];                         -- 0031: their places
    held_from bigint;                           -- 0031: the first event of one whose head another holds
    seen    bigint;
    top     bigint;
    at      timestamptz := clock_timestamp();   -- 0026: one time for all the heads made here
BEGIN
    SELECT i.intake_id, i.ctid, i.last_claim_at INTO upto, row_tid, noted
      FROM outbox_intake i FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- 0027: the cursor as locked is committed: the mark may go up to it.
    IF upto > coalesce(pg_sequence_last_value('outbox_intake_mark'), 0) THEN
        PERFORM setval('outbox_intake_mark', upto);
    END IF;
    -- 0027: monitors ask "is a worker claiming?" (outbox_health): to the second, so that a busy
    -- worker does not write the row for that alone. Written with the cursor below, by ctid.
    noted := CASE WHEN noted IS NULL OR noted < at - interval '1 second' THEN at END;
    IF upto >= last_id THEN
        IF noted IS NOT NULL THEN
            UPDATE outbox_intake i SET last_claim_at = noted WHERE i.ctid = row_tid;
        END IF;
        RETURN upto;
    END IF;

    -- One row per aggregate among the new events, with its first event.
    SELECT array_agg(a.aggregate_type ORDER BY a.aggregate_type, a.aggregate_id),
           array_agg(a.aggregate_id ORDER BY a.aggregate_type, a.aggregate_id),
           array_agg(a.first_id ORDER BY a.aggregate_type, a.aggregate_id),
           sum(a.n), max(a.top)
      INTO types, ids, firsts, seen, top
      FROM (SELECT e.aggregate_type, e.aggregate_id, min(e.id) AS first_id, count(*) AS n, max(e.id) AS top
              FROM (SELECT o.id, o.aggregate_type, o.aggregate_id
                      FROM outbox o
                     WHERE o.in_flow
                       AND o.id > upto AND o.id <= last_id
                     ORDER BY o.id
                     LIMIT chunk) e
             GROUP BY e.aggregate_type, e.aggregate_id) a;

    IF types IS NOT NULL THEN
        -- New heads are inserted; a head that exists is locked (in key order, as reports lock
        -- them), so that a report about to drop it because it saw no more events of its
        -- aggregate waits for this transaction and then sees these events
        -- (outbox_refresh_heads). An event that committed late below its aggregate's head (it
        -- was held back by the commit-order guard meanwhile) moves the head back to it.
        -- A new head is due now, whatever this statement's snapshot said of its event: while
        -- the cursor is held back, events read here may have been claimed, or even published
        -- and their head dropped, since (a run reads its aggregate's line beyond the cursor).
        -- The claim that takes the head finds the truth (a lease running: it waits for its end;
        -- no event left: the head is dropped).
        -- 0031: a busy aggregate's head is kept, parked, between two of its events
        -- (outbox_refresh_heads). Its key then has a live version at the newest of its entries,
        -- where INSERT ... ON CONFLICT reads every entry of the key from the oldest before it
        -- reaches it: the heads of busy aggregates are looked up from the newest entry of their
        -- key down (as outbox_refresh_heads finds them, 0030). Busy: an event among the ones just
        -- below the cursor (twice as many as this intake read, 50 to 500), looked for only when
        -- this intake read fewer than a chunk: one catching up on a backlog reads chunks of
        -- thousands, and its insert brings parked heads back as well. Not every key: for a key
        -- with no live head (dropped, to be made again) that look reads all of its entries, and
        -- the insert's check then reads them again.
        IF seen < chunk THEN
            busy := ARRAY(SELECT s.n
                            FROM unnest(types, ids) WITH ORDINALITY AS s(t, i, n)
                           WHERE outbox_aggregate_key(s.t, s.i) = ANY (         -- a collision: one look more
                                 ARRAY(SELECT outbox_aggregate_key(o.aggregate_type, o.aggregate_id)
                                         FROM outbox o
                                        WHERE o.id > upto - least(greatest(2 * seen, 50), 500)
                                          AND o.id <= upto)));
        END IF;

        -- Lock order. Reports lock heads in one pass in key order, and wait. The intake may wait
        -- only in a pass of the same kind, holding no head yet: the other aggregates first, all
        -- in key order in the insert below (new heads made, the others locked by its conflict
        -- update, waiting for a report that holds them). The busy ones after that never wait
        -- (SKIP LOCKED, ON CONFLICT DO NOTHING): holding the first pass's heads, a wait there
        -- could close a circle with a report that holds a busy head and waits for one of those.
        -- 0029: opened_id, the first event's id, orders the heads made here among themselves.
        INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at, opened_id)
        -- 0026: the clock, not now(): a head's ready_at is never below the time its writer
        -- announced (outbox_heads_writing); the claim reads its own time after this.
        SELECT s.t, s.i, outbox_aggregate_key(s.t, s.i), s.f, at, s.f
          FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
         WHERE s.n <> ALL (busy)
        ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE
           SET head_id = least(h.head_id, excluded.head_id),
               -- 0031: a parked head (an aggregate whose events paused) comes back here too
               leased_until = CASE WHEN h.parked THEN NULL ELSE h.leased_until END,
               parked = false
         WHERE h.parked OR h.head_id > excluded.head_id;

        IF cardinality(busy) > 0 THEN
            -- The busy aggregates' heads, each from the newest entry of its key down to the
            -- first version this sees, locked unless another transaction holds it.
            SELECT array_agg(h.tid), array_agg(s.n)
              INTO live_tids, live_ns
              FROM (SELECT s.t COLLATE "C" AS t, s.i COLLATE "C" AS i, s.n
                      FROM unnest(types, ids) WITH ORDINALITY AS s(t, i, n)
                     WHERE s.n = ANY (busy)
                     ORDER BY 1, 2) s
             CROSS JOIN LATERAL (
                   SELECT h.ctid AS tid FROM outbox_heads h
                    WHERE h.aggregate_type = s.t
                      AND h.aggregate_id >= s.i AND h.aggregate_id <= s.i
                    ORDER BY h.aggregate_type DESC, h.aggregate_id DESC
                    LIMIT 1
                      FOR UPDATE SKIP LOCKED) h;
            IF live_tids IS NOT NULL THEN
                -- A parked head comes back: due again at the ready_at it kept, no longer leased.
                -- Only columns in no index change (head_id, leased_until, parked): a HOT update,
                -- no new index entry. By ctid, in a statement of its own: it sees the versions
                -- locked above.
                UPDATE outbox_heads h
                   SET head_id = least(h.head_id, firsts[l.n]),
                       leased_until = CASE WHEN h.parked THEN NULL ELSE h.leased_until END,
                       parked = false
                  FROM unnest(live_tids, live_ns) AS l(tid, n)
                 WHERE h.ctid = ANY (live_tids)
                   AND h.ctid = l.tid
                   AND (h.parked OR h.head_id > firsts[l.n]);
            END IF;
            IF coalesce(cardinality(live_ns), 0) < cardinality(busy) THEN
                -- The busy aggregates whose head was not found: made when there is none (no other
                -- transaction makes heads: the intake row is locked). One that exists is held by
                -- another transaction (SKIP LOCKED passed it): DO NOTHING neither waits for it nor
                -- locks it, and the cursor stays below the aggregate's first event here, for the
                -- next intake to take it in again. Its holder may be a report about to park or drop
                -- it from a view that missed the event.
                WITH made AS (
                    INSERT INTO outbox_heads AS h (aggregate_type, aggregate_id, lock_key, head_id, ready_at, opened_id)
                    SELECT s.t, s.i, outbox_aggregate_key(s.t, s.i), s.f, at, s.f
                      FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
                     WHERE s.n = ANY (busy) AND s.n <> ALL (coalesce(live_ns, '{}'))
                    ON CONFLICT (aggregate_type, aggregate_id) DO NOTHING
                    RETURNING h.aggregate_type, h.aggregate_id)
                SELECT min(s.f) INTO held_from
                  FROM unnest(types, ids, firsts) WITH ORDINALITY AS s(t, i, f, n)
                 WHERE s.n = ANY (busy) AND s.n <> ALL (coalesce(live_ns, '{}'))
                   AND NOT EXISTS (SELECT FROM made m WHERE m.aggregate_type = s.t AND m.aggregate_id = s.i);
            END IF;
        END IF;
    END IF;

    -- Past everything read (all of it when fewer than chunk came back), never past the horizon.
    top := least(CASE WHEN coalesce(seen, 0) < chunk THEN last_id ELSE top END, settled);
    -- 0031: below a busy aggregate whose head another transaction held (see above).
    top := least(top, held_from - 1);
    IF top > upto OR noted IS NOT NULL THEN
        -- 0027: by ctid (a TID scan): the version locked above, not a walk of all of them.
        UPDATE outbox_intake i
           SET intake_id = greatest(top, upto),
               last_claim_at = coalesce(noted, i.last_claim_at)
         WHERE i.ctid = row_tid;
        upto := greatest(top, upto);
    END IF;
    RETURN upto;
END;
$$;

-- 0030's head refresh: a busy head whose line ran empty is parked (marked 0031).
CREATE OR REPLACE FUNCTION outbox_refresh_heads(types text[], ids text[]) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan  -- see outbox_claim, also for the settings below
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
DECLARE
    upto bigint;
    at   timestamptz;
    tids tid[];
BEGIN
    -- 0026: announce the heads' ready_at this writes; none is below `at` (outbox_heads_floor).
    PERFORM outbox_heads_writing();
    at := clock_timestamp();
    -- 0026: each head looked up by its key (LATERAL), in key order. A join let the planner
    -- read all of outbox_heads_pkey instead, once ANALYZE had counted few live heads: under a
    -- held snapshot, every dead entry of every head, on every report (seen: 0.5 s a report).
    -- Their ctids: locked, they stay where they are, and the statement below reads them by
    -- ctid (a TID scan) rather than by key once more.
    SELECT array_agg(h.tid) INTO tids
      FROM (SELECT DISTINCT s.t COLLATE "C" AS t, s.i COLLATE "C" AS i
              FROM unnest(types, ids) AS s(t, i)
             ORDER BY 1, 2) s
     CROSS JOIN LATERAL (
           -- 0030: the key's entries from the newest down, to the first version this sees.
           SELECT h.ctid AS tid FROM outbox_heads h
            WHERE h.aggregate_type = s.t
              AND h.aggregate_id >= s.i AND h.aggregate_id <= s.i
            ORDER BY h.aggregate_type DESC, h.aggregate_id DESC
            LIMIT 1
              FOR UPDATE) h;
    IF tids IS NULL THEN
        RETURN;
    END IF;
    -- Events not taken in yet may lie below a head_id (see outbox_take_in). 0027: the mark, at
    -- most the cursor, rather than a walk of the intake row's versions.
    upto := coalesce(pg_sequence_last_value('outbox_intake_mark'), 0);

    WITH firsts AS MATERIALIZED (
        SELECT h.aggregate_type, h.aggregate_id, h.tid, f.id,
               -- 0031: no event left, but the head was leased to the run this reports and has
               -- been moved on to a next event at least 3 times (runs): a busy aggregate between
               -- two events. It is parked for a second instead of dropped; the intake brings it
               -- back (outbox_take_in).
               f.id IS NULL AND h.leased_until IS NOT NULL AND h.leased_until >= at
                   AND h.runs >= 3 AS park,
               CASE
                    -- 0029: its next event is due, and the head came due less than 250 ms ago:
                    -- it keeps its place (its turn), and this update is HOT (only head_id and
                    -- leased_until change, which no index holds). Its turn over, it goes behind.
                    WHEN f.state = 'pending' AND f.next_attempt_at <= at
                         AND h.ready_at <= at AND h.ready_at > at - interval '250 milliseconds'
                         THEN h.ready_at
                    -- 0026: never below `at` (NULL stays NULL: a dead letter holds the head)
                    WHEN f.state = 'pending' THEN greatest(at, f.next_attempt_at)
                    WHEN f.state = 'processing' THEN greatest(at, f.locked_until)
               END AS ready_at
          FROM (SELECT h.aggregate_type, h.aggregate_id, h.head_id, h.runs, h.ready_at, h.leased_until,
                       h.ctid AS tid
                  FROM outbox_heads h
                 WHERE h.ctid = ANY (tids)) h                        -- 0026: locked above
          LEFT JOIN LATERAL (
                SELECT o.id, o.state, o.next_attempt_at, o.locked_until
                  FROM outbox o
                 WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                   AND o.unfinished
                   AND o.id >= least(h.head_id, upto + 1)
                 ORDER BY o.id
                 LIMIT 1) f ON true),
    -- 0026: by ctid (a TID scan), so that no plan reads all of outbox_heads_pkey; the heads
    -- were locked by the statement before this one.
    dropped AS (
        DELETE FROM outbox_heads h
         WHERE h.ctid = ANY (ARRAY(SELECT f.tid FROM firsts f WHERE f.id IS NULL AND NOT f.park)))
    UPDATE outbox_heads h
       SET head_id  = CASE WHEN f.park
                           -- 0031: no event of it is left, and none can come below the mark
                           -- (outbox_intake_mark: every id up to it has committed or never will)
                           THEN greatest(h.head_id, upto + 1)
                           ELSE f.id END,
           leased_until = CASE WHEN f.park THEN at + interval '1 second'
                               ELSE NULL END,          -- 0028: its events were looked at
           parked   = f.park,                          -- 0031
           runs     = CASE WHEN f.park THEN h.runs ELSE h.runs + 1 END,   -- 0031: counted, never reset
           ready_at = CASE WHEN f.park THEN h.ready_at ELSE f.ready_at END   -- 0029: see firsts
      FROM firsts f
     WHERE h.ctid = ANY (ARRAY(SELECT f2.tid FROM firsts f2 WHERE f2.id IS NOT NULL OR f2.park))
       AND h.ctid = f.tid
       AND (f.park OR (h.head_id, h.ready_at, h.leased_until, h.parked) IS DISTINCT FROM (f.id, f.ready_at, NULL, false));
END;
$$;

-- 0029's claim (SECURITY DEFINER, as 0012 made it): parked heads are no candidates (marked 0031).
CREATE OR REPLACE FUNCTION outbox_claim(batch_size integer, lease interval DEFAULT NULL, worker text DEFAULT NULL)
RETURNS TABLE (
    id             bigint,
    subject        text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb,
    msg_id         text,
    attempts       integer,
    created_at     timestamptz,
    lease_token    uuid,
    locked_until   timestamptz
)
LANGUAGE plpgsql
-- Runs as its owner (0012): a worker has no rights on the tables.
SECURITY DEFINER
SET search_path FROM CURRENT
-- Generic plans: a custom plan would re-plan every statement below on each call, over every
-- partition (milliseconds), for plans that do not depend on the arguments.
SET plan_cache_mode = force_generic_plan
-- Pinned plan shape. These run with generic plans (planned once per session), and a plan made
-- while the table was small must not turn into scans of the whole backlog after a burst (seen:
-- seconds per claim until the next ANALYZE). Index probes and nested loops are the right plan
-- at every size here (a hash join would read all of outbox_heads), so the planner is not given
-- the choice.
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET enable_material = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    cfg     outbox_settings;
    token   uuid := gen_random_uuid();
    -- The lease runs from the moment of the claim, not from the start of the caller's transaction
    -- (0026: read after the intake, so that the heads it made are due at t).
    t       timestamptz;
    floor_at timestamptz;   -- 0026: no head is due below it
    owner   text;
    n       integer;
    g       record;
    upto    bigint;
    remaining  integer;
    empty_types text[] := '{}';
    empty_ids   text[] := '{}';
    pass_empty_types text[];
    pass_empty_ids   text[];
    seen_heads bigint;
    -- What to do with the events read (parallel arrays).
    c_ids   bigint[] := '{}';
    c_tids  tid[] := '{}';
    pass_ids  bigint[];
    pass_tids tid[];
    pass_lo   timestamptz;
    pass_hi   timestamptz;
    r_ids   bigint[];
    r_tids  tid[];
    r_first boolean[];
    r_retry timestamptz[];
    x_ids   bigint[];       -- heads past their expires_at, discarded (0024)
    m_tids  tid[];          -- 0026: the heads to move, and where to
    m_heads bigint[];
    m_ready timestamptz[];
    m_leased timestamptz[]; -- 0028
    x_tids  tid[];
    lo      timestamptz;
    hi      timestamptz;
BEGIN
    IF batch_size IS NULL OR batch_size < 1 THEN
        RAISE EXCEPTION 'outbox_claim: batch_size must be 1 or more, got %', coalesce(batch_size::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO STRICT cfg FROM outbox_settings;
    n := least(batch_size, cfg.max_claim_batch);
    lease := coalesce(lease, cfg.default_lease);
    IF lease <= interval '0' THEN
        RAISE EXCEPTION 'outbox_claim: lease must be positive, got %', lease
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    owner := coalesce(worker, nullif(current_setting('application_name'), ''), 'backend ' || pg_backend_pid());

    -- 0026: this transaction writes heads' ready_at from here on (outbox_heads_floor).
    PERFORM outbox_heads_writing();
    -- Commit order: read before the snapshots of the statements below.
    SELECT * INTO g FROM outbox_commit_guard();
    upto := outbox_take_in(g.settled, g.last_id, least(greatest(2 * n, 500), 10000));
    t := clock_timestamp();
    floor_at := outbox_heads_floor();
    IF NOT cfg.commit_order_guard THEN
        -- Switched off (0013): whatever is visible, in id order per aggregate.
        g.settled := g.last_id;
        g.open_below := g.last_id;
        g.held_keys := '{}';
    END IF;
    IF upto IS NULL THEN
        -- 0027: another claim holds the intake row: the mark, not a walk of the row's versions.
        upto := coalesce(pg_sequence_last_value('outbox_intake_mark'), 0);
    END IF;
    -- 0031: parked heads whose second is up, among the first due heads (those that hold the
    -- floor): dropped below with the heads found empty (outbox_refresh_heads looks at their
    -- events first). A few index entries, read without locks.
    SELECT coalesce(array_agg(p.aggregate_type), '{}'), coalesce(array_agg(p.aggregate_id), '{}')
      INTO empty_types, empty_ids
      FROM (SELECT h.aggregate_type, h.aggregate_id, h.parked, h.leased_until
              FROM outbox_heads h
             WHERE h.ready_at <= t AND h.ready_at >= floor_at
             ORDER BY h.ready_at, h.opened_id
             LIMIT 16) p
     WHERE p.parked AND p.leased_until < t;

    -- Passes: a pass that reclaimed expired runs looks again for the rest of the batch, so a
    -- worker's crash does not cost the next claim its batch (a short claim tells a worker that
    -- nothing more is claimable right now).
    FOR pass IN 1..8 LOOP
        remaining := n - cardinality(c_ids);
        -- One statement a pass. `cand`: the heads whose time has come, oldest first, leaving out
        -- those the guard holds back (head_id is a lower bound of the first event's id; each
        -- event is checked below), each with its line: its first max_run unfinished events, read
        -- twice, as they are (`line`) and locked, SKIP LOCKED (`e`). An event someone else is
        -- changing right now is missing from the second read, and the run ends before it
        -- (`matched`). The nested loop is lazy: it stops after `remaining` events, so heads and
        -- events past them are neither read nor locked.
        WITH cand AS MATERIALIZED (
            SELECT h.aggregate_type, h.aggregate_id, h.head_id AS old_head_id, h.ready_at AS old_ready,
                   h.leased_until AS old_leased,
                   h.tid AS head_tid, h.lock_key, line.ids AS line_ids,
                   e.id, e.ctid, e.created_at, e.state, e.attempts, e.next_attempt_at, e.locked_until, e.lease_token,
                   e.expires_at
              FROM (SELECT h.aggregate_type, h.aggregate_id, h.lock_key, h.head_id, h.ready_at, h.leased_until,
                           h.ctid AS tid
                      FROM outbox_heads h
                     WHERE h.ready_at <= t
                       AND h.ready_at >= floor_at                   -- 0026
                       AND (h.leased_until IS NULL OR h.leased_until < t)   -- 0028: no run in flight
                       AND NOT h.parked                                     -- 0031
                       AND (h.head_id <= g.settled
                            OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))
                     ORDER BY h.ready_at, h.opened_id             -- 0029: head_id is in no index
                     LIMIT remaining
                       FOR NO KEY UPDATE SKIP LOCKED) h
             CROSS JOIN LATERAL (
                   SELECT array(SELECT o.id FROM outbox o
                                 WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                                   AND o.unfinished AND o.id >= least(h.head_id, upto + 1)
                                 ORDER BY o.id LIMIT least(cfg.max_run, remaining)) AS ids
                    OFFSET 0) line   -- once per head, not once per row of the join below
              LEFT JOIN LATERAL (
                   SELECT o.id, o.ctid, o.created_at, o.state, o.attempts, o.next_attempt_at, o.locked_until,
                          o.lease_token, o.expires_at
                     FROM outbox o
                    WHERE o.aggregate_type = h.aggregate_type AND o.aggregate_id = h.aggregate_id
                      AND o.unfinished AND o.id >= least(h.head_id, upto + 1)
                    ORDER BY o.id
                    LIMIT least(cfg.max_run, remaining)
                      FOR UPDATE SKIP LOCKED) e ON true
             LIMIT remaining),
        numbered AS (
            SELECT c.*, row_number() OVER w AS rn, c.id = c.line_ids[row_number() OVER w] AS matched
              FROM cand c
            WINDOW w AS (PARTITION BY c.old_head_id ORDER BY c.id)),
        marked AS MATERIALIZED (
            SELECT m.*,
                   first_value(m.state) OVER w AS first_state,
                   first_value(m.lease_token) OVER w AS first_token,
                   first_value(m.locked_until) OVER w AS first_until,
                   first_value(m.matched) OVER w AS first_matched,
                   -- The run: the prefix of events that are pending, due and not held back.
                   bool_and(m.matched AND m.state = 'pending' AND m.next_attempt_at <= t
                            AND (m.expires_at IS NULL OR m.expires_at > t)        -- 0024: not sent late
                            AND (m.id <= g.settled
                                 OR (m.id <= g.open_below AND m.lock_key <> ALL (g.held_keys)))) OVER w AS in_run,
                   -- A run whose lease ran out: its first event's retry (random jitter, drawn once).
                   CASE WHEN m.rn = 1 AND m.matched AND m.state = 'processing' AND m.locked_until < t
                        THEN t + outbox_retry_delay(m.attempts, cfg.backoff_base, cfg.backoff_cap) END AS retry_at,
                   -- 0024: a pending head past its expires_at is discarded, never handed out (an
                   -- event further down its line is, once it is the head).
                   m.rn = 1 AND m.matched AND m.state = 'pending' AND m.expires_at <= t AS lapsed
              FROM numbered m
            WINDOW w AS (PARTITION BY m.old_head_id ORDER BY m.id)),
        -- The events still leased under an expired run's token go back.
        expired AS MATERIALIZED (
            SELECT m.id, m.ctid, m.created_at, m.rn = 1 AS is_first,
                   CASE WHEN m.rn = 1 AND m.attempts < cfg.max_attempts THEN m.retry_at END AS retry_at
              FROM marked m
             WHERE m.first_state = 'processing' AND m.first_until < t AND m.first_matched
               AND m.matched AND m.state = 'processing' AND m.lease_token = m.first_token),
        -- What each head becomes: read off its first row.
        head_next AS (
            SELECT m.aggregate_type, m.aggregate_id, m.old_head_id, m.old_ready, m.old_leased, m.head_tid,
                   cardinality(m.line_ids) AS line_length,
                   -- Moved up only to a run's first event: that one passed the guard, so no
                   -- earlier event of its aggregate can still appear. Any other event read here
                   -- may have a late-committing predecessor this snapshot cannot see, which the
                   -- intake is about to move the head back to.
                   CASE WHEN m.in_run THEN m.id ELSE m.old_head_id END AS new_head_id,
                   -- 0028: a run leaves ready_at as it is (below: leased_until)
                   CASE WHEN m.in_run THEN m.old_ready
                        WHEN m.lapsed THEN t                           -- its next event, at once
                        WHEN m.retry_at IS NOT NULL
                             THEN CASE WHEN m.attempts >= cfg.max_attempts THEN NULL ELSE m.retry_at END
                        -- No unfinished event seen (a head the intake made from an old view):
                        -- dropped below by outbox_refresh_heads, which looks again first.
                        WHEN cardinality(m.line_ids) = 0 THEN m.old_ready
                        WHEN m.id IS NULL OR NOT m.matched THEN m.old_ready  -- being reported right now
                        WHEN m.state = 'dead' THEN NULL
                        WHEN m.state = 'pending' AND m.next_attempt_at > t THEN m.next_attempt_at
                        WHEN m.state = 'processing' AND m.locked_until >= t THEN m.locked_until
                        ELSE m.old_ready                               -- held back by the guard
                   END AS new_ready,
                   CASE WHEN m.in_run THEN t + lease END AS new_leased      -- 0028
              FROM marked m
             WHERE m.rn = 1),
        -- 0026: the heads that move are moved by the statement after this one, by ctid.
        moved AS (
            SELECT hn.head_tid, hn.new_head_id, hn.new_ready, hn.new_leased
              FROM head_next hn
             WHERE (hn.old_head_id, hn.old_ready, hn.old_leased)
                   IS DISTINCT FROM (hn.new_head_id, hn.new_ready, hn.new_leased))
        SELECT (SELECT array_agg(m.id ORDER BY m.id) FROM marked m WHERE m.in_run),
               (SELECT array_agg(m.ctid ORDER BY m.id) FROM marked m WHERE m.in_run),
               (SELECT array_agg(x.id ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.ctid ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.is_first ORDER BY x.id) FROM expired x),
               (SELECT array_agg(x.retry_at ORDER BY x.id) FROM expired x),
               (SELECT count(*) FROM head_next),
               (SELECT array_agg(hn.aggregate_type) FROM head_next hn WHERE hn.line_length = 0),
               (SELECT array_agg(hn.aggregate_id) FROM head_next hn WHERE hn.line_length = 0),
               (SELECT min(m.created_at) FROM marked m
                 WHERE m.in_run OR m.lapsed OR m.id IN (SELECT x.id FROM expired x)),
               (SELECT max(m.created_at) FROM marked m
                 WHERE m.in_run OR m.lapsed OR m.id IN (SELECT x.id FROM expired x)),
               (SELECT array_agg(m.id ORDER BY m.id) FROM marked m WHERE m.lapsed),
               (SELECT array_agg(m.ctid ORDER BY m.id) FROM marked m WHERE m.lapsed),
               (SELECT array_agg(mv.head_tid) FROM moved mv),
               (SELECT array_agg(mv.new_head_id) FROM moved mv),
               (SELECT array_agg(mv.new_ready) FROM moved mv),
               (SELECT array_agg(mv.new_leased) FROM moved mv)
          INTO pass_ids, pass_tids, r_ids, r_tids, r_first, r_retry, seen_heads, pass_empty_types,
               pass_empty_ids, pass_lo, pass_hi, x_ids, x_tids, m_tids, m_heads, m_ready,
               m_leased;
        IF m_tids IS NOT NULL THEN
            -- 0026: by ctid (a TID scan), in a statement of its own. Joined by key within the
            -- statement above, the planner could read all of outbox_heads_pkey for it once
            -- ANALYZE had counted few live heads: under a held snapshot, every dead entry of
            -- every head, on every claim. The heads were locked above and stay as they are; in
            -- a snapshot of its own this statement sees them as locked, also one that a report
            -- had changed between the snapshot above and its lock.
            -- 0028: a head taken for a run keeps head_id and ready_at: a HOT update.
            UPDATE outbox_heads oh
               SET head_id = mv.new_head_id,
                   ready_at = mv.new_ready,
                   leased_until = mv.new_leased
              FROM unnest(m_tids, m_heads, m_ready, m_leased) AS mv(tid, new_head_id, new_ready, new_leased)
             WHERE oh.ctid = ANY (m_tids)
               AND oh.ctid = mv.tid;
        END IF;
        empty_types := empty_types || pass_empty_types;
        empty_ids := empty_ids || pass_empty_ids;
        EXIT WHEN seen_heads = 0;
        c_ids  := c_ids || pass_ids;          -- || and least/greatest ignore NULLs
        c_tids := c_tids || pass_tids;
        lo := least(lo, pass_lo);
        hi := greatest(hi, pass_hi);

        IF r_ids IS NOT NULL THEN
            -- Reclaim expired runs: the first event failed an attempt (retried after a backoff,
            -- or dead: retry_at NULL), the rest go back unattempted. Their old token matches
            -- nothing from now on (fencing). The heads were moved above, to the retry time.
            UPDATE outbox o
               SET state           = CASE WHEN NOT r.is_first THEN 'pending'
                                          WHEN r.retry_at IS NULL THEN 'dead' ELSE 'pending' END::outbox_state,
                   attempts        = CASE WHEN r.is_first THEN o.attempts ELSE greatest(o.attempts - 1, 0) END,
                   next_attempt_at = CASE WHEN r.is_first THEN coalesce(r.retry_at, t) ELSE t END,
                   dead_at         = CASE WHEN r.is_first AND r.retry_at IS NULL THEN t END,
                   last_error      = CASE WHEN r.is_first
                                          THEN format('lease expired at %s (held by %s)', o.locked_until, o.locked_by)
                                          ELSE o.last_error END,
                   locked_until    = NULL,
                   lease_token     = NULL
              FROM unnest(r_ids, r_first, r_retry) AS r(id, is_first, retry_at)
             WHERE o.ctid = ANY (r_tids)                -- locked above
               AND (o.id = ANY (r_ids)) IS TRUE         -- a ctid from another partition may name a row here
               AND o.created_at BETWEEN pass_lo AND pass_hi
               AND o.id = r.id;
        END IF;
        IF x_ids IS NOT NULL THEN
            -- 0024: past their expires_at, out of the flow (their heads were made ready above,
            -- so the next pass looks at the event behind each).
            UPDATE outbox o
               SET state = 'discarded', discarded_at = t, discard_reason = 'expired'
             WHERE o.ctid = ANY (x_tids)                -- locked above
               AND (o.id = ANY (x_ids)) IS TRUE
               AND o.created_at BETWEEN pass_lo AND pass_hi;
        END IF;
        EXIT WHEN (r_ids IS NULL AND x_ids IS NULL) OR cardinality(c_ids) >= n;
    END LOOP;

    IF cardinality(empty_types) > 0 THEN
        -- Heads with no unfinished event in sight: dropped, or set right, under the protocol
        -- that keeps a new event from losing its head (the claim holds them already).
        PERFORM outbox_refresh_heads(empty_types, empty_ids);
    END IF;
    IF cardinality(c_ids) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY
    WITH claimed AS (
        UPDATE outbox o
           SET state        = 'processing',
               attempts     = o.attempts + 1,
               locked_by    = owner,
               claimed_at   = t,
               locked_until = t + lease,
               lease_token  = token
         WHERE o.ctid = ANY (c_tids)                     -- locked above: still due
           -- A ctid from another partition may name a row here. IS TRUE: a filter, not an
           -- index condition (an index probe per id is what the ctids save).
           AND (o.id = ANY (c_ids)) IS TRUE
           AND o.created_at BETWEEN lo AND hi
     RETURNING o.id,
               coalesce(o.subject, cfg.subject_prefix || '.' || o.aggregate_type || '.' || o.event_type),
               -- The columns' domains (0002), as their base types.
               o.aggregate_type::text, o.aggregate_id::text, o.event_type::text, o.payload,
               o.headers::jsonb, o.msg_id::text,
               o.attempts, o.created_at, o.lease_token, o.locked_until
    )
    SELECT * FROM claimed ORDER BY 1;
END;
$$;

-- 0028's wakeup (SECURITY DEFINER, as 0012 made it): parked heads left out (marked 0031).
CREATE OR REPLACE FUNCTION outbox_next_wakeup() RETURNS timestamptz
LANGUAGE plpgsql
VOLATILE
-- Runs as its owner (0012): a worker has no rights on the tables.
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET max_parallel_workers_per_gather = 0
SET jit = off
AS $$
DECLARE
    g record;
    floor_at timestamptz := to_timestamp(coalesce(pg_sequence_last_value('outbox_heads_floor_us'), 0) / 1000000.0);
BEGIN
    SELECT * INTO g FROM outbox_commit_guard();
    IF NOT (SELECT s.commit_order_guard FROM outbox_settings s) THEN
        g.settled := g.last_id;
    END IF;
    -- When each head can be claimed: ready_at, or, while a run holds it, leased_until (0028).
    -- Leased heads sit among the due ones (ready_at passed), at or above the floor (0026): a
    -- walk over the runs in flight, which is short whenever a worker is idle.
    RETURN least(
        (SELECT min(h.ready_at)
           FROM outbox_heads h
          WHERE h.ready_at > now() - interval '1 second'
            AND (h.leased_until IS NULL OR h.leased_until <= h.ready_at)
            AND (h.ready_at > now()
                 OR h.head_id <= g.settled
                 OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))),
        (SELECT min(h.leased_until)
           FROM outbox_heads h
          WHERE h.ready_at >= floor_at AND h.ready_at <= now()
            AND h.leased_until > h.ready_at
            AND NOT h.parked                      -- 0031: a parked head wakes nobody
            AND h.leased_until > now() - interval '1 second'
            AND (h.leased_until > now()
                 OR h.head_id <= g.settled
                 OR (h.head_id <= g.open_below AND h.lock_key <> ALL (g.held_keys)))));
END;
$$;
