"""The MQTT sink: ``outboxpg-worker --sink mqtt://[user:password@]host[:1883]`` (``mqtts://``, port
8883, for TLS), MQTT 5 through paho-mqtt (extra ``mqtt``).

Each event is one QoS 1 PUBLISH, not retained:

- topic: the event's subject with every ``.`` made a level separator ``/`` (``outbox.order.paid``
  is published to ``outbox/order/paid``; a ``/`` inside a subject stays a separator);
- payload: the event's JSON as stored; property Content Type ``application/json``;
- user properties (MQTT 5): ``Outbox-Msg-Id`` (the event's msg_id: MQTT has no message id that
  outlives a connection, so this is the id a consumer deduplicates on), ``Outbox-Id``,
  ``Outbox-Event-Type``, ``Outbox-Aggregate-Type``, ``Outbox-Aggregate-Id``, ``Outbox-Attempt``,
  then the row's headers (less any named like one of those, in any case);
- no Message Expiry Interval: a claimed event does not carry its ``expires_at`` (the claim itself
  never hands out an event past it), so a message queued for an offline subscriber waits there
  until the broker drops it by its own rules.

MQTT 5 only. The broker must speak MQTT 5 (mosquitto 2 does): MQTT 3.1.1 has no user properties
to carry the msg_id and headers, and no reason code in its PUBACK, so a broker that drops a
message it refuses would still acknowledge it (mosquitto 2.0 does, over its message_size_limit).
``start()`` fails with SinkRefused (exit 5) for a broker that answers the MQTT 5 CONNECT with
"unsupported protocol version", or that takes no QoS 1 message (CONNACK Maximum QoS 0).

Published means acknowledged: an event is reported published only once the broker's PUBACK for
it came with a reason code below 0x80: 0x00 success, or 0x10 "no matching subscribers" (the
broker took the message and gave it to nobody: MQTT keeps nothing for a topic no one subscribes
to; the sink counts them in ``no_subscribers`` and logs the first per topic). What a PUBACK
guarantees is the broker's: it received the message and handed it to the subscriptions that
matched at that moment, the persistent sessions of disconnected subscribers included. It does
not say that any subscriber received it, nor that it is on disk: mosquitto writes its
persistence file on a timer (autosave_interval) and at a clean shutdown, so a broker that
crashes loses what it acknowledged since its last save, and it drops QoS 1 messages for a
session whose queue is full (max_queued_messages, 1000 by default). Consumers that must see
every event subscribe with QoS 1 and a persistent session (clean start off, a session expiry
interval), before the worker starts, and the broker is configured for it.

A PUBACK of 0x80 or more: 0x87 not authorized, 0x90 topic name invalid, 0x95 packet too large
and 0x99 payload format invalid are a PermanentError (dead-lettered at once, with the code and
the broker's reason string); any other (0x80 unspecified, 0x83 implementation specific, 0x97
quota exceeded, ...) is retried with backoff. Mosquitto 2.0 closes the connection right after a
0x87 (a topic its access list denies): the events in flight beside it fail as a lost connection
and are retried, and when PUBLISHes it had not read yet turn that close into a reset, the
PUBACK itself can be lost, and the denied event is retried until a PUBACK says 0x87.

Never sendable (PermanentError, checked before anything is sent): an empty subject, a topic
with ``+`` or ``#`` or starting with ``$``, a topic or a user property longer than 65535 bytes or
holding a character mosquitto refuses (U+0000, control characters such as a line break,
non-characters: mosquitto would close the connection, failing every other event in flight on
it), a PUBLISH over the broker's Maximum Packet Size (its CONNACK's; mosquitto's
``max_packet_size``), or over ``?max_packet_size=`` when that is lower. Mosquitto does not
announce its ``message_size_limit`` and closes the connection of a client that exceeds it:
set ``max_packet_size`` on the broker, or the sink's option to a matching value, to have such
events dead-lettered instead of retried until dead.

Order per aggregate: an aggregate's events are published one after another, each once the
broker acknowledged the one before it (at most one unacknowledged message of an aggregate in
flight); different aggregates go concurrently, up to the broker's Receive Maximum (its CONNACK's;
mosquitto's default is 20) unacknowledged PUBLISHes on the connection, all the worker's batches
together, a free slot going to the run with the most events left (it sets how long its batch
takes: one round trip per event). So event k+1 reaches the broker only after the broker took k, whatever happens to the
connection, and a subscriber whose one subscription matches an aggregate's topics (``outbox/#``)
receives them in order. Shared subscriptions (``$share/...``) spread one topic's messages over
their members and keep no order between them.

Connection. One connection, clean start and no session, with a client id of ``?client_id=``
(default ``outboxpg-<random>``: each worker needs its own; a second client with the same id
makes the broker close the first). When it drops, every event waiting for its PUBACK fails (an
ordinary failure, retried with backoff), the rest of their runs are ``NotSent``, and the sink
connects again, in the background (every 0.5 s doubling to 5 s) or for the next batch, whichever
comes first; meanwhile ``health_problem()`` (the worker's /readyz) says why it is not connected.
A message whose PUBACK was lost may have reached the broker: the retry publishes it again, so a
consumer can see an event twice, in order (k, k, k+1: never k+1 before k), each copy with the
same ``Outbox-Msg-Id``; it drops the second by that id. A consumer with a persistent session can
also get a message again after its own reconnect (MQTT's DUP redelivery), the same way. A batch
waits at most ``publish_timeout`` seconds: an event whose PUBACK has not come by then fails with
a TimeoutError.

Options (the URL's query, or --sink-option): ``qos`` (1, the only one: QoS 0 has no
acknowledgement, and paho-mqtt ignores the reason code of a QoS 2 PUBREC, so a refused QoS 2
message would count as published), ``client_id``, ``keepalive`` (seconds, 30),
``max_packet_size`` (bytes), ``ca_file`` (mqtts://: a PEM file of the CAs to trust instead of
the system's). ``--ensure-sink`` has nothing to declare: a topic exists by being published to.
``start()``: SinkUnreachable (exit 3) for a broker that cannot be reached, is not an MQTT broker,
or refuses the login (mosquitto 2.0 answers a wrong password with 0x87 not authorized).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

from paho.mqtt.properties import Properties

from outboxpg.events import OutboxEvent, runs_of
from outboxpg.relay.publishers import NotSent, PermanentError, not_sent_after
from outboxpg.sinks.base import SinkRefused, SinkSettings, SinkUnreachable, url_options, without_credentials
from outboxpg.sinks.mqtt_connection import ConnectionLost, MqttConnection, MqttRefused, MqttUnreachable
from outboxpg.sinks.mqtt_messages import NO_MATCHING_SUBSCRIBERS, message_of, puback_outcome
from outboxpg.text import describe

__all__ = ["MqttSink", "open_sink"]

log = logging.getLogger("outboxpg.mqtt")

OPTIONS = ("qos", "client_id", "keepalive", "max_packet_size", "ca_file")
_LOGGED_TOPICS = 100   # topics whose first "no matching subscribers" is logged, at most


def open_sink(settings: SinkSettings) -> MqttSink:
    return MqttSink(settings)


class MqttSink:
    """MQTT 5, QoS 1, in order per aggregate (the module's docstring says how)."""

    run_publishing = "sequential-pubacks"   # the worker logs it at start

    def __init__(self, settings: SinkSettings) -> None:
        url = settings.url.strip()
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("mqtt", "mqtts"):
            raise ValueError(f"--sink {without_credentials(url)}: not an mqtt:// or mqtts:// URL")
        try:
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ValueError(f"--sink {without_credentials(url)}: {exc}") from None
        if not host:
            raise ValueError(f"--sink {without_credentials(url)}: no broker host")
        if parts.path not in ("", "/"):
            raise ValueError(f"--sink {without_credentials(url)}: an MQTT URL has no path (topics come from "
                             "the events' subjects)")
        options = url_options(url, settings.options)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"--sink {scheme}://: unknown option {unknown[0]!r}; the MQTT sink takes "
                             f"{', '.join(OPTIONS)}")
        if options.get("qos", "1") != "1":
            raise ValueError(f"--sink {scheme}://: qos={options['qos']} is not supported: the MQTT sink publishes "
                             "with QoS 1 (QoS 0 has no acknowledgement; a QoS 2 refusal would go unseen)")
        self.keepalive = _int_option(options, "keepalive", 30, 5, 65535)
        self.max_packet_size = _int_option(options, "max_packet_size", 0, 1, 268_435_460)
        self.client_id = options.get("client_id") or None
        ca_file = options.get("ca_file") or None
        if ca_file and scheme != "mqtts":
            raise ValueError("--sink mqtt://: ca_file is for mqtts:// (TLS)")
        self.tls: ssl.SSLContext | None = None
        if scheme == "mqtts":
            try:
                self.tls = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"--sink mqtts://: ca_file {ca_file!r}: {describe(exc)}") from None
        self.host = host
        self.port = port or (8883 if scheme == "mqtts" else 1883)
        self.username = unquote(parts.username) if parts.username is not None else None
        self.password = unquote(parts.password) if parts.password is not None else None
        self.url = url
        self.timeout = settings.publish_timeout
        self.connection: MqttConnection | None = None
        self.connections = 0        # connections made so far (the first one included)
        self.no_subscribers = 0     # events the broker acknowledged with 0x10: it gave them to nobody
        self._unheard: set[str] = set()
        self._connecting = asyncio.Lock()
        self._closed = False
        self._reconnecting: asyncio.Task[None] | None = None
        self._last_failure = ""

    def describe(self) -> str:
        return without_credentials(self.url)

    @property
    def closed(self) -> bool:
        return self._closed

    async def start(self) -> None:
        """Connect: SinkUnreachable (the broker cannot be reached, is not one, refuses the login),
        SinkRefused (it does not speak MQTT 5, or takes QoS 0 only)."""
        try:
            await self._connect()
        except MqttUnreachable as exc:
            raise SinkUnreachable(str(exc)) from None
        except MqttRefused as exc:
            raise SinkRefused(str(exc)) from None

    def health_problem(self) -> str | None:
        """Why the sink cannot publish now, or None (the worker's /readyz; read from another thread)."""
        connection = self.connection
        if connection is not None and connection.lost is None:
            return None
        if self._closed:
            return "the MQTT sink is closed"
        why = self._last_failure or (str(connection.lost) if connection is not None else "not connected")
        return f"no connection to the MQTT broker at {self.host}:{self.port} ({why}); connecting again"

    async def close(self) -> None:
        self._closed = True
        if self._reconnecting is not None:
            self._reconnecting.cancel()
        connection, self.connection = self.connection, None
        if connection is not None:
            await connection.close()

    def _lost(self, lost: ConnectionLost) -> None:
        """The connection ended: connect again in the background (a batch may do it first), so that
        an idle worker is ready again as soon as the broker is."""
        if self._closed:
            return
        log.warning("event=mqtt_connection_lost broker=%s:%d reason=%r", self.host, self.port, str(lost))
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        delay = 0.5
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                await self._connect()
                return
            except (MqttUnreachable, MqttRefused, ConnectionLost) as exc:
                self._last_failure = str(exc)
                delay = min(delay * 2, 5.0)

    async def _connect(self) -> MqttConnection:
        """The connection, opened again if it dropped (one opening at a time)."""
        async with self._connecting:
            connection = self.connection
            if connection is not None and connection.lost is None:
                return connection
            if self._closed:
                raise ConnectionLost("the MQTT sink is closed")
            connection = MqttConnection(self.host, self.port, username=self.username, password=self.password,
                                        tls=self.tls, client_id=self.client_id, keepalive=self.keepalive)
            try:
                await connection.connect(self.timeout)
            except (MqttUnreachable, MqttRefused) as exc:
                self._last_failure = str(exc)
                raise
            self._last_failure = ""
            connection.on_lost = self._lost
            self.connection = connection
            self.connections += 1
            log.info("event=mqtt_connected broker=%s client_id=%s receive_maximum=%d maximum_packet_size=%d",
                     connection.target, connection.client_id, connection.receive_maximum, connection.max_packet)
            return connection

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        """One outcome per event: each run (an aggregate's events) one PUBLISH at a time, each
        after the PUBACK of the one before; the runs concurrently. Within ``publish_timeout``."""
        outcomes: list[BaseException | None] = [None] * len(events)
        runs = runs_of(events)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            async with asyncio.timeout_at(deadline):
                connection = await self._connect()
        except (TimeoutError, MqttUnreachable, MqttRefused, ConnectionLost) as exc:
            failure = ConnectionLost(str(exc) or f"could not connect to the MQTT broker within {self.timeout:g}s")
            for run in runs:
                outcomes[run[0]] = failure
                not_sent_after(events, run[1:], events[run[0]].id, outcomes)
            return outcomes
        limit = connection.max_packet
        if self.max_packet_size:
            limit = min(limit, self.max_packet_size)
        batch = _Batch(self, connection, events, outcomes, limit, loop.create_future())
        publishing = [_Run(batch, run) for run in runs]
        batch.open = len(publishing)
        connection.queue_all(publishing)
        try:
            if batch.open:
                async with asyncio.timeout_at(deadline):
                    await batch.done
        except TimeoutError:
            pass
        finally:
            # Out of time (or the worker is stopping): the event waiting for its PUBACK failed,
            # the rest of its run was not sent; a run still in line sent nothing more.
            for left in publishing:
                if not left.finished:
                    left.finish(TimeoutError(f"no PUBACK from the MQTT broker within {self.timeout:g}s")
                                if left.waiting else NotSent("not sent: the batch ran out of time first"))
        return outcomes

    def _unheard_of(self, topic: str) -> None:
        self.no_subscribers += 1
        if topic not in self._unheard and len(self._unheard) < _LOGGED_TOPICS:
            self._unheard.add(topic)
            log.warning("event=mqtt_no_subscribers topic=%r note=%r", topic,
                        "the broker acknowledged the message and gave it to nobody (no subscription matches)")


class _Batch:
    """What the runs of one publish_batch share: the events, their outcomes, the runs not
    finished yet (``open``) and the future set when none is left."""

    __slots__ = ("sink", "connection", "events", "outcomes", "limit", "done", "open")

    def __init__(self, sink: MqttSink, connection: MqttConnection, events: Sequence[OutboxEvent],
                 outcomes: list[BaseException | None], limit: int, done: asyncio.Future[None]) -> None:
        self.sink, self.connection, self.events, self.outcomes = sink, connection, events, outcomes
        self.limit, self.done, self.open = limit, done, 0


class _Run:
    """One aggregate's events of a batch, as a Sender of MqttConnection: event n+1 is handed out
    only after the PUBACK of event n said it was taken; the first failure ends the run (that
    event gets it, the rest NotSent)."""

    __slots__ = ("batch", "positions", "n", "priority", "waiting", "finished", "topic")

    def __init__(self, batch: _Batch, positions: list[int]) -> None:
        self.batch, self.positions = batch, positions
        self.n = 0                      # the event being published, or next to be
        self.priority = len(positions)  # events left: the run with the most goes first (the batch's critical path)
        self.waiting = False            # its PUBLISH is out, the PUBACK not in
        self.finished = False
        self.topic = ""

    def message(self) -> tuple[str, bytes, Properties] | None:
        if self.finished:
            return None
        event = self.batch.events[self.positions[self.n]]
        message = message_of(event, self.batch.limit)
        if isinstance(message, PermanentError):
            self.finish(message)
            return None
        self.waiting, self.topic = True, message.topic
        return message.topic, event.payload, message.properties

    def acked(self, code: int, reason: str | None) -> None:
        if self.finished:
            return   # the batch stopped waiting for it (out of time)
        self.waiting = False
        outcome = puback_outcome(code, reason)
        if code == NO_MATCHING_SUBSCRIBERS:
            self.batch.sink._unheard_of(self.topic)
        if outcome is not None:
            self.finish(outcome)
            return
        self.n += 1
        if self.n == len(self.positions):
            self.finish(None)
            return
        self.priority = len(self.positions) - self.n
        self.batch.connection.queue(self)

    def refused(self, exc: ValueError) -> None:
        self.finish(PermanentError(f"paho-mqtt refused the message: {describe(exc)}"))

    def lost(self, exc: ConnectionLost) -> None:
        self.finish(exc)

    def finish(self, outcome: BaseException | None) -> None:
        """The run is over: ``outcome`` for its event n (None: every event was published)."""
        if self.finished:
            return
        self.finished, self.waiting = True, False
        batch = self.batch
        if outcome is not None:
            i = self.positions[self.n]
            batch.outcomes[i] = outcome
            not_sent_after(batch.events, self.positions[self.n + 1:], batch.events[i].id, batch.outcomes)
        batch.open -= 1
        if batch.open == 0 and not batch.done.done():
            batch.done.set_result(None)


def _int_option(options: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    text = options.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ValueError(f"--sink mqtt://: {name}={text!r} is not a whole number from {low} to {high}")
    return value
