"""A private mosquitto for the tests, and a subscriber that records what it receives.

``Mosquitto`` runs Debian's ``mosquitto`` binary on a free loopback port with a config file,
persistence directory and log of its own in a temp dir; it is stopped (SIGTERM: mosquitto
writes its persistence file on a clean shutdown) and started again by its own PID. Nothing
else is touched: the machine's own mosquitto service is never stopped or reconfigured.

``Subscriber`` is a paho-mqtt client (its own network thread) with a persistent session
(clean start off, session expiry of an hour) subscribed with QoS 1 before anything is
published: what the broker acknowledged to a publisher is queued for it, across a broker
restart too (persistence), and it reconnects by itself.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import paho.mqtt.client as paho
from paho.mqtt.properties import Properties

from outboxpg.embedded import free_port

__all__ = ["Mosquitto", "Received", "Subscriber", "find_mosquitto"]


def find_mosquitto() -> tuple[str | None, str]:
    """(path of the mosquitto binary, "") or (None, why there is none)."""
    found = os.environ.get("OUTBOXPG_MOSQUITTO") or shutil.which("mosquitto") \
        or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")
    if found:
        return found, ""
    return None, "mosquitto is not installed (apt-get install mosquitto)"


class Mosquitto:
    """``with Mosquitto(binary, "max_packet_size 2048") as broker: broker.url``."""

    def __init__(self, binary: str, conf: str = "", *, passwords: dict[str, str] | None = None,
                 acl: str | None = None) -> None:
        self.binary = binary
        self.port = free_port()
        self._base = Path(tempfile.mkdtemp(prefix="outboxpg-mosquitto-"))
        self.logfile = self._base / "mosquitto.log"
        self.proc: subprocess.Popen[bytes] | None = None
        lines = [f"listener {self.port} 127.0.0.1",
                 # As root, mosquitto would switch to the user "mosquitto", who cannot write here.
                 "user root" if os.geteuid() == 0 else "",
                 "persistence true", f"persistence_location {self._base}/",
                 # Unlimited queues for the subscribers' sessions: by default mosquitto drops QoS 1
                 # messages past 1000 queued for one client.
                 "max_queued_messages 0",
                 f"log_dest file {self.logfile}", "log_type error", "log_type warning", "log_type notice",
                 "log_type information"]
        if passwords is not None:
            password_file = self._base / "passwords"
            password_file.write_text("")
            for user, password in passwords.items():
                subprocess.run(["mosquitto_passwd", "-b", str(password_file), user, password], check=True,
                               capture_output=True)
            lines += ["allow_anonymous false", f"password_file {password_file}"]
        else:
            lines.append("allow_anonymous true")
        if acl is not None:
            (self._base / "acl").write_text(acl)
            lines.append(f"acl_file {self._base / 'acl'}")
        self.conf = self._base / "mosquitto.conf"
        self.conf.write_text("\n".join(line for line in lines if line) + "\n" + conf + "\n")

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    def start(self) -> Mosquitto:
        self.proc = subprocess.Popen([self.binary, "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=(self._base / "stderr.log").open("ab"))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited with {self.proc.returncode}: {self.log()[-1000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("mosquitto did not start within 20 s")

    def stop(self) -> None:
        """SIGTERM and wait: a clean shutdown, which saves the persistence file."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def log(self) -> str:
        return self.logfile.read_text(errors="replace") if self.logfile.exists() else ""

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self._base, ignore_errors=True)

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()


@dataclass(frozen=True)
class Received:
    topic: str
    payload: bytes
    properties: list[tuple[str, str]]   # the user properties, in order
    content_type: str | None
    dup: bool
    mid: int = 0

    def property(self, name: str) -> str | None:
        return next((v for k, v in self.properties if k == name), None)


class Subscriber:
    """A QoS 1 subscriber with a persistent session on ``topic``; ``received`` in arrival order."""

    def __init__(self, port: int, topic: str = "outbox/#", client_id: str | None = None) -> None:
        self.port = port
        self.topic = topic
        self.received: list[Received] = []
        self.disconnects: list[str] = []   # why the connection ended, each time
        self.connects: list[bool] = []     # each CONNACK: whether the broker had kept the session
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id or f"sub-{free_port()}",
                                  protocol=paho.MQTTv5)
        self.client.reconnect_delay_set(1, 1)
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.on_disconnect = lambda client, userdata, flags, reason, properties: self.disconnects.append(
            str(reason))

    def start(self) -> Subscriber:
        properties = Properties(paho.PacketTypes.CONNECT)
        properties.SessionExpiryInterval = 3600
        self.client.connect("127.0.0.1", self.port, keepalive=10, clean_start=False, properties=properties)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise RuntimeError("the subscriber did not get its SUBACK within 10 s")
        return self

    def _on_connect(self, client: paho.Client, userdata: object, flags: object, reason: object,
                    properties: object) -> None:
        present = bool(getattr(flags, "session_present", False))
        if not present:
            self._subscribed.clear()
            client.subscribe(self.topic, qos=1)
        self.connects.append(present)

    def subscribed_since(self, connects: int) -> bool:
        """Connected again after ``connects`` CONNACKs, with its subscription in place (the
        session kept, or subscribed anew and acknowledged)."""
        return (self.client.is_connected() and len(self.connects) > connects
                and (self.connects[-1] or self._subscribed.is_set()))

    def _on_message(self, client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        props = msg.properties
        item = Received(msg.topic, bytes(msg.payload), list(getattr(props, "UserProperty", [])),
                        getattr(props, "ContentType", None), bool(msg.dup), msg.mid)
        with self._lock:
            self.received.append(item)

    def messages(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def distinct(self) -> int:
        """How many different Outbox-Msg-Id values were received."""
        return len({m.property("Outbox-Msg-Id") for m in self.messages()})

    async def wait_for(self, n: int, timeout: float = 10.0) -> list[Received]:
        """Every message once the subscriber has ``n`` different ones (fails after ``timeout``),
        and what came in 0.1 s more (duplicates included)."""
        deadline = time.monotonic() + timeout
        while self.distinct() < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"the subscriber received {self.distinct()} of {n} messages in {timeout}s")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        return self.messages()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def __enter__(self) -> Subscriber:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
