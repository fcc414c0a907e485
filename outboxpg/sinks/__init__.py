"""Built-in sinks: where ``outboxpg-worker --sink URL`` publishes, the URL's scheme picking one.

    nats:// tls://         NATS JetStream (outboxpg.relay.nats; --nats-url is the same)
    amqp:// amqps://       RabbitMQ (outboxpg.sinks.rabbitmq, extra ``rabbitmq``)
    redis:// rediss://     Redis Streams (outboxpg.sinks.redis, extra ``redis``)
    mqtt:// mqtts://       MQTT (outboxpg.sinks.mqtt, extra ``mqtt``)
    http:// https://       signed webhooks (outboxpg.sinks.webhooks, extra ``webhooks``)

Each sink module is imported only when its scheme is asked for, so a sink's client library is
needed only by the workers that use it. A sink is a publisher (outboxpg.relay.publishers says
what a publisher owes the worker: one outcome per event, order per aggregate, PermanentError for
what can never be published) with ``start`` and ``close``; the contract is outboxpg.sinks.base.
"""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from outboxpg.sinks.base import Sink, SinkSettings, SinkUnavailable

__all__ = ["SCHEMES", "open_sink", "scheme_of"]

# scheme -> (module, the extra that installs its client library)
SCHEMES: dict[str, tuple[str, str]] = {
    "amqp": ("outboxpg.sinks.rabbitmq", "rabbitmq"),
    "amqps": ("outboxpg.sinks.rabbitmq", "rabbitmq"),
    "redis": ("outboxpg.sinks.redis", "redis"),
    "rediss": ("outboxpg.sinks.redis", "redis"),
    "mqtt": ("outboxpg.sinks.mqtt", "mqtt"),
    "mqtts": ("outboxpg.sinks.mqtt", "mqtt"),
    "http": ("outboxpg.sinks.webhooks", "webhooks"),
    "https": ("outboxpg.sinks.webhooks", "webhooks"),
}


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case; ValueError (one line) for a URL without a known one."""
    scheme = urlsplit(url.strip()).scheme.lower()
    if scheme not in SCHEMES and scheme not in ("nats", "tls", "ws", "wss"):
        known = ", ".join(sorted({*SCHEMES, "nats"}))
        raise ValueError(f"--sink {url.split('?')[0]!r}: unknown scheme {scheme!r}; one of {known}")
    return scheme


def open_sink(settings: SinkSettings) -> Sink:
    """The sink for ``settings.url`` (not started). ValueError for a URL or an option that is not
    valid; SinkUnavailable when the sink's client library is not installed (an ImportError while
    its module is imported or while its open_sink runs)."""
    scheme = scheme_of(settings.url)
    module_name, extra = SCHEMES[scheme]
    try:
        # The client library is imported by the module, or by its open_sink (either is fine).
        sink: Sink = importlib.import_module(module_name).open_sink(settings)
    except ImportError as exc:
        raise SinkUnavailable(f"the {scheme}:// sink needs {exc.name or 'its client library'}: "
                              f"pip install 'outboxpg[{extra}]'") from None
    return sink
