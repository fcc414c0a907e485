"""The RabbitMQ sink: ``outboxpg-worker --sink amqp://user:password@host:5672/vhost`` (or
``amqps://``), with aio-pika (extra ``rabbitmq``).

Where events go. Every event is published to one exchange, ``?exchange=NAME`` (default
``outbox``, a durable topic exchange), with the event's subject as its routing key, so queues
bind with patterns such as ``outbox.order.*`` or ``outbox.#``. ``?exchange=`` (empty) is the
default exchange: the subject is then the name of the queue. At start the exchange must exist
(SinkRefused, exit 5, naming it and ``--ensure-sink`` otherwise); with ``ensure``
(``--ensure-sink``) a missing one is declared, a durable topic exchange. A login RabbitMQ
refuses, or a server that cannot be reached or does not speak AMQP 0-9-1, is SinkUnreachable
(exit 3); a vhost the user may not open is SinkRefused.

The message. Body: the payload as stored (``content_type`` application/json). ``message_id``:
the event's msg_id, the id consumers deduplicate on. ``delivery_mode`` 2 (persistent),
``timestamp`` the event's created_at, ``type`` its event_type. Headers (AMQP table, strings):
``Outbox-Id``, ``Outbox-Event-Type``, ``Outbox-Aggregate-Type``, ``Outbox-Aggregate-Id``,
``Outbox-Attempt``, then the row's own headers, less any named like one of those in any case.

Published means stored. Each publish goes with the ``mandatory`` flag on a channel in publisher
confirm mode; an event counts as published only on RabbitMQ's basic.ack, which for a persistent
message routed to durable queues comes once they have it on disk. A message the exchange routes
to no queue comes back (basic.return, NO_ROUTE) instead of being dropped: that is a failure
with a reason naming the exchange and the routing key, and a transient one, retried with
backoff: a missing binding is an operator's fix (a queue being set up, a binding being
changed), and nothing should be dead-lettered meanwhile; an event that stays unroutable dies
after ``max_attempts`` like any failing event. A basic.nack (a queue refusing publishes, e.g.
``x-overflow: reject-publish`` at its length limit) is a transient failure too.

Never publishable (PermanentError, dead-lettered at once, with the reason): a payload over the
max message size (``?max_message_size=N``, default 134217728, RabbitMQ's own default; checked
before sending, because RabbitMQ answers an oversized message by closing the channel, and with
it every publish waiting there for its confirm); a routing key (subject) or header name over 255
bytes; message properties and headers too big for one AMQP frame (the connection's frame_max:
RabbitMQ would close the whole connection). When the server's ``max_message_size`` is lower than
the option, RabbitMQ closes the channel: the event over the size the server names
("larger than configured max size N") is dead-lettered with that reason, the other events
that were waiting on the channel fail (transient), and from then on the sink checks events
against the server's size before sending.

Order per aggregate: "sequential confirms". Each run's event k+1 is published only once the
broker confirmed event k; the runs of a batch (different aggregates), and the batches the worker
has in flight, share one channel and are all pipelined there. RabbitMQ keeps the order of
publishes on one channel, but a failure in the middle (a return, a nack, the connection going
down with k written and k+1 queued behind it) could still leave k+1 stored without k; waiting
for k's confirm rules that out: k+1 leaves this process only after RabbitMQ said k is stored.
Each publish is handed to the connection's writer without waiting for the socket to drain, so
the runs' messages leave together, not a few event-loop iterations apart; a run's next event
still waits for the confirm. A run stops at its first failure; the rest of the run get
``NotSent``. The whole batch has
``publish_timeout`` seconds: an event still unconfirmed then fails with a TimeoutError, the rest
of its run get ``NotSent``.

Connection trouble. The connection going down in the middle of a batch (a broker restart, a
network cut) fails the event of each run that was waiting for its confirm (transient: it may or
may not be stored, and is published again, with the same message_id), and the rest of each run
get ``NotSent``. The sink then reconnects in the background (0.1 s, doubling to 2 s between
tries), re-checking (with ``ensure``, re-declaring) the exchange; meanwhile ``ready`` is clear,
so the worker claims nothing, and ``health_problem()`` says why (the worker's /readyz). A
channel RabbitMQ closed (an oversized message, an exchange deleted, a permission withdrawn) is
reopened for the next publish.

Other URL options, passed to aio-pika: ``heartbeat``, ``timeout``, ``name``, ``auth``,
``cafile``, ``capath``, ``cadata``, ``keyfile``, ``certfile``, ``no_verify_ssl``. Any other
option is a ValueError (exit 2). The password never appears in a log line or a reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import unquote, urlencode, urlsplit, urlunsplit

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from pamqp import frame as pamqp_frame
from pamqp import header as pamqp_header

from outboxpg.events import OutboxEvent, runs_of
from outboxpg.relay.publishers import PermanentError, not_sent_after
from outboxpg.sinks.base import SinkRefused, SinkSettings, SinkUnreachable, url_options, without_credentials
from outboxpg.text import describe

__all__ = ["RabbitMQSink", "open_sink", "DEFAULT_EXCHANGE", "DEFAULT_MAX_MESSAGE_SIZE"]

log = logging.getLogger("outboxpg.sinks.rabbitmq")

DEFAULT_EXCHANGE = "outbox"
# RabbitMQ's default max_message_size (3.8 and later); the largest it accepts is 512 MiB.
DEFAULT_MAX_MESSAGE_SIZE = 128 * 1024 * 1024
_LARGEST_MAX_MESSAGE_SIZE = 512 * 1024 * 1024
# aiormq's frame_max when the server has not told (RabbitMQ's default).
_DEFAULT_FRAME_MAX = 131072
# Options aio-pika (aiormq) reads from the URL's query.
_CLIENT_OPTIONS = frozenset({"heartbeat", "timeout", "name", "auth", "cafile", "capath", "cadata", "keyfile",
                             "certfile", "no_verify_ssl"})
_OWN_OPTIONS = frozenset({"exchange", "max_message_size"})
_HEADERS = ("Outbox-Id", "Outbox-Event-Type", "Outbox-Aggregate-Type", "Outbox-Aggregate-Id", "Outbox-Attempt")
_TAKEN = frozenset(name.lower() for name in _HEADERS)
_SERVER_MAX = re.compile(r"larger than configured max size (\d+)")
_RECONNECT_FIRST, _RECONNECT_MAX = 0.1, 2.0


def open_sink(settings: SinkSettings) -> RabbitMQSink:
    return RabbitMQSink(settings)


class RabbitMQSink:
    """Publishes to one RabbitMQ exchange (see the module's docstring)."""

    run_publishing = "sequential-confirms (runs pipelined on one channel)"   # the worker logs it at start

    def __init__(self, settings: SinkSettings) -> None:
        parts = urlsplit(settings.url.strip())
        scheme = parts.scheme.lower()
        if scheme not in ("amqp", "amqps"):
            raise ValueError(f"--sink {without_credentials(settings.url)}: not an amqp:// or amqps:// URL")
        if not parts.hostname:
            raise ValueError(f"--sink {without_credentials(settings.url)}: no host")
        options = url_options(settings.url, settings.options)
        unknown = sorted(set(options) - _OWN_OPTIONS - _CLIENT_OPTIONS)
        if unknown:
            known = ", ".join(sorted(_OWN_OPTIONS | _CLIENT_OPTIONS))
            raise ValueError(f"--sink {without_credentials(settings.url)}: unknown option {unknown[0]!r}; "
                             f"the RabbitMQ sink takes {known}")
        self.exchange_name = options.get("exchange", DEFAULT_EXCHANGE)
        if len(self.exchange_name.encode()) > 127:
            raise ValueError("--sink: the exchange name is longer than 127 bytes")
        self.max_message_size = _size_option(options.get("max_message_size"))
        self.settings = settings
        self.vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        self._password = parts.password or ""
        client = {k: v for k, v in options.items() if k in _CLIENT_OPTIONS}
        self._connect_url = urlunsplit((scheme, parts.netloc, parts.path, urlencode(client), ""))
        self._where = without_credentials(settings.url)
        self.ready = asyncio.Event()   # set while connected: the worker claims only then
        self.closed = False            # close() was called
        self.server_max_message_size: int | None = None   # learned from a refusal
        self.reconnects = 0
        self._problem: str | None = "not started"
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._frame_max = _DEFAULT_FRAME_MAX
        self._channel_lock = asyncio.Lock()
        self._reconnecting: asyncio.Task[None] | None = None
        self._started = False   # start() succeeded: from then on a lost connection is reconnected

    def describe(self) -> str:
        return f"{self._where} exchange {self.exchange_name!r}"

    def health_problem(self) -> str | None:
        """Why no event can be published now, or None (the worker's /readyz)."""
        return None if self.ready.is_set() else self._problem

    # -- start, reconnect, close -----------------------------------------------------------

    async def start(self) -> None:
        if self.ready.is_set():
            return
        _quiet_client_logs()
        await self._open()
        self._started = True
        self.ready.set()
        self._problem = None

    async def close(self) -> None:
        self.closed = True
        self.ready.clear()
        self._problem = "closed"
        if self._reconnecting is not None:
            self._reconnecting.cancel()
            with contextlib.suppress(BaseException):
                await self._reconnecting
        await self._drop()

    async def _open(self) -> None:
        """Connect, check (or declare) the exchange, open the publishing channel."""
        await self._drop()
        timeout = self.settings.publish_timeout
        try:
            connection = await asyncio.wait_for(aio_pika.connect(self._connect_url, timeout=timeout), timeout)
        except (aiormq.exceptions.ProbableAuthenticationError, aiormq.exceptions.AuthenticationError) as exc:
            raise SinkUnreachable(f"RabbitMQ at {self._where} refused the login: {self._reason(exc)}") from None
        except aiormq.exceptions.ConnectionNotAllowed as exc:
            raise SinkRefused(f"RabbitMQ at {self._where} does not let this user open vhost {self.vhost!r}: "
                              f"{self._reason(exc)}") from None
        except aiormq.exceptions.InvalidFrameError as exc:
            if "Connection.OpenOk" in str(exc) and "Connection.Close" in str(exc):
                # aiormq keeps only this text of the server's answer to connection.open (530 NOT_ALLOWED).
                raise SinkRefused(f"RabbitMQ at {self._where} refused to open vhost {self.vhost!r}: it does not exist "
                                  "or this user has no permission on it") from None
            raise SinkUnreachable(f"cannot reach RabbitMQ at {self._where}: {self._reason(exc)}") from None
        except TimeoutError:
            raise SinkUnreachable(f"cannot reach RabbitMQ at {self._where}: no answer within {timeout:g}s") from None
        except Exception as exc:  # noqa: BLE001 - refused, reset, not AMQP, name not resolved: one line
            raise SinkUnreachable(f"cannot reach RabbitMQ at {self._where}: {self._reason(exc)}") from None
        self._connection = connection
        connection.close_callbacks.add(self._on_connection_closed)
        try:
            tune = getattr(getattr(connection, "transport", None), "connection", None)
            self._frame_max = int(getattr(getattr(tune, "connection_tune", None), "frame_max", 0)) or _DEFAULT_FRAME_MAX
            await self._check_exchange(connection)
            self._channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            self._exchange = await self._bind_exchange(self._channel)
            if connection.is_closed:
                raise SinkUnreachable(f"RabbitMQ at {self._where} closed the connection at once")
        except BaseException:
            await self._drop()
            raise

    async def _check_exchange(self, connection: AbstractConnection) -> None:
        """The exchange exists (with ``ensure``: declared if missing), on a channel of its own:
        a passive declare of a missing exchange closes its channel."""
        name = self.exchange_name
        if not name:
            return   # the default exchange always exists
        try:
            channel = await connection.channel(publisher_confirms=False)
            try:
                if self.settings.ensure:
                    await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
                else:
                    await channel.declare_exchange(name, passive=True)
            finally:
                with contextlib.suppress(Exception):
                    await channel.close()
        except aiormq.exceptions.ChannelNotFoundEntity:
            raise SinkRefused(f"exchange {name!r} does not exist in vhost {self.vhost!r} on {self._where}: "
                              "declare it (a durable topic exchange) or start the worker with --ensure-sink") from None
        except aiormq.exceptions.ChannelPreconditionFailed as exc:
            raise SinkRefused(f"exchange {name!r} on {self._where} exists with other properties than a durable "
                              f"topic exchange: {self._reason(exc)}") from None
        except aiormq.exceptions.ChannelAccessRefused as exc:
            raise SinkRefused(f"RabbitMQ at {self._where} refuses this user exchange {name!r}: "
                              f"{self._reason(exc)}") from None
        except Exception as exc:  # noqa: BLE001 - the connection failing meanwhile
            raise SinkUnreachable(f"RabbitMQ at {self._where}: {self._reason(exc)}") from None

    async def _bind_exchange(self, channel: AbstractChannel) -> AbstractExchange:
        if not self.exchange_name:
            return channel.default_exchange
        return await channel.get_exchange(self.exchange_name, ensure=False)

    async def _drop(self) -> None:
        connection, self._connection, self._channel, self._exchange = self._connection, None, None, None
        if connection is not None:
            connection.close_callbacks.discard(self._on_connection_closed)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(connection.close(), 5)

    def _on_connection_closed(self, connection: Any, exc: BaseException | None = None) -> None:
        if connection is self._connection:
            self._lost(exc)

    def _lost(self, exc: BaseException | None) -> None:
        """The connection is gone: not ready, and reconnect in the background (once)."""
        if self.closed or not self._started or (self._reconnecting is not None and not self._reconnecting.done()):
            return
        self.ready.clear()
        self._problem = f"the connection to RabbitMQ at {self._where} was lost: {self._reason(exc)}" \
            if exc is not None else f"the connection to RabbitMQ at {self._where} was closed"
        log.warning("event=rabbitmq_lost url=%s error=%r", self._where, self._problem)
        self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect(),
                                                                    name="outboxpg-rabbitmq-reconnect")

    async def _reconnect(self) -> None:
        delay = _RECONNECT_FIRST
        said = None
        while not self.closed:
            await asyncio.sleep(delay)
            try:
                await self._open()
            except (SinkUnreachable, SinkRefused) as exc:
                self._problem = str(exc)
                if self._problem != said:
                    log.warning("event=rabbitmq_reconnect_failed error=%r", self._problem)
                    said = self._problem
                delay = min(delay * 2, _RECONNECT_MAX)
                continue
            self.reconnects += 1
            self._problem = None
            self.ready.set()
            log.info("event=rabbitmq_reconnected url=%s", self._where)
            return

    async def _publishing_exchange(self) -> tuple[AbstractChannel, AbstractExchange]:
        """The open channel and the exchange on it; a channel RabbitMQ closed is reopened."""
        channel, exchange = self._channel, self._exchange
        if channel is not None and exchange is not None and not channel.is_closed:
            return channel, exchange
        async with self._channel_lock:
            connection = self._connection
            if connection is None or connection.is_closed:
                if self.ready.is_set():
                    self._lost(None)   # closed without its callback having run: reconnect all the same
                raise ConnectionError(self._problem or f"not connected to RabbitMQ at {self._where}")
            if self._channel is None or self._channel.is_closed or self._exchange is None:
                self._channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
                self._exchange = await self._bind_exchange(self._channel)
            return self._channel, self._exchange

    # -- publishing ------------------------------------------------------------------------

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(events)
        runs = runs_of(events)
        timeout = self.settings.publish_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        target: tuple[AbstractChannel, AbstractExchange] | None = None
        failure: BaseException | None = None
        if not self.ready.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ready.wait(), timeout)
        try:
            if not self.ready.is_set():
                raise ConnectionError(self._problem or f"not connected to RabbitMQ at {self._where}")
            async with asyncio.timeout_at(deadline):
                target = await self._publishing_exchange()
        except TimeoutError:
            failure = TimeoutError(f"no channel to RabbitMQ within {timeout:g}s")
        except Exception as exc:  # noqa: BLE001 - not connected, or the channel cannot be opened
            failure = ConnectionError(self._reason(exc)) if not isinstance(exc, ConnectionError) else exc
        if target is None:
            for run in runs:
                outcomes[run[0]] = failure
                not_sent_after(events, run[1:], events[run[0]].id, outcomes)
            return outcomes
        at = [0] * len(runs)         # the position in each run of the event being published
        done = [False] * len(runs)

        async def publish_run(r: int) -> None:
            run = runs[r]
            for n, i in enumerate(run):
                at[r] = n
                outcome = await self._publish(events[i], *target)
                if outcome is not None:
                    outcomes[i] = outcome
                    not_sent_after(events, run[n + 1:], events[i].id, outcomes)
                    break
            done[r] = True

        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.gather(*(publish_run(r) for r in range(len(runs))))
        except TimeoutError:
            for r, run in enumerate(runs):
                if not done[r]:
                    i = run[at[r]]
                    outcomes[i] = TimeoutError(f"no confirm from RabbitMQ within {timeout:g}s")
                    not_sent_after(events, run[at[r] + 1:], events[i].id, outcomes)
        return outcomes

    async def _publish(self, event: OutboxEvent, channel: AbstractChannel,
                       exchange: AbstractExchange) -> BaseException | None:
        """Publish one event and wait for its confirm: None once stored, else why not."""
        message = self._message(event)
        if isinstance(message, PermanentError):
            return message
        try:
            if channel.is_closed:
                raise aiormq.exceptions.ChannelInvalidStateError("the channel is closed")
            # aiormq's channel itself, not Exchange.publish: that waits, holding the channel's
            # lock, until the writer task has written and drained each publish, so a batch's
            # runs reached RabbitMQ a few loop iterations apart, one after the other. Without the
            # wait each publish is queued to the writer at once (the queue is bounded: a full
            # one still waits); the run's next event still waits for this one's confirm.
            underlay = cast(aiormq.Channel, await channel.get_underlay_channel())   # its abc lacks ``wait``
            await underlay.basic_publish(message.body, exchange=exchange.name, routing_key=event.subject,
                                         properties=message.properties, mandatory=True, wait=False)
        except aiormq.exceptions.PublishError as exc:
            return RuntimeError(f"unroutable: exchange {self.exchange_name!r} routes routing key "
                                f"{event.subject!r} to no queue (RabbitMQ returned it: {_returned(exc)}); "
                                "bind a queue to the exchange for it")
        except aiormq.exceptions.DeliveryError:
            return RuntimeError("RabbitMQ refused the message (basic.nack): a queue it routes to does not take "
                                "it now (a length limit with x-overflow reject-publish?)")
        except aiormq.exceptions.ChannelClosed as exc:
            return self._channel_closed(event, exc)
        except Exception as exc:  # noqa: BLE001 - the connection or channel going down: transient
            return ConnectionError(f"publish to RabbitMQ at {self._where} failed: {self._reason(exc)}")
        return None

    def _message(self, event: OutboxEvent) -> aio_pika.Message | PermanentError:
        """The event as an AMQP message, or why it can never be published."""
        payload = event.payload
        limit, source = self.max_message_size, "the sink's max_message_size"
        if self.server_max_message_size is not None and self.server_max_message_size < limit:
            limit, source = self.server_max_message_size, "RabbitMQ's max_message_size"
        if len(payload) > limit:
            return PermanentError(f"message of {len(payload)} bytes exceeds {source} of {limit} bytes")
        if len(event.subject.encode()) > 255:
            return PermanentError(f"routing key (subject) of {len(event.subject.encode())} bytes: AMQP allows "
                                  "255 at most")
        headers: dict[str, Any] = {"Outbox-Id": str(event.id), "Outbox-Event-Type": event.event_type,
                                   "Outbox-Aggregate-Type": event.aggregate_type,
                                   "Outbox-Aggregate-Id": event.aggregate_id, "Outbox-Attempt": str(event.attempt)}
        size = len(event.msg_id) + len(event.event_type) + len(event.aggregate_type) + len(event.aggregate_id)
        for key, value in event.headers.items():
            if key.lower() in _TAKEN:
                continue
            if len(key.encode()) > 255:
                return PermanentError(f"header name of {len(key.encode())} bytes: AMQP allows 255 at most")
            value = value if isinstance(value, str) else str(value)
            headers[key] = value
            size += len(key) + len(value) + 6
        message = aio_pika.Message(payload, headers=headers, content_type="application/json",
                                   delivery_mode=aio_pika.DeliveryMode.PERSISTENT, message_id=event.msg_id,
                                   timestamp=event.created_at, type=event.event_type)
        # The properties travel in one frame (it cannot be split): count them exactly when near
        # the connection's frame_max, for RabbitMQ closes the whole connection over a bigger one.
        if 4 * size + 512 > self._frame_max:
            header_frame = len(pamqp_frame.marshal(
                pamqp_header.ContentHeader(0, len(payload), message.properties), 1))
            if header_frame > self._frame_max:
                return PermanentError(f"message properties and headers take {header_frame} bytes: over the "
                                      f"connection's frame_max of {self._frame_max} (AMQP sends them in one frame)")
        return message

    def _channel_closed(self, event: OutboxEvent, exc: aiormq.exceptions.ChannelClosed) -> BaseException:
        """RabbitMQ closed the channel while the event waited for its confirm."""
        reason = self._reason(exc)
        found = _SERVER_MAX.search(reason)
        if found:
            server_max = int(found.group(1))
            if self.server_max_message_size is None or server_max < self.server_max_message_size:
                self.server_max_message_size = server_max
            if len(event.payload) > server_max:
                return PermanentError(f"message of {len(event.payload)} bytes exceeds RabbitMQ's max_message_size "
                                      f"of {server_max} bytes (the server refused it: {reason})")
            return RuntimeError(f"the channel was closed by RabbitMQ over another, larger message: {reason}")
        return RuntimeError(f"RabbitMQ closed the channel: {reason}")

    def _reason(self, exc: BaseException | None) -> str:
        """An exception as one line, the server's own text where it has one, never the password."""
        if exc is None:
            return "closed"
        if isinstance(exc, aiormq.exceptions.AMQPError) and exc.args and all(isinstance(a, str | int)
                                                                             for a in exc.args):
            text = " ".join(str(a) for a in exc.args)
            text = f"{type(exc).__name__}: {text}"
        else:
            text = describe(exc)
        if self._password and len(self._password) > 2:
            text = text.replace(self._password, "***")
        return " ".join(text.split())


def _returned(exc: aiormq.exceptions.PublishError) -> str:
    frame = exc.frame
    code, text = getattr(frame, "reply_code", None), getattr(frame, "reply_text", None)
    return f"{code} {text}" if code is not None else "basic.return"


def _size_option(value: str | None) -> int:
    if value is None or value == "":
        return DEFAULT_MAX_MESSAGE_SIZE
    try:
        size = int(value)
    except ValueError:
        size = 0
    if not 0 < size <= _LARGEST_MAX_MESSAGE_SIZE:
        raise ValueError(f"--sink: max_message_size must be a number of bytes from 1 to {_LARGEST_MAX_MESSAGE_SIZE} "
                         f"(RabbitMQ's largest), got {value!r}")
    return size


class _OwnLinesOnly(logging.Filter):
    """aiormq and aio-pika log a lost connection, and every failed reconnect, at ERROR with a
    traceback; the sink logs the same in the worker's one-line form (rabbitmq_lost,
    rabbitmq_reconnect_failed, rabbitmq_reconnected). Their lines are kept only when their
    logger is enabled for DEBUG, without the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        record.stack_info = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_FILTER = _OwnLinesOnly()


def _quiet_client_logs() -> None:
    for name in ("aiormq.connection", "aiormq.channel", "aio_pika", "aio_pika.tools"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
