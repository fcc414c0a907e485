-- outboxpg 0004: how long a failed attempt waits before the next one.
--
-- Capped exponential backoff with "equal jitter": attempt n (1-based) waits a random 50-100%
-- of least(backoff_cap, backoff_base * 2^(n-1)). The jitter spreads out events that failed
-- together (a broker outage), so they do not all retry in the same instant.
-- depends: 0001_outbox_settings
DO $$ BEGIN PERFORM set_config('search_path', format('%I, pg_temp', current_schema()), false); END $$;

CREATE FUNCTION outbox_retry_delay(attempt integer, base interval, cap interval) RETURNS interval
LANGUAGE sql
VOLATILE  -- random()
PARALLEL SAFE
AS $$
    -- least(attempt, 40) keeps 2^(n-1) far from overflowing an interval.
    SELECT least(cap, base * power(2, least(greatest(attempt, 1), 40) - 1))
           * (0.5 + random() / 2)
$$;

COMMENT ON FUNCTION outbox_retry_delay(integer, interval, interval) IS
    'Backoff before the next attempt after attempt n failed: random 50-100% of least(cap, base * 2^(n-1)).';
