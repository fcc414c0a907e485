DROP FUNCTION outbox_worker_busy();
DROP FUNCTION outbox_worker_idle();
DROP TRIGGER outbox_wake_workers ON outbox;
DROP FUNCTION outbox_wake_workers();
