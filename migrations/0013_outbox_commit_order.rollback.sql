DROP FUNCTION outbox_open_producers();
DROP TRIGGER outbox_assign_id ON outbox;
DROP FUNCTION outbox_assign_id();
ALTER TABLE outbox ALTER COLUMN id SET DEFAULT nextval('outbox_id_seq');
DROP TRIGGER outbox_hold_horizon ON outbox;
DROP FUNCTION outbox_hold_horizon();
