DROP FUNCTION outbox_retry_delay(integer, interval, interval);
