"""One MQTT 5 connection of the MQTT sink: a paho-mqtt client driven by the asyncio loop.

paho-mqtt does the protocol (packets, properties, keepalive pings); this module gives it the
loop's reader and writer callbacks for its socket instead of a thread of its own (paho's
"external event loop" interface), and turns what it reports into futures: one per QoS 1
PUBLISH, resolved with the PUBACK's reason code, or failed with ConnectionLost the moment the
connection drops (not at a timeout). A connection is used once: after it drops, the sink opens
a new one, with a new paho client (clean start, no session: nothing is re-sent by paho behind
the sink's back; see outboxpg.sinks.mqtt on what a consumer sees).

In flight: at most the broker's Receive Maximum (CONNACK; 65535 when it names none) PUBLISHes
without their PUBACK (Slots), a slot freed only by the PUBACK or by the connection's end, never
by a caller that stopped waiting: a broker that sees more closes the connection (0x93, receive
maximum exceeded). A free slot goes to the waiting PUBLISH with the highest priority (the sink
gives the number of events its run still has to send: the longest run is a batch's critical
path, one round trip per event), first come first served among equals.
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
from collections.abc import Callable
from typing import Any
from uuid import uuid4

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from outboxpg.sinks.mqtt_messages import MQTT_MAX_PACKET

__all__ = ["ConnectionLost", "MqttConnection", "MqttRefused", "MqttUnreachable", "PubAck"]

log = logging.getLogger("outboxpg.mqtt")

PubAck = tuple[int, str | None]   # the PUBACK's reason code and its reason string, if any

# CONNACK reason codes that say the broker does not speak MQTT 5: 0x84 (an MQTT 5 broker's
# "unsupported protocol version"), 0x01 (an MQTT 3.1.1 broker's "unacceptable protocol level").
_NOT_MQTT5 = {0x84, 0x01}

_QUICKACK: int = getattr(socket, "TCP_QUICKACK", 0)   # Linux only; see MqttConnection._ack_now


class MqttUnreachable(Exception):
    """No connection: the broker cannot be reached, does not answer as an MQTT broker, or refuses
    the login (one line, no credentials)."""


class MqttRefused(Exception):
    """Connected, but the broker cannot take what the sink sends (it does not speak MQTT 5, or
    takes no QoS 1 message)."""


class ConnectionLost(ConnectionError):
    """The connection dropped (or was closed) before the PUBACK came."""


class Slots:
    """A counting semaphore whose waiters are served by priority (highest first), then in order."""

    def __init__(self, n: int) -> None:
        self.free = n
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self, priority: int = 0) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (-priority, next(self._order), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()   # handed a slot, but cancelled before taking it: pass it on
            raise

    def release(self) -> None:
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():   # a waiter cancelled meanwhile is skipped
                future.set_result(None)
                return
        self.free += 1


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
        self._inflight: dict[int, asyncio.Future[PubAck]] = {}
        self._slots = Slots(self.receive_maximum)
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
        self._slots = Slots(self.receive_maximum)

    async def send(self, topic: str, payload: bytes, properties: Properties,
                   priority: int = 0) -> asyncio.Future[PubAck]:
        """Send a QoS 1 PUBLISH once a slot of the broker's Receive Maximum is free (``priority``:
        see Slots); the future of its PUBACK. ConnectionLost when the connection is gone.
        Cancelling the future stops waiting, nothing more (the slot stays taken until the PUBACK
        or the connection's end)."""
        await self._slots.acquire(priority)
        if self.lost is not None:
            self._slots.release()
            raise self.lost
        try:
            info = self.client.publish(topic, payload, qos=1, properties=properties)
        except BaseException:
            self._slots.release()
            raise
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            self._slots.release()
            raise self.lost or ConnectionLost(f"cannot publish to the MQTT broker: {paho.error_string(info.rc)}")
        future: asyncio.Future[PubAck] = self._loop.create_future()
        self._inflight[info.mid] = future
        if len(self._inflight) > self.peak_in_flight:
            self.peak_in_flight = len(self._inflight)
        return future

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
        future = self._inflight.pop(mid, None)
        if future is None:
            return
        self._slots.release()
        if not future.done():
            said = getattr(properties, "ReasonString", None) if properties is not None else None
            future.set_result((int(reason.value), said))

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
        for future in inflight.values():
            self._slots.release()
            if not future.done():
                future.set_exception(self.lost)
                future.exception()      # retrieved here: a caller that stopped waiting never will
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
            self._loop.add_writer(sock.fileno(), self._writable)

    def _on_unregister_write(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        self._call(self._done_writing, sock)

    def _done_writing(self, sock: Any) -> None:
        if sock is self._sock and sock.fileno() >= 0:
            self._loop.remove_writer(sock.fileno())

    def _readable(self) -> None:
        client = self.client
        try:
            while True:
                client.loop_read()
                # A TLS socket may hold decrypted bytes that select() does not see.
                sock = self._sock
                if sock is None or not hasattr(sock, "pending") or sock.pending() <= 0:
                    break
        except Exception as exc:  # noqa: BLE001 - anything paho raises while reading means the connection is over
            self._end(ConnectionLost(f"the connection to the MQTT broker failed: {_os_error(exc)}"))
            self._close_socket()
            return
        self._ack_now()

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


def _os_error(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout | TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
