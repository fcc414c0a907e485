DROP TABLE outbox;
DROP TYPE outbox_state;
DROP DOMAIN outbox_headers;
DROP DOMAIN outbox_msg_id;
DROP DOMAIN outbox_event_type;
DROP DOMAIN outbox_aggregate_id;
DROP DOMAIN outbox_aggregate_type;
DROP DOMAIN outbox_subject;
