"""The MQTT sink (outboxpg.sinks.mqtt) on its own, against private mosquitto brokers: what the
conformance suite does not reach (the URL and its options, the login, the checks before sending,
PUBACK reason codes, the broker's Receive Maximum, a connection lost or too slow mid-batch)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from commands import WORKER
from mosquitto import Mosquitto, Subscriber, find_mosquitto
from proxy import TcpProxy

from outboxpg.events import OutboxEvent, runs_of
from outboxpg.relay.publishers import NotSent, PermanentError
from outboxpg.sinks import open_sink
from outboxpg.sinks.base import SinkSettings, SinkUnreachable
from outboxpg.sinks.mqtt import MqttSink
from outboxpg.sinks.mqtt_connection import ConnectionLost, MqttConnection
from outboxpg.sinks.mqtt_messages import MQTT_MAX_PACKET, MSG_ID, message_of, publish_packet_bytes

Outcomes = Sequence[BaseException | None]


@pytest.fixture(scope="module")
def mosquitto_binary() -> str:
    binary, why = find_mosquitto()
    if binary is None:
        pytest.skip(why)
    return binary


@pytest.fixture
def broker(mosquitto_binary: str) -> Iterator[Mosquitto]:
    with Mosquitto(mosquitto_binary) as b:
        yield b


def ev(i: int, aggregate: str, *, subject: str = "outbox.order.paid", payload: bytes = b'{"n": 1}',
       headers: dict[str, str] | None = None) -> OutboxEvent:
    return OutboxEvent(i, subject, "order", aggregate, "paid", payload, headers or {}, f"msg-{i}", 1,
                       datetime.now(UTC))


def sink(url: str, timeout: float = 5.0, **options: str) -> MqttSink:
    s = open_sink(SinkSettings(url, options=options, publish_timeout=timeout))
    assert isinstance(s, MqttSink)
    return s


def check_runs(events: Sequence[OutboxEvent], outcomes: Outcomes) -> None:
    """Each run: published events, then at most one failure, then NotSent for the rest."""
    for run in runs_of(events):
        states = ["ok" if outcomes[i] is None else "skip" if isinstance(outcomes[i], NotSent) else "fail"
                  for i in run]
        first_bad = next((n for n, s in enumerate(states) if s != "ok"), len(states))
        assert states[first_bad:first_bad + 1] in ([], ["fail"]), states
        assert all(s == "skip" for s in states[first_bad + 1:]), states


@pytest.mark.parametrize("url, options, message", [
    ("mqtt://h?qos=0", {}, "qos=0 is not supported"),
    ("mqtt://h", {"qos": "2"}, "qos=2 is not supported"),
    ("mqtt://h?retain=1", {}, "unknown option 'retain'"),
    ("mqtt://h/outbox", {}, "an MQTT URL has no path"),
    ("mqtt://h?keepalive=1", {}, "keepalive='1' is not a whole number from 5 to 65535"),
    ("mqtt://h?max_packet_size=lots", {}, "max_packet_size='lots'"),
    ("mqtt://h?ca_file=/x.pem", {}, "ca_file is for mqtts://"),
    ("mqtts://h?ca_file=/nonexistent.pem", {}, "ca_file '/nonexistent.pem'"),
    ("mqtt://u:pw@:1883", {}, "no broker host"),
])
def test_the_url_and_its_options_are_checked_before_connecting(url: str, options: dict[str, str],
                                                               message: str) -> None:
    with pytest.raises(ValueError, match="^--sink .*") as info:
        open_sink(SinkSettings(url, options=options))
    assert message in str(info.value)
    assert "\n" not in str(info.value) and "pw" not in str(info.value)


def test_describe_names_the_broker_without_credentials() -> None:
    s = sink("mqtts://user:s3cret@broker.example:8884?client_id=w1")
    assert s.describe() == "mqtts://broker.example:8884"   # no user, password or query
    assert (s.host, s.port, s.username, s.password, s.client_id) == ("broker.example", 8884, "user", "s3cret", "w1")
    assert sink("mqtt://broker.example").port == 1883 and sink("mqtts://broker.example").port == 8883


async def test_events_become_qos1_messages_with_topic_properties_and_order(broker: Mosquitto) -> None:
    with Subscriber(broker.port) as sub:
        s = sink(broker.url)
        await s.start()
        try:
            # 30 aggregates, runs of 1 to 4 interleaved; the row's headers carried, the outbox's own
            # names winning over a row header named like one of them.
            events = [ev(i, f"a{i % 30}", headers={"traceparent": "00-ab-cd-01", "outbox-id": "spoofed"})
                      for i in range(1, 76)]
            assert await s.publish_batch(events) == [None] * len(events)
        finally:
            await s.close()
        got = await sub.wait_for(len(events))
    assert len(got) == len(events)
    m = got[0]
    assert (m.topic, m.payload, m.content_type) == ("outbox/order/paid", b'{"n": 1}', "application/json")
    assert m.properties == [(MSG_ID, "msg-1"), ("Outbox-Id", "1"), ("Outbox-Event-Type", "paid"),
                            ("Outbox-Aggregate-Type", "order"), ("Outbox-Aggregate-Id", "a1"),
                            ("Outbox-Attempt", "1"), ("traceparent", "00-ab-cd-01")]
    per: dict[str, list[int]] = {}
    for r in got:
        per.setdefault(r.property("Outbox-Aggregate-Id") or "", []).append(int(r.property("Outbox-Id") or 0))
    assert all(ids == sorted(ids) for ids in per.values()) and len(per) == 30
    assert s.connections == 1 and s.no_subscribers == 0


async def test_what_mqtt_cannot_carry_is_permanent_before_sending_and_the_rest_flows(mosquitto_binary: str) -> None:
    """Mosquitto closes the connection of a client that sends a control character in a string or a
    packet over its max_packet_size: the sink refuses those events before sending, so the events
    beside them (even on the same connection) are published, and the connection stays up."""
    with Mosquitto(mosquitto_binary, "max_packet_size 2048") as b, Subscriber(b.port) as sub:
        s = sink(b.url)
        await s.start()
        try:
            limit = s.connection.max_packet if s.connection else 0
            assert limit == 2048
            # A payload that makes the PUBLISH exactly 2048 bytes, and one a byte larger.
            probe = ev(7, "fits")
            message = message_of(probe, limit)
            assert not isinstance(message, PermanentError)
            size = publish_packet_bytes(message.topic, message.properties, len(probe.payload))
            fits = b'"' + b"x" * (len(probe.payload) + 2048 - size - 2) + b'"'
            bad = {
                1: ev(1, "wild", subject="outbox.order.+"),
                2: ev(2, "hash", subject="outbox.#"),
                3: ev(3, "dollar", subject="$SYS.order"),
                4: ev(4, "newline", headers={"note": "two\nlines"}),
                5: ev(5, "nul\x00"),
                6: ev(6, "long", payload=fits + b" "),   # "long", as long as "fits": one byte over
            }
            events = [*bad.values(), ev(7, "fits", payload=fits), ev(8, "fine"), ev(9, "long")]
            outcomes = await s.publish_batch(events)
            assert s.connections == 1 and s.connection is not None and s.connection.lost is None
        finally:
            await s.close()
        got = await sub.wait_for(2)
        # The first packet the broker refuses is one the sink refused: the sink counts the whole
        # packet, as the specification does; mosquitto 2.0 leaves the remaining length's own two
        # bytes out of its count, so it takes up to 2050 and closes the connection at 2051.
        connection = MqttConnection("127.0.0.1", b.port)
        await connection.connect(5)
        over = message_of(ev(6, "long", payload=fits + b"   "), MQTT_MAX_PACKET)
        assert not isinstance(over, PermanentError)
        assert publish_packet_bytes(over.topic, over.properties, len(fits) + 3) == 2051
        with pytest.raises(ConnectionLost, match="Packet too large"):
            await asyncio.wait_for(connection.send(over.topic, fits + b"   ", over.properties), 5)
        await connection.close()
    reasons = {i: str(outcomes[n]) for n, i in enumerate(bad)}
    assert all(isinstance(outcomes[n], PermanentError) for n in range(len(bad))), outcomes
    assert "wildcard" in reasons[1] and "wildcard" in reasons[2]
    assert "starts with '$'" in reasons[3]
    assert "user property 'note' holds the character U+000A" in reasons[4]
    assert "U+0000" in reasons[5]
    assert reasons[6] == (f"MQTT PUBLISH of 2049 bytes (payload {len(fits) + 1}) exceeds the broker's maximum "
                          "packet size of 2048 bytes")
    assert outcomes[6:8] == [None, None]
    assert isinstance(outcomes[8], NotSent)
    assert sorted(r.property("Outbox-Id") for r in got) == ["7", "8"]   # the 2048 bytes went through


@pytest.mark.parametrize("text, refused", [
    ("plain ascii ~!", None), ("caf\u00e9 \u4e2d", None), ("\U0001f600", None),
    ("del\x7f", "U+007F"), ("esc\x1b", "U+001B"), ("c1\x85", "U+0085"), ("\ufdd0", "U+FDD0"),
    ("\U0001fffe", "U+1FFFE"), ("tab\t", "U+0009"),
])
def test_every_string_is_checked_for_what_mosquitto_refuses(text: str, refused: str | None) -> None:
    for event in (ev(1, text), ev(1, "a", headers={"h": text}), ev(1, "a", subject=f"outbox.{text}")):
        message = message_of(event, MQTT_MAX_PACKET)
        if refused is None:
            assert not isinstance(message, PermanentError), message
        else:
            assert isinstance(message, PermanentError) and f"the character {refused}" in str(message)


async def test_a_lower_max_packet_size_option_is_the_limit(broker: Mosquitto) -> None:
    s = sink(broker.url, max_packet_size="300")
    await s.start()
    try:
        outcomes = await s.publish_batch([ev(1, "a", payload=b'"' + b"x" * 300 + b'"'), ev(2, "b")])
    finally:
        await s.close()
    assert "exceeds the broker's maximum packet size of 300 bytes" in str(outcomes[0])
    assert outcomes[1] is None


async def test_puback_reason_codes_not_authorized_is_permanent_no_subscribers_is_published(
        mosquitto_binary: str) -> None:
    acl = "topic readwrite outbox/order/#\ntopic readwrite outbox/unheard/#\n"
    with Mosquitto(mosquitto_binary, acl=acl) as b, Subscriber(b.port, topic="outbox/order/#") as sub:
        s = sink(b.url)
        await s.start()
        try:
            # Alone in its batch: mosquitto 2.0 closes the connection right after its 0x87 PUBACK,
            # and a PUBLISH it has not read yet makes that close a reset, which can lose the PUBACK
            # (then the event fails as a lost connection, and is retried).
            (denied,) = await s.publish_batch([ev(1, "x", subject="outbox.secret.paid")])
            # The next batch goes on the connection that replaces the closed one: on a loaded
            # machine the close can be seen after this batch's PUBACK, and a batch sent between
            # the two fails as a lost connection (the worker would retry it; this test would not).
            deadline = time.monotonic() + 10
            while s.connections < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            events = [ev(2, "y"), ev(3, "z", subject="outbox.unheard.paid"), ev(4, "z", subject="outbox.unheard.paid")]
            outcomes = await s.publish_batch(events)
        finally:
            await s.close()
        got = await sub.wait_for(1)
    assert isinstance(denied, PermanentError), denied
    assert str(denied) == "the MQTT broker refused the message: not authorized (0x87)"
    assert outcomes == [None, None, None]
    assert [r.property("Outbox-Id") for r in got] == ["2"]
    assert s.no_subscribers == 2   # 0x10: acknowledged, and given to nobody
    assert s.connections == 2


async def test_start_unreachable_not_mqtt_or_bad_login_is_sink_unreachable(mosquitto_binary: str,
                                                                          pg_server: Any) -> None:
    with socket_bound() as closed_port:
        s = sink(f"mqtt://127.0.0.1:{closed_port}", timeout=2)
        with pytest.raises(SinkUnreachable, match="cannot connect to the MQTT broker at 127.0.0.1:.*refused"):
            await s.start()
        await s.close()
    # PostgreSQL's port: a server, but not an MQTT broker.
    s = sink(f"mqtt://127.0.0.1:{pg_server.port}", timeout=2)
    with pytest.raises(SinkUnreachable, match="is it an MQTT broker"):
        await s.start()
    await s.close()
    with Mosquitto(mosquitto_binary, passwords={"relay": "right-secret"}) as b:
        s = sink(f"mqtt://relay:wr%40ng-secret@127.0.0.1:{b.port}", timeout=2)
        with pytest.raises(SinkUnreachable) as info:
            await s.start()
        # What mosquitto 2.0 answers to a wrong password.
        assert str(info.value) == (f"the MQTT broker at 127.0.0.1:{b.port} refused the connection: "
                                   "Not authorized (0x87)")
        await s.close()
        s = sink(f"mqtt://relay:right-secret@127.0.0.1:{b.port}")
        await s.start()
        assert await s.publish_batch([ev(1, "a")]) == [None]
        await s.close()


async def test_mqtts_trusts_the_ca_file_given_and_refuses_an_unknown_certificate(mosquitto_binary: str,
                                                                                 tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificate for a TLS broker")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    with Mosquitto(mosquitto_binary, f"certfile {cert}\nkeyfile {key}") as b:
        s = sink(f"mqtts://127.0.0.1:{b.port}?ca_file={cert}")
        await s.start()
        try:
            assert await s.publish_batch([ev(1, "a")]) == [None]
        finally:
            await s.close()
        s = sink(f"mqtts://127.0.0.1:{b.port}", timeout=3)   # the system's CAs: not this certificate
        with pytest.raises(SinkUnreachable, match="certificate verify failed"):
            await s.start()
        await s.close()


async def test_the_worker_exits_3_on_a_bad_login_with_one_line_and_no_password(mosquitto_binary: str,
                                                                              dsn: str) -> None:
    with Mosquitto(mosquitto_binary, passwords={"relay": "right-secret"}) as b:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "OUTBOXPG_"))}
        p = await asyncio.to_thread(
            subprocess.run, [WORKER, "--dsn", dsn, "--sink", f"mqtt://relay:hunter2@127.0.0.1:{b.port}"],
            capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 3, p
    lines = p.stderr.strip().splitlines()
    assert lines[-1] == (f"outboxpg-worker: --sink mqtt://127.0.0.1:{b.port}: the MQTT broker at 127.0.0.1:{b.port} "
                         "refused the connection: Not authorized (0x87)"), p.stderr
    assert "hunter2" not in p.stderr + p.stdout and "Traceback" not in p.stderr


async def test_in_flight_stays_within_the_brokers_receive_maximum(mosquitto_binary: str) -> None:
    with Mosquitto(mosquitto_binary, "max_inflight_messages 5") as b:
        s = sink(b.url)
        await s.start()
        try:
            # Two batches at once (the worker runs several), 100 aggregates each.
            outcomes = await asyncio.gather(*(s.publish_batch([ev(i, f"{k}-{i % 100}") for i in range(300)])
                                              for k in ("p", "q")))
            assert s.connection is not None
            assert s.connection.receive_maximum == 5
            assert s.connection.peak_in_flight == 5
        finally:
            await s.close()
    assert all(o is None for batch in outcomes for o in batch)


async def test_a_small_batch_is_acknowledged_at_once_by_a_broker_with_nagle_on(broker: Mosquitto) -> None:
    # mosquitto's default (set_tcp_nodelay false) holds a PUBACK back while the one it wrote
    # before is not acknowledged by TCP; a client that delays its ACKs (Linux does, expecting
    # to carry them on its next packet, which here only comes with the next batch) then gets
    # the rest of a burst of PUBACKs after its delayed-ACK timer, 40 ms, instead of at once.
    s = sink(broker.url)
    await s.start()
    try:
        loop = asyncio.get_running_loop()
        took: list[float] = []
        for k in range(30):
            batch = [ev(5 * k + i, f"a{i}") for i in range(5)]
            t0 = loop.time()
            assert await s.publish_batch(batch) == [None] * 5
            took.append(loop.time() - t0)
            await asyncio.sleep(0.005)
    finally:
        await s.close()
    took.sort()
    assert took[len(took) // 2] < 0.010, [f"{t * 1000:.1f} ms" for t in took]


async def test_a_free_slot_goes_to_the_run_with_most_events_left_then_in_order(mosquitto_binary: str) -> None:
    # One slot: the broker receives the PUBLISHes in the order the sink hands them out.
    with Mosquitto(mosquitto_binary, "max_inflight_messages 1") as b, Subscriber(b.port) as sub:
        s = sink(b.url)
        await s.start()
        try:
            # c (1 event), b (2), a (3): a goes first (most left); then b and a both have 2 left,
            # and b has waited longer; and so on.
            events = [ev(1, "c"), ev(2, "b"), ev(3, "a"), ev(4, "b"), ev(5, "a"), ev(6, "a")]
            assert await s.publish_batch(events) == [None] * 6
            # Single PUBLISHes: one that takes the slot, one whose caller stops waiting while it
            # is in line (never sent), one after.
            assert s.connection is not None
            connection = s.connection

            def send(i: int) -> asyncio.Future[tuple[int, str | None]]:
                message = message_of(ev(i, "s"), MQTT_MAX_PACKET)
                assert not isinstance(message, PermanentError)
                return connection.send(message.topic, b"{}", message.properties)

            first, gone = send(7), send(8)
            gone.cancel()
            assert await first == (0, None) and await send(9) == (0, None)
            assert connection.peak_in_flight == 1
        finally:
            await s.close()
        got = await sub.wait_for(8)
    assert [(r.property("Outbox-Aggregate-Id"), r.property("Outbox-Id")) for r in got] == [
        ("a", "3"), ("b", "2"), ("a", "5"), ("c", "1"), ("b", "4"), ("a", "6"), ("s", "7"), ("s", "9")]


async def test_a_connection_lost_mid_batch_fails_what_waits_and_the_next_batch_reconnects(broker: Mosquitto) -> None:
    proxy = TcpProxy("127.0.0.1", broker.port)
    await proxy.start()
    with Subscriber(broker.port) as sub:
        s = sink(f"mqtt://127.0.0.1:{proxy.port}")
        try:
            await s.start()
            proxy.latency = 0.01   # each PUBACK 10 ms late: a run of 40 takes about 0.4 s
            events = [ev(i, f"a{i % 5}") for i in range(200)]
            batch = asyncio.ensure_future(s.publish_batch(events))
            await asyncio.sleep(0.15)
            await proxy.cut()
            outcomes = await batch
            proxy.latency = 0.0
            check_runs(events, outcomes)
            failures = [o for o in outcomes if o is not None and not isinstance(o, NotSent)]
            assert len(failures) == 5 and all(isinstance(o, ConnectionLost) for o in failures), failures
            assert "connection to the MQTT broker was lost" in str(failures[0])
            published = {events[i].msg_id for i, o in enumerate(outcomes) if o is None}
            assert 0 < len(published) < len(events)
            # The next batch connects again and carries the rest.
            rest = [events[i] for i, o in enumerate(outcomes) if o is not None]
            assert await s.publish_batch(rest) == [None] * len(rest)
            assert s.connections == 2
        finally:
            await s.close()
            await proxy.close()
        got = await sub.wait_for(len(events))
    # Every event acknowledged reached the subscriber; a message whose PUBACK the cut lost may
    # come twice, never after a later event of its aggregate.
    msg_ids = [r.property(MSG_ID) for r in got]
    assert set(msg_ids) == {e.msg_id for e in events}
    for aggregate in {e.aggregate_id for e in events}:
        firsts: list[int] = []
        for r in got:
            if r.property("Outbox-Aggregate-Id") == aggregate and int(r.property("Outbox-Id") or 0) not in firsts:
                firsts.append(int(r.property("Outbox-Id") or 0))
        assert firsts == sorted(firsts), aggregate


async def test_an_idle_sink_connects_again_by_itself_and_says_why_not_meanwhile(broker: Mosquitto) -> None:
    s = sink(broker.url, timeout=2)
    await s.start()
    try:
        assert s.health_problem() is None
        await asyncio.to_thread(broker.stop)
        for _ in range(100):
            if s.health_problem() is not None:
                break
            await asyncio.sleep(0.02)
        assert f"no connection to the MQTT broker at 127.0.0.1:{broker.port} (" in (s.health_problem() or "")
        await asyncio.sleep(1.0)   # attempts against the stopped broker
        assert "Connection refused" in (s.health_problem() or ""), s.health_problem()
        await asyncio.to_thread(broker.start)
        for _ in range(400):   # the next attempt within 2 s (0.5 s doubling, at most 5 s)
            if s.health_problem() is None:
                break
            await asyncio.sleep(0.02)
        assert s.health_problem() is None and s.connections == 2   # no batch asked for it
        assert await s.publish_batch([ev(1, "a")]) == [None]
    finally:
        await s.close()
    assert s.health_problem() == "the MQTT sink is closed"


async def test_a_puback_later_than_the_publish_timeout_is_a_timeout_and_the_rest_not_sent(broker: Mosquitto) -> None:
    proxy = TcpProxy("127.0.0.1", broker.port)
    await proxy.start()
    s = sink(f"mqtt://127.0.0.1:{proxy.port}", timeout=1.2)
    try:
        await s.start()
        proxy.latency = 0.7     # PUBACKs 0.7 s late: a run's second event is still waiting at 1.2 s
        events = [ev(i, f"a{i % 3}") for i in range(9)]
        outcomes = await s.publish_batch(events)
        check_runs(events, outcomes)
        assert outcomes[:3] == [None, None, None]
        assert [str(o) for o in outcomes[3:6]] == ["no PUBACK from the MQTT broker within 1.2s"] * 3
        assert all(isinstance(o, NotSent) for o in outcomes[6:])
        proxy.latency = 0.0
        await asyncio.sleep(0.6)   # the late PUBACKs come in, for publishes nobody waits for
        assert await s.publish_batch(events[3:]) == [None] * 6
        assert s.connections == 1
    finally:
        await s.close()
        await proxy.close()


class socket_bound:
    """A loopback port bound (so no one else takes it) and not listening: connecting is refused."""

    def __enter__(self) -> int:
        import socket
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return int(self.s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.s.close()
