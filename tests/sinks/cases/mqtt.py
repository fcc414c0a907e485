"""The MQTT case: a mosquitto of the case's own (tests/mosquitto.py: persistence on, unlimited
session queues, max_packet_size 64 KiB), stopped with SIGTERM (mosquitto saves its persistence
file on a clean shutdown) and started again; the worker through a TcpProxy.

MQTT stores nothing by topic: a message is kept only for the subscriptions that match it. What
"the server holds" is therefore what a subscriber received that was subscribed before the worker
started, with QoS 1 and a persistent session (clean start off, session expiry an hour), connected
to the broker directly (a cut of the proxy does not touch it). Across a restart its session
(its subscription and the messages queued for it) is restored from the persistence file, and it
reconnects by itself; a message it received whose PUBACK the restart lost comes again (a
duplicate, which a consumer drops by Outbox-Msg-Id). The proxy lets the worker back in only
once the subscriber is subscribed again after a restart."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from conformance import SinkCase, Stored
from mosquitto import Mosquitto, Subscriber, find_mosquitto
from proxy import TcpProxy

from outboxpg.sinks.mqtt_messages import MSG_ID, subject_of

MAX_PACKET = 65536


class MqttCase(SinkCase):
    name = "mqtt"
    # One byte of JSON over the broker's max_packet_size, before the topic and properties count.
    too_large = b'"' + b"x" * MAX_PACKET + b'"'
    refused_reason = "maximum packet size of 65536"

    def __init__(self, broker: Mosquitto, proxy: TcpProxy, subscriber: Subscriber) -> None:
        self.broker = broker
        self.proxy = proxy
        self.subscriber = subscriber
        self.url = f"mqtt://127.0.0.1:{proxy.port}"
        self._connects = 0

    async def read_back(self) -> list[Stored]:
        """What the subscriber received, once it is connected and has received nothing new for
        0.3 s (what the broker queued for it during a restart comes after its reconnect)."""
        deadline = time.monotonic() + 15
        seen, quiet_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            n = len(self.subscriber.messages())
            if n != seen:
                seen, quiet_since = n, time.monotonic()
            elif self.subscriber.client.is_connected() and time.monotonic() - quiet_since >= 0.3:
                break
            await asyncio.sleep(0.05)
        return [Stored(msg_id=m.property(MSG_ID) or "", subject=subject_of(m.topic), headers=dict(m.properties),
                       payload=m.payload) for m in self.subscriber.messages()]

    async def stop(self) -> None:
        # The worker's way back (the proxy) opens only once the subscriber is subscribed again
        # (start): a broker that lost the subscriber's session over the restart would drop what
        # the worker published before the subscriber's new SUBSCRIBE, a loss of this harness's
        # reader, not of the sink.
        self._connects = len(self.subscriber.connects)
        self.proxy.refuse(3600)
        await asyncio.to_thread(self.broker.stop)

    async def start(self) -> None:
        await asyncio.to_thread(self.broker.start)
        deadline = time.monotonic() + 20
        while not self.subscriber.subscribed_since(self._connects):
            if time.monotonic() > deadline:
                raise AssertionError(f"the subscriber is not subscribed again 20 s after the broker's restart "
                                     f"(disconnects: {self.subscriber.disconnects[-3:]}); broker log: "
                                     f"{self.broker.log()[-1500:]}")
            await asyncio.sleep(0.02)
        self.proxy.refuse(0)


@pytest.fixture
async def mqtt_case() -> AsyncIterator[MqttCase]:
    binary, why = find_mosquitto()
    if binary is None:
        pytest.skip(why)
    broker = Mosquitto(binary, f"max_packet_size {MAX_PACKET}")
    await asyncio.to_thread(broker.start)
    proxy = TcpProxy("127.0.0.1", broker.port)
    subscriber = Subscriber(broker.port)
    try:
        await proxy.start()
        await asyncio.to_thread(subscriber.start)
        yield MqttCase(broker, proxy, subscriber)
    finally:
        await asyncio.to_thread(subscriber.close)
        await proxy.close()
        await asyncio.to_thread(broker.remove)
