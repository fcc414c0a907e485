"""Compatibility: the NATS JetStream publisher lives in outboxpg.relay.nats_publisher."""

from outboxpg.relay.nats_publisher import (
    NatsPublisher,
    check_stream,
    ensure_stream,
    parse_servers,
    supports_atomic_batch,
)

__all__ = ["NatsPublisher", "check_stream", "ensure_stream", "parse_servers", "supports_atomic_batch"]
