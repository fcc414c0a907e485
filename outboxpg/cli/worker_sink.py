"""``outboxpg-worker --sink URL``: from the command line's options to a started built-in sink.

The URL's scheme picks the sink (outboxpg.sinks). nats:// and tls:// (and ws://, wss://) are the
NATS publisher of ``--nats-url``, with its start checks; every other scheme goes through
``outboxpg.sinks.open_sink`` and ``start()`` here, then to the Worker as a publisher of one's own
would. The sink's options are the URL's query with the ``--sink-option KEY=VALUE`` flags over
it; the webhook signing secret comes from $OUTBOXPG_WEBHOOK_SECRET or --webhook-secret-file,
never from the URL or a flag's value (either would show in ``ps``). Every failure is a CliError,
one line: 2 usage (a URL, an option, a missing client library), 3 the server cannot be reached,
5 it is reached but cannot take the events.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from outboxpg.cli.errors import EXIT_BROKER, EXIT_CONNECT, EXIT_USAGE, CliError
from outboxpg.sinks import open_sink, scheme_of
from outboxpg.sinks.base import (
    Sink,
    SinkRefused,
    SinkSettings,
    SinkUnavailable,
    SinkUnreachable,
    url_options,
)
from outboxpg.text import first_line

__all__ = ["NATS_SCHEMES", "SECRET_VARIABLE", "StartedSink", "check_sink_flags", "is_nats", "open_configured",
           "sink_secrets", "sink_settings", "start_sink", "url_secrets", "webhook_secret"]

NATS_SCHEMES = ("nats", "tls", "ws", "wss")
# The webhook signing secret, when not in --webhook-secret-file.
SECRET_VARIABLE = "OUTBOXPG_WEBHOOK_SECRET"
# How long a sink's start() (connecting, its checks) may take before the worker gives up (exit 3).
START_TIMEOUT = 30.0


def is_nats(url: str) -> bool:
    """Does ``url`` name a NATS server (the --nats-url path)? ValueError for an unknown scheme."""
    return scheme_of(url) in NATS_SCHEMES


def url_secrets(url: str, *, token: bool = False) -> list[str]:
    """The passwords in a URL (or a comma-separated list of URLs), as written and decoded;
    ``token``: a user name without a password is a secret too (nats://TOKEN@host)."""
    found: set[str] = set()
    for part in url.split(","):
        try:
            u = urlsplit(part.strip())
            password, username = u.password, u.username
        except ValueError:
            continue
        if password:
            found.add(password)
        elif username and token:
            found.add(username)
    return sorted({*found, *map(unquote, found)} - {""}, key=len, reverse=True)


def sink_secrets(args: argparse.Namespace) -> list[str]:
    """What the worker's log lines and errors must never show of the sink: the URL's password (a
    NATS token too) and the webhook secret (``args.webhook_secret``, read by webhook_secret)."""
    found = url_secrets(args.sink, token=_nats_scheme(args.sink)) if args.sink else []
    secret: bytes | None = getattr(args, "webhook_secret", None)
    if secret:
        found.append(secret.decode(errors="replace"))
    return found


def _nats_scheme(url: str) -> bool:
    try:
        return is_nats(url)
    except ValueError:
        return False


def _options(flags: list[str] | None) -> dict[str, str]:
    options: dict[str, str] = {}
    for item in flags or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--sink-option must look like KEY=VALUE, got {item!r}", EXIT_USAGE)
        options[key.strip()] = value
    return options


def webhook_secret(args: argparse.Namespace) -> bytes | None:
    """The webhook signing secret: --webhook-secret-file's content (blanks around it stripped) or
    $OUTBOXPG_WEBHOOK_SECRET; None when neither is given. Both, or a file that cannot be read or
    is empty: one line, exit 2."""
    from_env = os.environ.get(SECRET_VARIABLE)
    path = args.webhook_secret_file
    if path is not None and from_env:
        raise CliError(f"the webhook secret is given twice: --webhook-secret-file and ${SECRET_VARIABLE}; "
                       "keep one", EXIT_USAGE)
    if path is None:
        return from_env.encode() if from_env else None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise CliError(f"--webhook-secret-file {path}: cannot read it: {(exc.strerror or first_line(exc)).lower()}",
                       EXIT_USAGE) from None
    if not secret:
        raise CliError(f"--webhook-secret-file {path}: the file is empty", EXIT_USAGE)
    return secret


def check_sink_flags(args: argparse.Namespace) -> None:
    """The sink flags that make no sense together, or without --sink: one line, exit 2."""
    sink_only = [flag for flag, given in (("--sink-option", bool(args.sink_option)),
                                          ("--ensure-sink", args.ensure_sink),
                                          ("--webhook-secret-file", args.webhook_secret_file is not None)) if given]
    if not args.sink:
        if sink_only:
            raise CliError(f"{sink_only[0]} needs --sink URL", EXIT_USAGE)
        return
    try:
        nats = is_nats(args.sink)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if args.publisher:
        raise CliError("--sink and --publisher both name where to publish: keep one", EXIT_USAGE)
    if nats and sink_only:
        hint = " (NATS: --ensure-stream NAME)" if args.ensure_sink else ""
        raise CliError(f"{sink_only[0]} does not apply to a NATS --sink{hint}", EXIT_USAGE)
    if not nats and args.ensure_stream:
        raise CliError("--ensure-stream applies to NATS only; for this sink: --ensure-sink", EXIT_USAGE)
    if not nats and args.wait_for_stream:
        raise CliError("--wait-for-stream applies to NATS only", EXIT_USAGE)


def sink_settings(args: argparse.Namespace, publish_timeout: float, secret: bytes | None) -> SinkSettings:
    """SinkSettings for a --sink that is not NATS (``secret``: webhook_secret's)."""
    return SinkSettings(url=args.sink, options=url_options(args.sink, _options(args.sink_option)),
                        publish_timeout=publish_timeout, secret=secret, ensure=args.ensure_sink)


def open_configured(settings: SinkSettings) -> Sink:
    """open_sink: a URL or an option that is not valid, or a client library that is missing,
    is one line, exit 2."""
    try:
        return open_sink(settings)
    except (ValueError, SinkUnavailable) as exc:
        raise CliError(first_line(exc), EXIT_USAGE) from None


async def start_sink(sink: Sink, stopping: asyncio.Event, timeout: float = START_TIMEOUT) -> StartedSink | None:
    """``sink.start()``: 3 when the server cannot be reached (or start() has not returned within
    ``timeout`` seconds), 5 when it cannot take the events; closed again on failure. None:
    stopped (SIGTERM) meanwhile."""
    target = sink.describe()
    starting = asyncio.ensure_future(sink.start())
    stop = asyncio.ensure_future(stopping.wait())
    try:
        done, _ = await asyncio.wait({starting, stop}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if starting not in done:
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
            await _close_quietly(sink)
            if stop in done:
                return None
            raise CliError(f"--sink {target}: no answer within {timeout:g}s", EXIT_CONNECT)
        starting.result()
    except SinkUnreachable as exc:
        await _close_quietly(sink)
        raise CliError(f"--sink {target}: {first_line(exc)}", EXIT_CONNECT) from None
    except SinkRefused as exc:
        await _close_quietly(sink)
        raise CliError(f"--sink {target}: {first_line(exc)}", EXIT_BROKER) from None
    except ValueError as exc:
        await _close_quietly(sink)
        raise CliError(f"--sink {target}: {first_line(exc)}", EXIT_USAGE) from None
    except CliError:
        raise
    except BaseException:
        await _close_quietly(sink)
        raise
    finally:
        stop.cancel()
    return StartedSink(sink)


async def _close_quietly(sink: Sink) -> None:
    try:
        await sink.close()
    except Exception:  # noqa: BLE001 - closing what failed to start: its error says nothing more
        pass


class StartedSink:
    """A sink outboxpg-worker has started: Worker.run()'s own start() call does nothing more.
    Everything else (publish_batch, close, describe, and ``ready``, ``health_problem``,
    ``closed`` and ``run_publishing`` where the sink has them) is the sink's."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    async def start(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)
