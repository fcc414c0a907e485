"""MQTT (mqtt://, mqtts://) for bench/sink_drain.py.

MQTT keeps nothing for a topic nobody subscribes to, so "stored" is "received by a subscriber":
``prepare`` starts one, a ``mosquitto_sub`` process (Debian's mosquitto-clients: C, so that it
is not what limits the figures) subscribed with QoS 1 to ``<prefix>/#`` before anything is
published; ``stored`` counts the events it printed; ``cleanup`` stops it (by its PID; a clean
session, nothing is left on the broker). The broker must not drop what the subscriber has not
taken yet: mosquitto's default max_queued_messages (1000) drops QoS 1 messages past it when the
subscriber falls behind, and the drain then never sees the last event; run the bench against a
broker with ``max_queued_messages 0``.

``run``: the sink's own client, no database: paho-mqtt on the asyncio loop as the sink drives it
(outboxpg.sinks.mqtt_connection: senders queued on the connection, each handing out its next
message once the PUBACK of the one before came, as the sink's runs do), ``count`` QoS 1
PUBLISHes of ``payload`` to ``<prefix>/order/updated`` with the user properties and content
type the worker sends (encoded as the sink encodes them,
outboxpg.sinks.mqtt_messages.PublishProperties), as many awaiting their PUBACK at once as the
broker's Receive Maximum lets the sink have (the sink's shape with more aggregates than that:
one unacknowledged message per aggregate), timed from the first PUBLISH to the last PUBACK, the
same subscriber receiving them (checked after).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from outboxpg.sinks.base import SinkSettings
from outboxpg.sinks.mqtt import MqttSink
from outboxpg.sinks.mqtt_connection import ConnectionLost, MqttConnection
from outboxpg.sinks.mqtt_messages import PublishProperties

WORKER_ARGS: list[str] = []
INFLIGHT = 200   # lanes at most; the broker's Receive Maximum (mosquitto: 20) is the real bound


class _Sub:
    """mosquitto_sub and what it printed so far (sink_drain.py loads this file without registering
    it as a module: no dataclass here)."""

    def __init__(self, proc: subprocess.Popen[bytes], out: Path) -> None:
        self.proc, self.out = proc, out
        self.offset = 0
        self.partial = b""
        self.events = 0
        self.ready = False

    def read(self) -> None:
        with self.out.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            if line.startswith(b"{"):
                self.events += 1
            elif line == b"ready":
                self.ready = True


_subs: dict[str, _Sub] = {}


def _sink(url: str) -> MqttSink:
    return MqttSink(SinkSettings(url, publish_timeout=30.0))


async def prepare(url: str, prefix: str) -> None:
    binary = shutil.which("mosquitto_sub")
    if binary is None:
        raise SystemExit("sink_limits/mqtt: mosquitto_sub not found (apt-get install mosquitto-clients)")
    parts = urlsplit(url)
    args = [binary, "-V", "5", "-q", "1", "-h", parts.hostname or "127.0.0.1",
            "-p", str(parts.port or (8883 if parts.scheme == "mqtts" else 1883)),
            "-i", f"bench-{prefix}", "-t", f"{prefix}/#"]
    if parts.username is not None:
        args += ["-u", unquote(parts.username), "-P", unquote(parts.password or "")]
    if parts.scheme == "mqtts":
        args += ["--capath", "/etc/ssl/certs"]
    out = Path(tempfile.mkstemp(prefix=f"outboxpg-{prefix}-", suffix=".out")[1])
    sub = _Sub(subprocess.Popen(args, stdout=out.open("wb"), stderr=subprocess.DEVNULL), out)
    _subs[prefix] = sub
    try:
        await _until_subscribed(url, prefix, sub)
    except BaseException:
        await cleanup(url, prefix)     # mosquitto_sub stopped (by its PID) when the start fails
        raise


async def _until_subscribed(url: str, prefix: str, sub: _Sub) -> None:
    """Subscribed once a message published after the start comes back."""
    sink = _sink(url)
    await sink.start()
    try:
        connection = sink.connection
        assert connection is not None
        deadline = time.monotonic() + 20
        while not sub.ready:
            if sub.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"sink_limits/mqtt: mosquitto_sub did not subscribe (exit {sub.proc.poll()})")
            connection.send(f"{prefix}/ready", b"ready", PublishProperties([]))
            await asyncio.sleep(0.05)
            sub.read()
    finally:
        await sink.close()


async def stored(url: str, prefix: str) -> int:
    sub = _subs[prefix]
    sub.read()
    return sub.events


async def cleanup(url: str, prefix: str) -> None:
    sub = _subs.pop(prefix, None)
    if sub is None:
        return
    if sub.proc.poll() is None:
        sub.proc.send_signal(signal.SIGTERM)
        try:
            sub.proc.wait(10)
        except subprocess.TimeoutExpired:
            sub.proc.kill()
            sub.proc.wait()
    sub.out.unlink(missing_ok=True)


class _Lane:
    """Messages one after another, each once the PUBACK of the one before came: a Sender of the
    sink's connection (outboxpg.sinks.mqtt_connection), driven as the sink drives its runs."""

    def __init__(self, connection: MqttConnection, topic: str, payload: bytes, ids: Iterator[int],
                 done: Callable[[BaseException | None], None]) -> None:
        self.connection, self.topic, self.payload, self.ids, self.done = connection, topic, payload, ids, done
        self.priority = 0

    def message(self) -> tuple[str, bytes, PublishProperties] | None:
        i = next(self.ids, None)
        if i is None:
            self.done(None)
            return None
        # The properties as the sink encodes them (Content Type, the user properties).
        return self.topic, self.payload, PublishProperties([
            ("Outbox-Msg-Id", f"lim-{i}-{uuid.uuid4()}"), ("Outbox-Id", str(i)),
            ("Outbox-Event-Type", "updated"), ("Outbox-Aggregate-Type", "order"),
            ("Outbox-Aggregate-Id", str(i % INFLIGHT)), ("Outbox-Attempt", "1")])

    def acked(self, code: int, reason: str | None) -> None:
        if code >= 0x80:
            self.done(RuntimeError(f"PUBACK 0x{code:02X} {reason or ''}"))
            return
        self.connection.queue(self)

    def refused(self, exc: ValueError) -> None:
        self.done(exc)

    def lost(self, exc: ConnectionLost) -> None:
        self.done(exc)


async def run(url: str, count: int, payload: bytes) -> float:
    prefix = f"lim{uuid.uuid4().hex[:8]}"
    await prepare(url, prefix)
    sink = _sink(url)
    try:
        await sink.start()
        connection = sink.connection
        assert connection is not None
        topic = f"{prefix}/order/updated"
        ids = iter(range(1, count + 1))
        finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        lanes = min(INFLIGHT, connection.receive_maximum)
        left = [lanes]

        def done(failure: BaseException | None) -> None:
            left[0] -= 1
            if finished.done():
                return
            if failure is not None:
                finished.set_exception(failure)
            elif left[0] == 0:
                finished.set_result(None)

        senders = [_Lane(connection, topic, payload, ids, done) for _ in range(lanes)]
        t0 = time.monotonic()
        connection.queue_all(senders)
        await finished
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 60
        while await stored(url, prefix) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert await stored(url, prefix) == count, f"the subscriber received {await stored(url, prefix)} of {count}"
    finally:
        await sink.close()
        await cleanup(url, prefix)
    return count / elapsed
