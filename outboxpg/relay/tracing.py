"""A span per published event, when an OpenTelemetry SDK is configured.

NatsPublisher records, for each event it sent (or refused to send as never sendable), one
PRODUCER span named ``publish <subject>`` from the moment the message left to the moment the
broker's ack (or the failure) came back, with the messaging semantic conventions' attributes
(messaging.system = nats, messaging.destination.name = the subject, messaging.message.id =
msg_id, messaging.operation.type = send) and outboxpg's own (event id, attempt). A failure sets
the span's status to ERROR with the reason. Events not sent because an earlier event of their
run failed get no span: nothing happened to them.

Parent: the context the event's headers carry (``traceparent``, written by the producer helpers
or by the caller; outboxpg.tracecontext), so the publish shows up in the trace of the request
that wrote the event, with the time it spent in the outbox visible between the two. A child
rather than a link: the relay's own context (a claim loop) is no useful parent, and a link
would start a new trace per event that a tracing UI shows apart from the request. The message
keeps the producer's traceparent unchanged (the creation context consumers continue from).
An event without a traceparent gets a root span.

Only with an SDK: ``publish_tracer`` returns None unless opentelemetry-sdk is importable and
the tracer provider (given, or the global one) is an SDK TracerProvider; the API's no-op
provider would make every span cost something for nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from outboxpg.events import OutboxEvent
from outboxpg.relay.publishers import NotSent
from outboxpg.text import describe
from outboxpg.tracecontext import extract

__all__ = ["PublishTracer", "publish_tracer"]


def publish_tracer(provider: Any = None) -> PublishTracer | None:
    """A PublishTracer on ``provider`` (default: the global tracer provider) if it is an
    OpenTelemetry SDK TracerProvider, else None."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError:
        return None
    if provider is None:
        provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        return None
    from outboxpg import __version__

    return PublishTracer(provider.get_tracer("outboxpg", __version__))


class PublishTracer:
    def __init__(self, tracer: Any) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.tracer = tracer
        self._producer = SpanKind.PRODUCER
        self._error = (Status, StatusCode.ERROR)

    def record(self, events: Sequence[OutboxEvent], outcomes: Sequence[BaseException | None],
               sent_ns: Sequence[int], done_ns: Sequence[int], started_ns: int) -> None:
        """One span per event (see the module's docstring); times in time.time_ns(), 0: not
        known (then the batch's start, and its end for an event never answered)."""
        status, error = self._error
        for i, event in enumerate(events):
            outcome = outcomes[i]
            if isinstance(outcome, NotSent):
                continue
            start = sent_ns[i] or started_ns
            span = self.tracer.start_span(
                f"publish {event.subject}", context=extract(event.headers), kind=self._producer, start_time=start,
                attributes={"messaging.system": "nats", "messaging.destination.name": event.subject,
                            "messaging.message.id": event.msg_id, "messaging.operation.type": "send",
                            "messaging.operation.name": "publish",
                            "messaging.message.body.size": len(event.payload),
                            "outboxpg.event.id": event.id, "outboxpg.event.attempt": event.attempt})
            if outcome is not None:
                span.set_attribute("error.type", type(outcome).__name__)
                span.set_status(status(error, describe(outcome, whole=True)))
            span.end(end_time=max(done_ns[i], start) if done_ns[i] else None)
