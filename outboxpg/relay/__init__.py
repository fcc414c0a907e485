"""The relay: what ``outboxpg-worker`` runs. Claims events, hands them to a publisher, reports
the outcomes back; every decision about an event is made by the SQL functions it calls.

- worker: the Worker, its loop and the idle protocol; config: WorkerConfig, the worker's options
- gateway: every statement the worker sends while it runs, on its connection pool (the few of
  its start-up checks, wakeup connection and metrics sample are in outboxpg/statements.py)
- stats: the running totals, the metrics and the log lines about outcomes, one call per event
  of the loop; metrics: the Prometheus metrics themselves
- maintenance: outbox_maintain() on a schedule; wakeup: the LISTEN connection and the wakeup lock
- publishers: the publisher protocol (Publisher, PermanentError, NotSent) and adapters for plain
  functions; nats/: the NATS JetStream publisher and stream administration (nats/__init__.py)
- pooler: the transaction-pooler probe; tracing: a span per published event
- backoff: the one pause schedule of reconnects and retries
"""
