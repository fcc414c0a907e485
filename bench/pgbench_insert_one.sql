-- pgbench script for bench/sql_core.py, section C: one event per transaction.
-- pgbench runs each script execution as its own transaction (autocommit), so every INSERT
-- commits on its own. The aggregate is random among 100,000, so producers rarely collide.
\set aid random(1, 100000)
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', :aid, 'created', '{"n":1}');
