"""W3C trace context in an event's headers (outboxpg.tracecontext): what the producer helpers
add, what the worker reads back as the parent of its span."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from outboxpg.tracecontext import TRACEPARENT, current_headers, extract, with_current

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_no_current_span_adds_nothing() -> None:
    assert current_headers() is None
    assert with_current({"a": "1"}, None) == {"a": "1"}


def test_the_current_span_becomes_a_traceparent() -> None:
    tracer = TracerProvider().get_tracer("unit")
    with tracer.start_as_current_span("enqueue") as span:
        headers = current_headers()
        context = span.get_span_context()
    assert headers is not None
    assert headers[TRACEPARENT] == f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    assert context.trace_flags.sampled


def test_the_callers_traceparent_wins_in_any_case() -> None:
    current = {TRACEPARENT: PARENT}
    assert with_current(None, current) == current
    assert with_current({"x": "1"}, current) == {"x": "1", TRACEPARENT: PARENT}
    own = {"TraceParent": "00-11111111111111111111111111111111-2222222222222222-01"}
    assert with_current(own, current) is own


def test_extract_reads_a_traceparent_in_any_case() -> None:
    for headers in ({TRACEPARENT: PARENT}, {"Traceparent": PARENT, "other": "x"}):
        context = trace.get_current_span(extract(headers)).get_span_context()
        assert (context.trace_id, context.span_id, context.is_remote) == (
            0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, True)
    assert extract({}) is None and extract({"x": "1"}) is None
    malformed = extract({TRACEPARENT: "00-not-a-trace-01"})
    assert not trace.get_current_span(malformed).get_span_context().is_valid
