DROP TRIGGER outbox_hold_horizon ON outbox;
DROP FUNCTION outbox_hold_horizon();
ALTER TABLE outbox_settings DROP COLUMN commit_order_guard;
