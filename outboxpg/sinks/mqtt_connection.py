"""One MQTT 5 connection of the MQTT sink: a paho-mqtt client driven by the asyncio loop.

paho-mqtt does the protocol (packets, properties, keepalive pings); this module gives it the
loop's reader and writer callbacks for its socket instead of a thread of its own (paho's
"external event loop" interface), and turns what it reports into futures: one per QoS 1
PUBLISH, resolved with the PUBACK's reason code, or failed with ConnectionLost the moment the
connection drops (not at a timeout). A connection is used once: after it drops, the sink opens
a new one, with a new paho client (clean start, no session: nothing is re-sent by paho behind
the sink's back; see outboxpg.sinks.mqtt on what a consumer sees).

What is published comes from senders (``Sender``: the sink's runs, one message at a time, the
next one only after the PUBACK of the one before): ``queue(sender)`` puts a sender in line, and
its next message goes out once a slot is free. In flight: at most the broker's Receive Maximum
(CONNACK; 65535 when it names none) PUBLISHes without their PUBACK, a slot freed only by the
PUBACK or by the connection's end, never by a sender that stopped waiting: a broker that sees
more closes the connection (0x93, receive maximum exceeded). A free slot goes to the sender in
line with the highest ``priority`` (the sink gives the number of events its run still has to
send: the longest run is a batch's critical path, one round trip per event), first come first
served among equals. The PUBLISHes are made from the loop's callbacks (the PUBACKs of one read
first, then as many PUBLISHes as slots came free), with no task or future per message: at some
twenty thousand messages a second, the loop's wakeups of a task per message were a large part
of the sink's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol
from uuid import uuid4

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from outboxpg.sinks.mqtt_messages import MQTT_MAX_PACKET

__all__ = ["ConnectionLost", "MqttConnection", "MqttRefused", "MqttUnreachable", "PubAck", "Sender"]

log = logging.getLogger("outboxpg.mqtt")

PubAck = tuple[int, str | None]   # the PUBACK's reason code and its reason string, if any

# CONNACK reason codes that say the broker does not speak MQTT 5: 0x84 (an MQTT 5 broker's
# "unsupported protocol version"), 0x01 (an MQTT 3.1.1 broker's "unacceptable protocol level").
_NOT_MQTT5 = {0x84, 0x01}

_QUICKACK: int = getattr(socket, "TCP_QUICKACK", 0)   # Linux only; see MqttConnection._ack_now
_READS_PER_WAKEUP = 64   # loop_read() calls at most, before the loop's other callbacks get a turn


class MqttUnreachable(Exception):
    """No connection: the broker cannot be reached, does not answer as an MQTT broker, or refuses
    the login (one line, no credentials)."""


class MqttRefused(Exception):
    """Connected, but the broker cannot take what the sink sends (it does not speak MQTT 5, or
    takes no QoS 1 message)."""


class ConnectionLost(ConnectionError):
    """The connection dropped (or was closed) before the PUBACK came."""


class Sender(Protocol):
    """What MqttConnection.queue() takes: a source of PUBLISHes, one at a time. Its methods are
    called in the loop's thread and must not block; ``acked`` may queue the sender again (its
    next message), the others end it."""

    priority: int   # read when it is queued: the higher, the sooner it gets a free slot

    def message(self) -> tuple[str, bytes, Properties] | None:
        """Its next PUBLISH (topic, payload, properties), now that it has a slot; None: nothing
        to send after all (it finished meanwhile), the slot goes to the next in line."""

    def acked(self, code: int, reason: str | None) -> None:
        """The PUBACK of the message it gave last (its reason code, its reason string)."""

    def refused(self, exc: ValueError) -> None:
        """paho-mqtt refused the message it gave last (nothing was sent)."""

    def lost(self, exc: ConnectionLost) -> None:
        """The connection ended before the PUBACK of its message, or before it was sent."""


class _One:
    """A single PUBLISH whose PUBACK is a future (MqttConnection.send)."""

    def __init__(self, topic: str, payload: bytes, properties: Properties, priority: int,
                 future: asyncio.Future[PubAck]) -> None:
        self.topic, self.payload, self.properties, self.priority = topic, payload, properties, priority
        self.future = future

    def message(self) -> tuple[str, bytes, Properties] | None:
        return None if self.future.done() else (self.topic, self.payload, self.properties)

    def acked(self, code: int, reason: str | None) -> None:
        if not self.future.done():
            self.future.set_result((code, reason))

    def refused(self, exc: ValueError) -> None:
        self._fail(exc)

    def lost(self, exc: ConnectionLost) -> None:
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)
            self.future.exception()   # retrieved here: a caller that stopped waiting never will


class MqttConnection:
    """One connection; ``await connect(timeout)``, then ``send`` as often as wanted, ``close()``.

    ``receive_maximum`` and ``max_packet`` are the broker's, from its CONNACK."""

    def __init__(self, host: str, port: int, *, username: str | None = None, password: str | None = None,
                 tls: ssl.SSLContext | None = None, client_id: str | None = None, keepalive: int = 30) -> None:
        self.host, self.port = host, port
        self.client_id = client_id or f"outboxpg-{uuid4().hex[:16]}"
        self.keepalive = keepalive
        self.receive_maximum = 65535
        self.max_packet = MQTT_MAX_PACKET
        self.lost: ConnectionLost | None = None   # set once the connection has ended
        self.peak_in_flight = 0   # the most PUBLISHes awaiting their PUBACK at once
        self.on_lost: Callable[[ConnectionLost], None] | None = None   # called once, when the connection ends
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._connack: asyncio.Future[tuple[ReasonCode, Properties | None]] = self._loop.create_future()
        self._inflight: dict[int, Sender] = {}        # by packet identifier: the PUBLISHes awaiting their PUBACK
        self._line: list[tuple[int, int, Sender]] = []   # a heap of (-priority, arrival, sender)
        self._arrival = itertools.count()
        self._free = 0              # slots: the Receive Maximum less what is in flight (0 until the CONNACK)
        self._holding = False       # reading or publishing: queue() leaves the publishing to it
        self._write_after = False   # paho asked to write while _holding: _publish() writes at its end
        self._sock: Any = None
        self._misc: asyncio.Task[None] | None = None
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id,
                             protocol=MQTTProtocolVersion.MQTTv5, reconnect_on_failure=False)
        # No queue in paho (it would hold back what it sends past its own limit of 20): the
        # semaphore of the broker's Receive Maximum is the only limit.
        client.max_inflight_messages_set(0)
        if username is not None:
            client.username_pw_set(username, password)
        if tls is not None:
            client.tls_set_context(tls)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write
        self.client = client

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    async def connect(self, timeout: float) -> None:
        """Connect and wait for the CONNACK, within ``timeout`` seconds. MqttUnreachable,
        MqttRefused (both one line) when that fails; the connection is closed then."""
        self.client.connect_timeout = timeout
        try:
            async with asyncio.timeout(timeout):
                try:
                    # paho opens the socket (and the TLS session) blocking: in a thread.
                    await asyncio.to_thread(self.client.connect, self.host, self.port, self.keepalive,
                                            clean_start=True)
                except (OSError, ValueError) as exc:
                    raise MqttUnreachable(f"cannot connect to the MQTT broker at {self.target}: "
                                          f"{_os_error(exc)}") from None
                code, properties = await self._connack
        except TimeoutError:
            await self.close()
            raise MqttUnreachable(f"no MQTT CONNACK from {self.target} within {timeout:g}s "
                                  "(is it an MQTT broker?)") from None
        except ConnectionLost as exc:
            await self.close()
            raise MqttUnreachable(f"the connection to {self.target} closed before the MQTT CONNACK ({exc}): "
                                  "is it an MQTT broker?") from None
        except BaseException:
            await self.close()
            raise
        value = int(code.value)
        if value in _NOT_MQTT5:
            await self.close()
            raise MqttRefused(f"the MQTT broker at {self.target} does not speak MQTT 5 (CONNACK 0x{value:02X}); "
                              "the MQTT sink needs it (user properties, PUBACK reason codes)")
        if value >= 0x80:
            await self.close()
            raise MqttUnreachable(f"the MQTT broker at {self.target} refused the connection: {code.getName()} "
                                  f"(0x{value:02X})")
        if properties is not None:
            self.receive_maximum = int(getattr(properties, "ReceiveMaximum", 65535))
            self.max_packet = int(getattr(properties, "MaximumPacketSize", MQTT_MAX_PACKET))
            if int(getattr(properties, "MaximumQoS", 1)) < 1:
                await self.close()
                raise MqttRefused(f"the MQTT broker at {self.target} takes QoS 0 messages only (CONNACK "
                                  "Maximum QoS 0): nothing would say a message was received")
        self._free = self.receive_maximum
        self._publish()

    def queue(self, sender: Sender) -> None:
        """Put ``sender`` in line: its next message goes out once a slot is free (at once when
        one is). When the connection has ended, ``sender.lost`` is called at once instead."""
        if self.lost is not None:
            sender.lost(self.lost)
            return
        heapq.heappush(self._line, (-sender.priority, next(self._arrival), sender))
        if not self._holding:
            self._publish()

    def queue_all(self, senders: Sequence[Sender]) -> None:
        """queue() each of them, then publish: the first free slots go to the highest priority
        among them all, not to whichever came first."""
        holding, self._holding = self._holding, True
        try:
            for sender in senders:
                self.queue(sender)
        finally:
            self._holding = holding
        if not holding:
            self._publish()

    def send(self, topic: str, payload: bytes, properties: Properties, priority: int = 0) -> asyncio.Future[PubAck]:
        """One QoS 1 PUBLISH, sent once a slot is free: the future of its PUBACK, failed with
        ConnectionLost when the connection ends first, or with the ValueError of paho-mqtt
        refusing the message. Cancelling the future stops waiting, nothing more (the slot stays
        taken until the PUBACK or the connection's end)."""
        future: asyncio.Future[PubAck] = self._loop.create_future()
        self.queue(_One(topic, payload, properties, priority, future))
        return future

    def _publish(self) -> None:
        """Hand paho a PUBLISH for each free slot, to the senders in line by priority."""
        if self._holding:
            return
        self._holding = True
        try:
            line, client = self._line, self.client
            while self._free > 0 and line and self.lost is None:
                sender = heapq.heappop(line)[2]
                message = sender.message()
                if message is None:
                    continue
                topic, payload, properties = message
                try:
                    info = client.publish(topic, payload, qos=1, properties=properties)
                except ValueError as exc:   # a topic or payload paho-mqtt refuses: nothing was sent
                    sender.refused(exc)
                    continue
                if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    sender.lost(self.lost or ConnectionLost(f"cannot publish to the MQTT broker: "
                                                            f"{paho.error_string(info.rc)}"))
                    continue
                self._free -= 1
                self._inflight[info.mid] = sender
                if len(self._inflight) > self.peak_in_flight:
                    self.peak_in_flight = len(self._inflight)
        finally:
            self._holding = False
        if self._write_after:
            self._write_after = False
            self._write_now()

    def _write_now(self) -> None:
        """Write what paho queued, now, rather than from the loop's writer callback on its next
        turn (two epoll_ctl calls and a loop iteration per burst saved); the writer callback
        only for what the socket's buffer does not take."""
        if self._sock is None:
            return
        self._writable()
        sock = self._sock
        if sock is not None and self.client.want_write():
            # paho asked for the writer already (and does not ask twice): add it here.
            self._loop.add_writer(sock.fileno(), self._writable)

    async def close(self) -> None:
        """Say DISCONNECT (when connected) and close the socket; every PUBLISH still waiting fails."""
        if self._sock is not None and self.lost is None and self._connack.done():
            with contextlib.suppress(Exception):
                self.client.disconnect()
                for _ in range(20):   # the DISCONNECT written and the socket closed by paho, briefly
                    if self._sock is None:
                        break
                    await asyncio.sleep(0.01)
        self._end(ConnectionLost("the MQTT connection was closed"))
        self._close_socket()

    # -- paho's callbacks (in the loop's thread, except those paho calls while connecting) ---------

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        if threading.get_ident() == self._loop_thread:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _on_connect(self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode,
                    properties: Properties | None) -> None:
        if not self._connack.done():
            self._connack.set_result((reason, properties))

    def _on_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason: ReasonCode,
                       properties: Properties | None) -> None:
        text = reason.getName() if isinstance(reason, ReasonCode) else str(reason)
        said = getattr(properties, "ReasonString", None) if properties is not None else None
        if flags is not None and getattr(flags, "is_disconnect_packet_from_server", False):
            why = f"the MQTT broker closed the connection: {text}" + (f" ({said})" if said else "")
        else:
            why = f"the connection to the MQTT broker was lost ({text})"
        self._call(self._end, ConnectionLost(why))

    def _on_publish(self, client: paho.Client, userdata: Any, mid: int, reason: ReasonCode,
                    properties: Properties | None) -> None:
        sender = self._inflight.pop(mid, None)
        if sender is None:
            return
        self._free += 1
        said = getattr(properties, "ReasonString", None) if properties is not None else None
        sender.acked(int(reason.value), said)

    def _end(self, lost: ConnectionLost) -> None:
        """The connection is over: fail the CONNACK's wait and every PUBLISH still waiting."""
        if self.lost is None:
            self.lost = lost
            if self.on_lost is not None:
                self.on_lost(lost)
        if not self._connack.done():
            self._connack.set_exception(self.lost)
            self._connack.exception()   # retrieved: connect() may have stopped waiting
        inflight, self._inflight = self._inflight, {}
        line, self._line = self._line, []
        for sender in [*inflight.values(), *(entry[2] for entry in line)]:
            sender.lost(self.lost)
        if self._misc is not None:
            self._misc.cancel()

    def _on_socket_open(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self._call(self._opened, sock)

    def _opened(self, sock: Any) -> None:
        self._sock = sock
        # Small packets, each awaited: without this, Nagle's algorithm holds a PUBLISH back until
        # the broker's delayed ACK of the one before (tens of milliseconds a round).
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._loop.add_reader(sock.fileno(), self._readable)
        self._misc = self._loop.create_task(self._keepalive())

    def _on_socket_close(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self._call(self._forget_socket, sock)

    def _forget_socket(self, sock: Any) -> None:
        if sock is not self._sock:
            return
        fileno = sock.fileno()
        if fileno >= 0:
            self._loop.remove_reader(fileno)
            self._loop.remove_writer(fileno)
        self._sock = None

    def _on_register_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self._call(self._want_write, sock)

    def _want_write(self, sock: Any) -> None:
        if sock is self._sock and sock.fileno() >= 0:
            if self._holding:
                self._write_after = True   # _publish() writes it all at its end
            else:
                self._loop.add_writer(sock.fileno(), self._writable)

    def _on_unregister_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self._call(self._done_writing, sock)

    def _done_writing(self, sock: Any) -> None:
        if sock is self._sock and sock.fileno() >= 0:
            self._loop.remove_writer(sock.fileno())

    def _readable(self) -> None:
        client = self.client
        # The PUBACKs read first (their senders queue their next messages), then the PUBLISHes.
        self._holding = True
        try:
            # paho reads as many packets as it has PUBLISHes in flight, at least one: after the
            # last PUBACK, what follows it (the broker closing the connection after a refusal)
            # would wait for another wakeup, and a batch finished by that PUBACK could send its
            # successor onto the closing connection first. So: until nothing is left to read.
            for _ in range(_READS_PER_WAKEUP):
                client.loop_read()
                sock = self._sock
                if sock is None or not _more_to_read(sock):
                    break
        except Exception as exc:  # noqa: BLE001 - anything paho raises while reading means the connection is over
            self._holding = False
            self._end(ConnectionLost(f"the connection to the MQTT broker failed: {_os_error(exc)}"))
            self._close_socket()
            return
        self._holding = False
        self._ack_now()
        self._publish()

    def _ack_now(self) -> None:
        """TCP-acknowledge what was just read, now (Linux's TCP_QUICKACK, which lasts until the
        kernel's next own choice, hence after every read). A broker with Nagle's algorithm on
        (mosquitto's default, set_tcp_nodelay false) writes its next PUBACK only once the one
        before is acknowledged, and Linux delays that ACK to carry it on the client's next
        packet: when that packet waits for these PUBACKs (the rest of a run, the next batch),
        the PUBACKs come only after the delayed-ACK timer, 40 ms."""
        sock = self._sock
        if sock is None or not _QUICKACK:
            return
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)

    def _writable(self) -> None:
        try:
            self.client.loop_write()
        except Exception as exc:  # noqa: BLE001 - as in _readable
            self._end(ConnectionLost(f"the connection to the MQTT broker failed: {_os_error(exc)}"))
            self._close_socket()

    async def _keepalive(self) -> None:
        """paho's timers: PINGREQ when the connection was quiet, the end when no PINGRESP came."""
        while self.lost is None:
            await asyncio.sleep(1)
            if self.client.loop_misc() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                self._end(ConnectionLost("the MQTT broker stopped answering (keepalive)"))
                self._close_socket()
                return

    def _close_socket(self) -> None:
        sock = self._sock
        if sock is None:
            return
        self._forget_socket(sock)
        with contextlib.suppress(OSError):
            sock.close()


def _more_to_read(sock: Any) -> bool:
    """Whether ``sock`` has bytes (or its end) waiting to be read, without reading them."""
    if hasattr(sock, "pending"):
        # TLS: decrypted bytes that select() does not see (more records come as another wakeup).
        return bool(sock.pending() > 0)
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)   # b"" at the end: paho reads it as such
    except BlockingIOError:
        return False
    except OSError:
        pass   # paho's next read meets the error and ends the connection
    return True


def _os_error(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
