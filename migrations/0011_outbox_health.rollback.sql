DROP VIEW outbox_health;
DROP FUNCTION outbox_health_row();
