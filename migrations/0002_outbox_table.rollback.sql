DROP TABLE outbox;
DROP TYPE outbox_state;
