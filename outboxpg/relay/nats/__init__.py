"""The NATS JetStream publisher (``outboxpg-worker``'s default), by concern:

- publisher: NatsPublisher, the publisher itself: a claimed batch in order per aggregate
  (sequential acks), the outcomes, the timeout
- connection: the nats-py client, its retries and replacement, the reply inbox;
  parse_servers, supports_atomic_batch
- acks: what an answer on the reply subject says (stored, duplicate, refused, permanent)
- headers: an event's message headers and the size limits they count in
- runs: the batches and runs in flight, their reply tokens, how a run ends
- batches: long runs as JetStream atomic batches, chunk after chunk
- streams: stream administration: which stream captures a subject, check_stream, ensure_stream
- subjects: the Subject record, which prefix captures a subject, the text about uncaptured ones
  (no nats-py: ``outboxpg status`` imports it without loading the client)

Import each name from its module (``from outboxpg.relay.nats.publisher import NatsPublisher``).
"""
