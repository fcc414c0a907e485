"""The relay: what ``outboxpg-worker`` runs. Claims events, hands them to a publisher, reports
the outcomes back; every decision about an event is made by the SQL functions it calls.

- worker: the Worker (its loop and the idle protocol) and WorkerConfig
- wakeup: the LISTEN connection and the wakeup lock an idle worker holds
- publishers: the publisher protocol and adapters for plain functions; nats_publisher: NATS JetStream
- streams: which JetStream streams capture the outbox's subjects; pooler: the transaction-pooler probe
- metrics: the Prometheus metrics
"""
