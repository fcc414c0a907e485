DROP TABLE outbox_settings;
