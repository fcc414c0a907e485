"""What every built-in sink is and owes the worker.

A sink module (outboxpg.sinks.rabbitmq, ...) has one entry point,

    def open_sink(settings: SinkSettings) -> Sink

which checks the URL and options (ValueError with one line naming the option: exit 2) and
connects to nothing. ``await sink.start()`` connects: SinkUnreachable when the server cannot be
reached or is not the kind the scheme names (exit 3), SinkRefused when it is reached but cannot
take the events (exit 5: no exchange, no permission). Then ``publish_batch`` as any publisher
(outboxpg.relay.publishers): one outcome per event, in order; ``None`` only once the server has
stored the event (a publisher confirm, a QoS 1 PUBACK, an XADD reply, a 2xx); a PermanentError
for an event the server can never take (too large, refused), whose message is the dead letter's
reason; any other exception for a failure worth retrying (the worker backs off); ``NotSent`` for
the events of a run after its first failure. Events of one aggregate are published one after
another, each once the one before is stored; different aggregates may go concurrently.
``describe()`` names the target for logs, without credentials. ``close()`` may be called once
whether or not ``start`` succeeded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from outboxpg.events import OutboxEvent

__all__ = ["Sink", "SinkSettings", "SinkUnavailable", "SinkUnreachable", "SinkRefused", "url_options",
           "without_credentials"]


class SinkUnavailable(Exception):
    """The sink cannot be used at all here: its client library is missing (exit 2)."""


class SinkUnreachable(Exception):
    """start(): the server cannot be reached, refuses the login, or is not what the scheme names (exit 3)."""


class SinkRefused(Exception):
    """start(): the server is reached but cannot take the events (exit 5), with what to do."""


@dataclass(frozen=True)
class SinkSettings:
    """What the worker knows of a sink: its URL (credentials and all) and the options given beside
    it. ``options`` are the URL's query merged under the flags (a flag wins)."""

    url: str
    options: Mapping[str, str] = field(default_factory=dict)
    publish_timeout: float = 10.0       # seconds a publish may wait for the server's acknowledgement
    secret: bytes | None = None         # the webhook signing secret (never in the URL)
    ensure: bool = False                # declare what the sink publishes into (exchange, ...) if missing


@runtime_checkable
class Sink(Protocol):
    async def start(self) -> None: ...

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]: ...

    async def close(self) -> None: ...

    def describe(self) -> str: ...


def url_options(url: str, flags: Mapping[str, str] | None = None) -> dict[str, str]:
    """The URL's query parameters, then the flags over them."""
    options = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    options.update(flags or {})
    return options


def without_credentials(url: str) -> str:
    """The URL for a log line: no user, password or query."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
