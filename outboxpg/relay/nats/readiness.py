"""Whether the server behind ``--nats-url`` can take the outbox's events, checked by the worker
before it claims anything: it is a NATS server, JetStream is on, and streams capture the subject
prefix and each of ``outbox_settings.allowed_subject_prefixes``.

The checks name what is wrong and what to do in one line each. They look only at what an
operator configures (the server, the prefix, the allowed prefixes), never at a subject a producer
wrote: refusing to start over one of those would let any producer stop every worker's restart.
Those are warned about by the stream check (outboxpg.relay.nats.streams).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from urllib.parse import urlsplit

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

__all__ = ["NOT_CAPTURED_HINT", "covers_under", "jetstream_off", "not_nats", "uncaptured_prefixes"]

# What a NATS server sends first on a new connection, before the client says anything.
_GREETING = b"INFO"

NOT_CAPTURED_HINT = ("pass --ensure-stream NAME to create one, or add the subjects to a stream "
                     "(nats stream add), or --wait-for-stream to wait for one")


async def not_nats(url: str, timeout: float = 2.0) -> str | None:
    """Why the server at ``url`` is not a NATS server, or None when it greets as one or cannot
    be reached (refused, unresolvable: that may come right, and the caller waits for it).
    Only nats:// and tls:// (and bare host:port) URLs are probed: a NATS server greets with
    INFO in plain text on both; a WebSocket URL is left to nats-py."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    if parts.scheme not in ("nats", "tls"):
        return None
    try:
        host, port = parts.hostname or "127.0.0.1", parts.port or 4222
    except ValueError:
        return None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (TimeoutError, OSError):
        return None
    try:
        try:
            first = await asyncio.wait_for(reader.read(64), timeout)
        except TimeoutError:
            return f"{host}:{port} sent nothing within {timeout:g} s of connecting (a NATS server greets at once)"
        except OSError as exc:
            return f"{host}:{port} dropped the connection ({exc.strerror or type(exc).__name__})"
        if first.startswith(_GREETING):
            return None
        if not first:
            return f"{host}:{port} closed the connection without a greeting"
        return f"{host}:{port} answered {first[:16]!r}, not a NATS greeting"
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def jetstream_off(js: JetStreamContext, url: str) -> str | None:
    """Why JetStream cannot be used on the connected server, or None when it can."""
    try:
        await js.account_info()
    except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError):
        return (f"JetStream is not enabled on {url}: start nats-server with -js (or a jetstream {{}} block "
                "in its configuration)")
    except nats.js.errors.APIError as exc:
        return f"JetStream on {url} refused this account ({exc.description or exc.code}): enable JetStream for it"
    return None


def covers_under(subject_filter: str, prefix: str) -> bool:
    """Whether a stream with ``subject_filter`` captures some subject under ``prefix`` (the
    prefix itself or ``<prefix>.x...``), token by token with NATS wildcards."""
    want = prefix.split(".")
    have = subject_filter.split(".")
    for i, token in enumerate(have):
        if token == ">":
            return True
        if i >= len(want):
            return True   # longer than the prefix, and matched it so far: under it
        if token not in ("*", want[i]):
            return False
    return len(have) >= len(want)


async def uncaptured_prefixes(js: JetStreamContext, prefixes: Sequence[str]) -> list[str]:
    """The prefixes under which no stream captures any subject (one JetStream API request)."""
    filters = [s for info in await js.streams_info() for s in (info.config.subjects or [])]
    return [p for p in prefixes if not any(covers_under(f, p) for f in filters)]
