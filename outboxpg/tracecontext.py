"""W3C trace context (``traceparent``, ``tracestate``) in an event's headers.

The producer helpers (outboxpg.producer) write the current OpenTelemetry context into the
headers of the events they insert, when ``opentelemetry-api`` is installed (the ``otel`` extra)
and a span is current; the worker sends row headers as NATS headers, so the context reaches the
broker and the consumers unchanged (the event's *creation context*, in OpenTelemetry's messaging
terms), and the worker's own span (outboxpg.relay.tracing) is a child of it.

Always the W3C format, whatever propagator the application configured globally: ``traceparent``
in the headers column is the outbox's contract with every language and with plain SQL callers,
who write it themselves (``headers => '{"traceparent": "00-<trace id>-<span id>-01"}'``).
Without opentelemetry-api this module captures nothing, at the cost of one failed import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["TRACEPARENT", "TRACESTATE", "current_headers", "extract", "with_current"]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

try:
    from opentelemetry import trace as _trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:   # opentelemetry-api not installed: nothing to capture
    _propagator = None
else:
    _propagator = TraceContextTextMapPropagator()


def current_headers() -> dict[str, str] | None:
    """``traceparent`` (and ``tracestate``, if any) of the current OpenTelemetry span; None when
    no valid span is current or opentelemetry-api is not installed."""
    if _propagator is None or not _trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier or None


def with_current(headers: Mapping[str, str] | None, current: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``headers`` with ``current`` (current_headers()) added, unless the caller's headers
    already carry a traceparent (any case): the caller's choice wins."""
    if current is None:
        return headers
    if headers is None:
        return current
    if any(k.lower() == TRACEPARENT for k in headers):
        return headers
    return {**headers, **current}


def extract(headers: Mapping[str, str]) -> Any:
    """The OpenTelemetry context an event's headers carry (a ``traceparent`` in any case), or
    None when they carry none (or opentelemetry-api is not installed)."""
    if _propagator is None or not headers:
        return None
    carrier = headers if TRACEPARENT in headers else {k.lower(): v for k, v in headers.items()}
    if TRACEPARENT not in carrier:
        return None
    return _propagator.extract(carrier)
