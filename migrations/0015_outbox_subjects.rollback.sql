DROP FUNCTION outbox_unfinished_subjects(integer);
