-- A worker by hand, in psql: claim, publish (here: a comment says what went out), report.
-- docs/how-to/other-language.md runs it as psql -X -a -d shop -f examples/worker_by_hand.sql, on
-- six events of two orders: o-1 (ids 1, 3, 5) and o-0 (ids 2, 4, 6).
-- A claim commits at once (psql's autocommit): the events are leased under one token.
CREATE TEMP TABLE claimed AS SELECT * FROM outbox_claim(50);
SELECT id, aggregate_id, attempts, lease_token FROM claimed ORDER BY id;
SELECT DISTINCT lease_token AS token FROM claimed \gset
-- Published: 2, 4, 6 of o-0 and 1 of o-1. Event 3 failed, so 5 (after it in o-1) was not sent.
SELECT outbox_complete(ARRAY[1, 2, 4, 6], :'token');
SELECT outbox_fail(3, :'token', 'no ack within 10 s');
SELECT outbox_release(ARRAY[5], :'token');
-- o-0 is done; o-1 waits for 3's retry, and then goes out as the run 3, 5.
SELECT id, aggregate_id, state, attempts, next_attempt_at > now() AS waiting FROM outbox ORDER BY id;
