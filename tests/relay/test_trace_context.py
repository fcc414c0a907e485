"""Trace context: the producer helpers write the current OpenTelemetry context (W3C traceparent,
tracestate) into the events' headers; the worker sends it as NATS headers and records a PRODUCER
span per published event, a child of that context (OpenTelemetry SDK, in-memory exporter)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson
import psycopg
import pytest
from helpers import Running
from jetstream import make_stream
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, SpanKind, StatusCode, format_span_id, format_trace_id
from workers import all_in, wait_until

from outboxpg import Event, enqueue, enqueue_many
from outboxpg.events import OutboxEvent
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.publishers import PermanentError
from outboxpg.relay.tracing import publish_tracer
from outboxpg.relay.worker import Worker, WorkerConfig


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    """An SDK TracerProvider of the test's own (the global one stays unset: see the subprocess tests)."""
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    return p


def traceparent_of(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{format_trace_id(ctx.trace_id)}-{format_span_id(ctx.span_id)}-{ctx.trace_flags:02x}"


def headers_of(conn: psycopg.Connection[Any], id: int) -> dict[str, str]:
    return conn.execute("SELECT headers FROM outbox WHERE id = %s", (id,)).fetchone()[0]


async def test_enqueue_inside_a_span_writes_its_traceparent(conn, dsn, provider):
    tracer = provider.get_tracer("shop")
    with conn.transaction():
        outside = enqueue(conn, "order", "o-1", "created", {})
        with tracer.start_as_current_span("checkout") as span:
            inside = enqueue(conn, "order", "o-1", "paid", {}, headers={"X-Tenant": "acme"})
            # The caller's own traceparent wins (any case), and nothing of the current span is added.
            own = enqueue(conn, "order", "o-1", "shipped", {},
                          headers={"Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
            enqueue_many(conn, [Event("order", "o-2", "created", {}), Event("order", "o-3", "created", {})])
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
        with tracer.start_as_current_span("async checkout") as async_span:
            async_id = await enqueue(aconn, "order", "o-4", "created", {})
            await enqueue_many(aconn, [Event("order", "o-5", "created", {}, headers={"a": "b"})])
    assert headers_of(conn, outside) == {}
    assert headers_of(conn, inside) == {"X-Tenant": "acme", "traceparent": traceparent_of(span)}
    assert headers_of(conn, own) == {"Traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    many = conn.execute("SELECT headers FROM outbox WHERE aggregate_id IN ('o-2', 'o-3')").fetchall()
    assert [h for (h,) in many] == [{"traceparent": traceparent_of(span)}] * 2
    assert headers_of(conn, async_id) == {"traceparent": traceparent_of(async_span)}
    (o5,) = conn.execute("SELECT headers FROM outbox WHERE aggregate_id = 'o-5'").fetchone()
    assert o5 == {"a": "b", "traceparent": traceparent_of(async_span)}


async def test_tracestate_is_carried_too(conn, provider):
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    remote = SpanContext(trace_id=0x0AF7651916CD43DD8448EB211C80319C, span_id=0xB7AD6B7169203331, is_remote=True,
                         trace_flags=TraceFlags(1), trace_state=TraceState([("vendor", "x1")]))
    with trace.use_span(NonRecordingSpan(remote)):
        id = enqueue(conn, "order", "o-1", "created", {})
    assert headers_of(conn, id) == {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                                    "tracestate": "vendor=x1"}


def test_without_opentelemetry_nothing_is_captured_and_nothing_fails(dsn):
    """opentelemetry made unimportable, as when the otel extra is not installed."""
    script = f"""
import sys
sys.modules["opentelemetry"] = None   # import opentelemetry: ImportError
import psycopg, outboxpg
from outboxpg import tracecontext
from outboxpg.relay.tracing import publish_tracer
assert tracecontext.current_headers() is None and publish_tracer() is None
with psycopg.connect({dsn!r}) as c:
    i = outboxpg.enqueue(c, "order", "o-1", "created", {{}})
    print(c.execute("SELECT headers FROM outbox WHERE id = %s", (i,)).fetchone()[0])
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr) == (0, "{}\n", "")


def test_publish_tracer_only_with_an_sdk_tracer_provider():
    assert publish_tracer(NoOpTracerProvider()) is None
    assert publish_tracer(TracerProvider()) is not None
    # The global provider: unset in this process (the API's proxy), then an SDK's, in a process of its own.
    assert publish_tracer() is None
    script = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from outboxpg.relay.tracing import publish_tracer
trace.set_tracer_provider(TracerProvider())
print(publish_tracer() is not None)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "True\n"), r.stderr


def publish_spans(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    """The worker's spans by msg_id."""
    return {s.attributes["messaging.message.id"]: s for s in exporter.get_finished_spans()
            if s.name.startswith("publish ")}


async def test_end_to_end_enqueue_in_a_span_to_the_nats_message_and_the_worker_span(dsn, conn, nats_server,
                                                                                    provider, exporter):
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    tracer = provider.get_tracer("shop")
    with tracer.start_as_current_span("POST /orders") as request:
        with conn.transaction():
            traced = enqueue(conn, "order", "o-1", "created", {"total": 42})
    untraced = enqueue(conn, "order", "o-2", "created", {})
    # A plain SQL producer writes its traceparent itself.
    plain = conn.execute(
        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers) VALUES "
        "('order', 'o-3', 'created', '{}', '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}') "
        "RETURNING id").fetchone()[0]
    rows = dict(conn.execute("SELECT id, msg_id FROM outbox").fetchall())

    publisher = NatsPublisher(nats_server.url, tracer_provider=provider)
    running = Running(Worker(WorkerConfig(dsn=dsn, poll_interval=0.2), publisher))
    try:
        await wait_until(all_in(dsn, "published", 3), 30, "3 events published")
    finally:
        await running.stop()

    # The NATS messages carry the producer's traceparent, unchanged.
    info = await stream.js.stream_info(stream.name)
    messages = {m.headers["Nats-Msg-Id"]: m for m in [await stream.js.get_msg(stream.name, seq)
                                                      for seq in range(info.state.first_seq, info.state.last_seq + 1)]}
    assert messages[rows[traced]].headers["traceparent"] == traceparent_of(request)
    assert "traceparent" not in messages[rows[untraced]].headers
    assert messages[rows[plain]].headers["traceparent"] == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

    spans = publish_spans(exporter)
    assert set(spans) == set(rows.values())
    span = spans[rows[traced]]
    req = request.get_span_context()
    assert span.kind is SpanKind.PRODUCER
    assert span.context.trace_id == req.trace_id            # the request's trace
    assert span.parent is not None and span.parent.span_id == req.span_id   # a child of the span that enqueued
    assert span.name == f"publish {stream.prefix}.order.created"
    assert dict(span.attributes) == {
        "messaging.system": "nats", "messaging.destination.name": f"{stream.prefix}.order.created",
        "messaging.message.id": rows[traced], "messaging.operation.type": "send", "messaging.operation.name": "publish",
        "messaging.message.body.size": len(b'{"total": 42}'), "outboxpg.event.id": traced,
        "outboxpg.event.attempt": 1}
    assert span.status.status_code is StatusCode.UNSET
    assert span.start_time is not None and span.end_time is not None and span.start_time <= span.end_time
    assert span.start_time >= request.end_time                # published after the request's span ended
    assert spans[rows[untraced]].parent is None                # no producer context: a root span
    plain_span = spans[rows[plain]]
    assert format_trace_id(plain_span.context.trace_id) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert plain_span.parent is not None and format_span_id(plain_span.parent.span_id) == "00f067aa0ba902b7"
    await stream.nc.close()


async def test_failed_publishes_are_error_spans_and_not_sent_ones_have_none(nats_server, provider, exporter):
    stream = await make_stream(nats_server.url, max_msg_size=1000)
    pub = NatsPublisher(nats_server.url, tracer_provider=provider)
    await pub.start()

    def event(i: int, payload: bytes) -> OutboxEvent:
        return OutboxEvent(id=i, subject=f"{stream.prefix}.order.created", aggregate_type="order", aggregate_id="o-1",
                           event_type="created", payload=payload, headers={}, msg_id=f"m-{uuid.uuid4()}", attempt=1,
                           created_at=datetime.now(UTC))

    try:
        batch = [event(1, b'{"ok": true}'), event(2, b'{"big": "' + b"x" * 1000 + b'"}'), event(3, b"{}")]
        outcomes = await pub.publish_batch(batch)
    finally:
        await pub.close()
    assert [type(o).__name__ for o in outcomes] == ["NoneType", "PermanentError", "NotSent"]
    spans = publish_spans(exporter)
    assert set(spans) == {batch[0].msg_id, batch[1].msg_id}    # event 3 was not sent: no span
    assert spans[batch[0].msg_id].status.status_code is StatusCode.UNSET
    failed = spans[batch[1].msg_id]
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == PermanentError.__name__
    assert "maximum" in (failed.status.description or "")
    await stream.nc.close()


WORKER_WITH_SDK = """
import sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

# What opentelemetry-instrument or an application's own start-up does: a global SDK provider.
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
    out=open(sys.argv[1], "w"), formatter=lambda span: span.to_json(indent=None) + "\\n")))
trace.set_tracer_provider(provider)
from outboxpg.cli.outboxpg_worker import main
sys.exit(main(sys.argv[2:]))
"""


async def test_outboxpg_worker_with_a_global_sdk_provider_records_child_spans(dsn, conn, nats_server, provider,
                                                                             tmp_path):
    """The command, in a process whose global tracer provider is an SDK's, with --cloudevents:
    the message carries the producer's traceparent beside the ce-* headers, and the span the
    worker exported is a child of the producer's span."""
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    with provider.get_tracer("shop").start_as_current_span("POST /orders") as request:
        id = enqueue(conn, "order", "o-1", "created", {"total": 42})
    spans_file, log = tmp_path / "spans.jsonl", tmp_path / "worker.log"
    proc = subprocess.Popen([sys.executable, "-c", WORKER_WITH_SDK, str(spans_file), "--dsn", dsn,
                             "--nats-url", nats_server.url, "--poll-interval", "0.2", "--cloudevents"],
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    try:
        await wait_until(all_in(dsn, "published", 1), 30, "the event published")
    finally:
        proc.terminate()
        assert proc.wait(20) == 0
    assert "event=tracing" in log.read_text()
    msg = await stream.js.get_msg(stream.name, 1)
    assert msg.headers["traceparent"] == traceparent_of(request)
    assert msg.headers["ce-id"] == msg.headers["Nats-Msg-Id"] == headers_msg_id(conn, id)
    [span] = [s for s in map(orjson.loads, spans_file.read_text().splitlines()) if s["name"].startswith("publish ")]
    req = request.get_span_context()
    assert span["kind"] == "SpanKind.PRODUCER"
    assert span["context"]["trace_id"] == f"0x{format_trace_id(req.trace_id)}"
    assert span["parent_id"] == f"0x{format_span_id(req.span_id)}"
    assert span["attributes"]["messaging.message.id"] == msg.headers["Nats-Msg-Id"]
    await stream.nc.close()


def headers_msg_id(conn: psycopg.Connection[Any], id: int) -> str:
    return conn.execute("SELECT msg_id FROM outbox WHERE id = %s", (id,)).fetchone()[0]


async def test_a_failing_span_processor_does_not_fail_the_batch(nats_server, caplog):
    from opentelemetry.sdk.trace import SpanProcessor

    class Broken(SpanProcessor):
        def on_end(self, span: ReadableSpan) -> None:
            raise RuntimeError("exporter down")

    provider = TracerProvider()
    provider.add_span_processor(Broken())
    stream = await make_stream(nats_server.url)
    pub = NatsPublisher(nats_server.url, tracer_provider=provider)
    await pub.start()
    try:
        e = OutboxEvent(id=1, subject=f"{stream.prefix}.order.created", aggregate_type="order", aggregate_id="o-1",
                        event_type="created", payload=b"{}", headers={}, msg_id=f"m-{uuid.uuid4()}", attempt=1,
                        created_at=datetime.now(UTC))
        assert await pub.publish_batch([e]) == [None]
    finally:
        await pub.close()
    assert "event=tracing_failed error='RuntimeError: exporter down'" in caplog.text
    await stream.nc.close()
