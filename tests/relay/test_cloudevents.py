"""CloudEvents binary content mode (--cloudevents): the messages JetStream stored carry the
spec's required attributes (and ours) as ce-* headers, and the CloudEvents Python SDK parses
them; a run long enough for atomic batches carries them too; the command's flags and errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from cloudevents.core.bindings.http import HTTPMessage, from_binary_event, to_binary_event
from cloudevents.core.v1.event import CloudEvent
from helpers import Running
from jetstream import make_stream
from workers import all_in, wait_until

from outboxpg import Event, enqueue, enqueue_many
from outboxpg.cloudevents import CloudEvents, default_source
from outboxpg.relay.nats.publisher import NatsPublisher
from outboxpg.relay.worker import Worker, WorkerConfig

WORKER = str(Path(sys.executable).parent / "outboxpg-worker")
CE_NAMES = ["ce-specversion", "ce-id", "ce-source", "ce-type", "ce-subject", "ce-time", "content-type"]


def rows_by_msg_id(conn: psycopg.Connection[Any]) -> dict[str, dict[str, Any]]:
    cur = conn.execute("SELECT msg_id, event_type, aggregate_id, created_at, payload FROM outbox")
    return {r[0]: {"type": r[1], "subject": r[2], "time": r[3], "data": r[4]} for r in cur.fetchall()}


async def stored(stream: Any) -> list[Any]:
    info = await stream.js.stream_info(stream.name)
    return [await stream.js.get_msg(stream.name, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)]


def parse(msg: Any) -> CloudEvent:
    """The SDK's binary-mode reader on a stored message: its headers and its data, as they are."""
    event = from_binary_event(HTTPMessage(headers=dict(msg.headers), body=msg.data))
    assert isinstance(event, CloudEvent)   # the SDK validated the required attributes building it
    return event


async def test_stored_messages_parse_as_cloudevents_with_the_required_attributes(dsn, conn, nats_server):
    stream = await make_stream(nats_server.url, atomic=True)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    with conn.transaction():
        # An aggregate id with a space, a '%' and non-ASCII: percent-encoded in ce-subject.
        enqueue(conn, "customer", "Kunde 42 % Müller", "renamed", {"name": "Müller"})
        # A row header that is an optional attribute passes through (ce-dataschema); one that
        # names an attribute the outbox sets gives way (ce-type, Content-Type).
        enqueue(conn, "order", "o-1", "created", {"total": 42},
                headers={"ce-dataschema": "https://shop.example/schemas/order-created",
                         "ce-type": "spoofed", "Content-Type": "text/plain"})
        # One aggregate's run of 40: long enough to go as an atomic batch on nats-server 2.12+.
        enqueue_many(conn, [Event("order", "o-2", "updated", {"n": n}) for n in range(40)])
    database = conn.execute("SELECT current_database()").fetchone()[0]
    publisher = NatsPublisher(nats_server.url, cloudevents=CloudEvents(default_source(database)))
    running = Running(Worker(WorkerConfig(dsn=dsn, poll_interval=0.2), publisher))
    try:
        await wait_until(all_in(dsn, "published", 42), 30, "42 events published")
    finally:
        await running.stop()
    rows = rows_by_msg_id(conn)
    messages = await stored(stream)
    assert len(messages) == 42
    for msg in messages:
        event = parse(msg)
        row = rows[msg.headers["Nats-Msg-Id"]]
        assert event.get_specversion() == "1.0"
        assert event.get_id() == msg.headers["Nats-Msg-Id"]
        assert event.get_source() == f"outboxpg/{database}"
        assert event.get_type() == row["type"]
        assert event.get_subject() == row["subject"]
        assert event.get_time() == row["time"]          # microseconds and all, in UTC
        assert event.get_datacontenttype() == "application/json"
        assert event.get_data() == row["data"]
        # The SDK writing the same event makes the same ce-* headers (names, order aside, and encoding).
        ours = {k: v for k, v in msg.headers.items() if k.startswith("ce-") and k != "ce-dataschema"}
        theirs = {k: v for k, v in to_binary_event(event).headers.items() if k.startswith("ce-")
                  and k != "ce-dataschema"}
        assert ours == theirs
        # The outbox's own headers are still there.
        assert msg.headers["Outbox-Event-Type"] == row["type"]
    by_type = {parse(m).get_type(): m for m in messages}
    renamed = by_type["renamed"]
    assert renamed.headers["ce-subject"] == "Kunde%2042%20%25%20M%C3%BCller"
    assert parse(renamed).get_subject() == "Kunde 42 % Müller"
    created = parse(by_type["created"])
    assert created.get_dataschema() == "https://shop.example/schemas/order-created"
    assert "Content-Type" not in by_type["created"].headers
    assert sorted(k for k in by_type["created"].headers if k.startswith("ce-") or k == "content-type") == sorted(
        CE_NAMES + ["ce-dataschema"])
    if publisher.connection.atomic_server:
        # The run of 40 went as one atomic batch (nats-server 2.12+): its messages, which parsed
        # above, carry the batch's headers beside ours.
        run = [m for m in messages if m.headers["Outbox-Aggregate-Id"] == "o-2"]
        assert len(run) == 40 and all("Nats-Batch-Id" in m.headers for m in run)
    await stream.nc.close()


async def test_nats_publisher_without_cloudevents_sends_no_ce_headers(nats_server):
    from workers import event

    stream = await make_stream(nats_server.url)
    pub = NatsPublisher(nats_server.url)
    await pub.start()
    try:
        assert await pub.publish_batch([event(1, f"{stream.prefix}.order.created")]) == [None]
    finally:
        await pub.close()
    [msg] = await stored(stream)
    assert not [k for k in msg.headers if k.startswith("ce-") or k.lower() == "content-type"]
    await stream.nc.close()


def run_worker(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WORKER, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("args, message", [
    (["--cloudevents", "--publisher", "outboxpg.relay.publishers:print_event"],
     "outboxpg-worker: --cloudevents applies to the NATS publisher only, not with --publisher: a publisher of your "
     "own can call outboxpg.cloudevents.CloudEvents(source).headers(event)"),
    (["--cloudevents-source", "https://shop.example/orders"],
     "outboxpg-worker: --cloudevents-source needs --cloudevents"),
    (["--cloudevents", "--cloudevents-source", "my shop"],
     "outboxpg-worker: the CloudEvents source must be a non-empty URI reference (RFC 3986: ASCII, no spaces; "
     "e.g. https://shop.example/orders or outboxpg/shop), not 'my shop'"),
])
def test_cloudevents_flags_misused_are_one_line_exit_2(args, message):
    r = run_worker("--dsn", "host=127.0.0.1 port=1 dbname=x", *args)
    assert (r.returncode, r.stderr.splitlines()) == (2, [message])


def test_help_names_the_cloudevents_flags_and_variables():
    out = run_worker("--help").stdout
    assert "--cloudevents " in out and "[OUTBOXPG_CLOUDEVENTS]" in out
    assert "--cloudevents-source URI" in out and "[OUTBOXPG_CLOUDEVENTS_SOURCE]" in out


async def test_outboxpg_worker_cloudevents_from_the_environment(dsn, conn, nats_server, tmp_path):
    """OUTBOXPG_CLOUDEVENTS=1 with the default source, then --cloudevents-source: what the
    stored messages say, and the start line."""
    stream = await make_stream(nats_server.url)
    conn.execute("UPDATE outbox_settings SET subject_prefix = %s", (stream.prefix,))
    database = conn.execute("SELECT current_database()").fetchone()[0]
    for n, (extra, env, source) in enumerate([
            ([], {"OUTBOXPG_CLOUDEVENTS": "1"}, f"outboxpg/{database}"),
            (["--cloudevents", "--cloudevents-source", "https://shop.example/orders"], {},
             "https://shop.example/orders")]):
        enqueue(conn, "order", f"o-{n}", "created", {"n": n})
        log = tmp_path / f"worker{n}.log"
        proc = subprocess.Popen([WORKER, "--dsn", dsn, "--nats-url", nats_server.url, "--poll-interval", "0.2", *extra],
                                stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={**os.environ, **env})
        try:
            await wait_until(all_in(dsn, "published", n + 1), 30, f"event {n} published")
        finally:
            proc.terminate()
            assert proc.wait(20) == 0
        assert f"event=cloudevents mode=binary specversion=1.0 source={source}" in log.read_text()
        event = parse((await stored(stream))[n])
        assert (event.get_source(), event.get_data()) == (source, {"n": n})
    await stream.nc.close()


async def test_the_ce_headers_count_in_max_payload(nats_server):
    """A message that fits max_payload without the ce-* headers and not with them is refused
    before sending (PermanentError), never sent for the server to close the connection over."""
    from workers import event

    stream = await make_stream(nats_server.url)
    subject = f"{stream.prefix}.order.created"
    plain, ce = NatsPublisher(nats_server.url), NatsPublisher(nats_server.url, cloudevents=CloudEvents("outboxpg/shop"))
    await plain.start()
    await ce.start()
    try:
        probe = event(1, subject)
        header_block = 12 + sum(len(k) + 4 + len(v) for k, v in plain._headers(probe, 0).items())
        ce_bytes = sum(len(k) + 4 + len(v) for k, v in ce.cloudevents.headers(probe).items())
        room = plain.nc.max_payload - header_block
        payload = b'"' + b"x" * (room - 2 - ce_bytes // 2) + b'"'    # fits without, not with the ce-* headers
        assert await plain.publish_batch([event(1, subject, payload=payload, msg_id=probe.msg_id)]) == [None]
        [outcome] = await ce.publish_batch([event(2, subject, payload=payload)])
        assert "exceeds the NATS server's max_payload" in str(outcome) and type(outcome).__name__ == "PermanentError"
        assert await ce.publish_batch([event(3, subject)]) == [None]      # the connection is fine
        assert ce.replacements == 0
    finally:
        await plain.close()
        await ce.close()
    await stream.nc.close()
