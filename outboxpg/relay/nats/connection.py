"""The NATS client of a NatsPublisher: which servers, connecting with retries, one reply inbox
for every ack, and a new client when nats-py has closed one for good.

Servers: ``url`` is one URL or a comma-separated list (or a list) of them, ``nats://``,
``tls://``, ``ws://`` or ``wss://``; ``parse_servers`` checks them and says in one line what is
wrong with a malformed one.

One inbox for every ack: a publish's reply subject is ``<inbox>.<token>``, the token a counter
value (outboxpg.relay.nats.runs); nats-py renews the subscription after a reconnect, and an ack
lost meanwhile times out like any other.

A client nats-py has closed for good (any -ERR from the server but a few, a close from outside)
is replaced: the publishes waiting for an answer fail at once (ordinary failures), ``ready`` is
cleared until a new client is connected (the worker claims nothing meanwhile), and the new one
is connected with the same retries as at start.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from outboxpg.relay.backoff import next_delay
from outboxpg.text import describe

__all__ = ["NatsConnection", "parse_servers", "server_version", "supports_atomic_batch"]

log = logging.getLogger("outboxpg.nats")

# Atomic batch publish (ADR-50): the smallest server version that has it.
_ATOMIC_SINCE = (2, 12)


class NatsConnection:
    """The current nats-py client (``nc``, ``js``) and its reply inbox. ``on_reply(msg)`` gets
    every answer on the inbox; ``on_lost()`` is called when nats-py closed the client for good,
    before a new one is connected: the publishes waiting for an answer will get none."""

    def __init__(self, servers: list[str], *, max_pending: int, on_reply: Callable[[Msg], Awaitable[None]],
                 on_lost: Callable[[], None]) -> None:
        self.servers = servers
        self.url = ",".join(servers)   # for log lines
        self.max_pending = max_pending   # publish_async's limit on the JetStreamContext (js), for callers that use it
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.reply_prefix = ""
        self.reply_prefix_len = 0
        self.version: tuple[int, int, int] | None = None
        self.atomic_server = False     # the connected server has atomic batch publish (2.12+)
        # Cleared while a client that nats-py closed for good is being replaced; the worker
        # claims only while it is set.
        self.ready = asyncio.Event()
        self.ready.set()
        self.replacements = 0          # clients replaced after nats-py closed them for good
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._closing = False
        self._generation = 0           # which client's closed callback counts
        self._replacing: asyncio.Task[None] | None = None

    async def connect(self, deadline: float | None) -> None:
        """Connect, retrying until ``deadline`` seconds have passed (None: forever)."""
        delay = 0.2
        loop = asyncio.get_running_loop()
        give_up = None if deadline is None else loop.time() + deadline
        generation = self._generation + 1
        while True:
            try:
                nc = await nats.connect(
                    self.servers, connect_timeout=2, allow_reconnect=True, max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5, name="outboxpg-worker",
                    disconnected_cb=self._on_disconnected, reconnected_cb=self._on_reconnected,
                    error_cb=self._on_error, closed_cb=functools.partial(self._on_closed, generation))
                break
            except Exception as exc:  # noqa: BLE001 - report and retry any connect failure
                if give_up is not None and loop.time() + delay > give_up:
                    raise
                log.warning("event=nats_connect_failed url=%s error=%r retry_in=%.1fs", self.url, str(exc), delay)
                await asyncio.sleep(delay)
                delay = next_delay(delay)
        self.nc, self._generation = nc, generation
        self.js = nc.jetstream(publish_async_max_pending=self.max_pending)
        self.reply_prefix = nc.new_inbox() + "."
        self.reply_prefix_len = len(self.reply_prefix)
        await nc.subscribe(self.reply_prefix + "*", cb=self._on_reply)
        self.version = server_version(nc)
        self.atomic_server = supports_atomic_batch(nc)
        self.ready.set()

    async def _on_closed(self, generation: int) -> None:
        """nats-py closed a client for good (an -ERR from the server, or a close from outside).
        Not by close() (shutdown), and only the current client: replace it."""
        if self._closing or generation != self._generation:
            return
        self.ready.clear()
        error = getattr(self.nc, "last_error", None)
        log.warning("event=nats_closed url=%s error=%r note=%r", self.url,
                    describe(error, whole=True) if error else None,
                    "nats-py closed the client for good: connecting a new one")
        # Their answers can only come to the closed client: fail them now rather than at the timeout.
        self._on_lost()
        if self._replacing is None or self._replacing.done():
            self._replacing = asyncio.ensure_future(self._replace())

    @property
    def closed(self) -> bool:
        """close() was called: this connection publishes no more."""
        return self._closing

    def problem(self) -> str | None:
        """Why nothing can be published now (not connected, reconnecting, being replaced), or
        None. Reads state only: safe from another thread (the health server's)."""
        nc = self.nc
        if self._closing:
            return f"NATS {self.url}: closed"
        if nc is None:
            return f"NATS {self.url}: not connected yet"
        if not self.ready.is_set():
            return f"NATS {self.url}: the client was closed, connecting a new one"
        if nc.is_reconnecting:
            return f"NATS {self.url}: reconnecting"
        if not nc.is_connected:
            return f"NATS {self.url}: not connected"
        return None

    async def _replace(self) -> None:
        try:
            await self.connect(None)   # retried until it works, a warning per try, as at start
        except Exception as exc:  # noqa: BLE001 - subscribing on the new client failed: try again
            log.warning("event=nats_replace_failed url=%s error=%r", self.url, str(exc))
            if not self._closing:
                await asyncio.sleep(1)
                self._replacing = asyncio.ensure_future(self._replace())
            return
        self.replacements += 1
        log.info("event=nats_replaced url=%s", self.url)

    async def _on_disconnected(self) -> None:
        if not self._closing:
            log.warning("event=nats_disconnected url=%s", self.url)

    async def _on_reconnected(self) -> None:
        log.info("event=nats_reconnected url=%s", self.url)

    async def _on_error(self, exc: Exception) -> None:
        log.debug("event=nats_error error=%r", str(exc))

    async def close(self) -> None:
        self._closing = True
        if self._replacing is not None and not self._replacing.done():
            self._replacing.cancel()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.close(), 5)
            except Exception:  # noqa: BLE001 - closing is best effort
                pass


_SCHEMES = ("nats", "tls", "ws", "wss")
_HOSTNAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")


def parse_servers(urls: str | Sequence[str]) -> list[str]:
    """The NATS servers in ``urls`` (a comma-separated list, or a list), each a URL
    ``scheme://[user:password@]host[:port]``. A ValueError says in
    one line what is wrong with a malformed one, without its password: what nats-py would retry
    forever (a list given as one URL, an unknown scheme taken for a host name...)."""
    parts = urls.split(",") if isinstance(urls, str) else list(urls)
    servers = []
    for raw in parts:
        part = raw.strip()
        shown = re.sub(r"//[^/@]*@", "//***@", part)
        if not part:
            raise ValueError("an empty server in the NATS URL list" if len(parts) > 1 else "the NATS URL is empty")
        if "://" not in part:
            raise ValueError(f"NATS URL {shown!r} has no scheme: write it as nats://host:port "
                             "(or tls://, ws://, wss://)")
        if any(c.isspace() for c in part):
            raise ValueError(f"NATS URL {shown!r} contains a space: separate several servers with commas")
        url = part
        try:
            u = urlsplit(url)
            _ = u.port   # a port that is not a number 0-65535 raises here
        except ValueError as exc:
            raise ValueError(f"malformed NATS URL {shown!r}: {exc}") from None
        if u.scheme.lower() not in _SCHEMES:
            raise ValueError(f"NATS URL {shown!r} has the scheme {u.scheme!r}: use nats://, tls://, ws:// or wss://"
                             + (" (several servers: separate the URLs with commas)" if "," in part else ""))
        host = u.hostname or ""
        try:
            valid_host = bool(ipaddress.ip_address(host)) if ":" in host else bool(_HOSTNAME.fullmatch(host))
        except ValueError:
            valid_host = False
        if not valid_host:
            raise ValueError(f"NATS URL {shown!r} has no valid host name")
        if u.path not in ("", "/") or u.query or u.fragment:
            raise ValueError(f"NATS URL {shown!r} has a path, query or fragment: a server URL is "
                             "scheme://[user:password@]host[:port]")
        servers.append(url)
    if len({u.split("://")[0].lower() in ("ws", "wss") for u in servers}) > 1:
        raise ValueError("the NATS URL list mixes websocket (ws://, wss://) and other servers: nats-py cannot")
    return servers


def server_version(nc: Client) -> tuple[int, int, int] | None:
    """The connected server's version from its INFO, or None if it cannot be read."""
    try:
        v = nc.connected_server_version
        return v.major, v.minor, v.patch
    except Exception:  # noqa: BLE001 - no INFO yet, or not a semantic version
        return None


def supports_atomic_batch(nc: Client) -> bool:
    """Whether the connected server has atomic batch publish (nats-server 2.12+)."""
    version = server_version(nc)
    return version is not None and version[:2] >= _ATOMIC_SINCE
