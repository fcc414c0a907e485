DROP FUNCTION outbox_next_wakeup();
