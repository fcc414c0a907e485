"""Signed webhooks: ``outboxpg-worker --sink https://HOST/PATH`` POSTs every event to an HTTP
endpoint with aiohttp's client (extra ``webhooks``), signed as Standard Webhooks specifies.

The request. ``POST`` of the event's payload (the stored JSON, byte for byte) with
``Content-Type: application/json``; ``webhook-id`` (the event's msg_id: the same on every retry,
receivers de-duplicate on it), ``webhook-timestamp`` and ``webhook-signature``; the outbox's
``Outbox-Id``, ``Outbox-Subject``, ``Outbox-Event-Type``, ``Outbox-Aggregate-Type``,
``Outbox-Aggregate-Id``, ``Outbox-Attempt``; the row's headers as ``Outbox-Header-<name>``
(``traceparent`` and ``tracestate`` as themselves). Values that are not visible ASCII are
percent-encoded; outboxpg.sinks.webhook_signing says how, and what the signing key is.

The secret. ``$OUTBOXPG_WEBHOOK_SECRET`` or ``--webhook-secret-file`` (``SinkSettings.secret``),
``whsec_<base64>`` as receivers' libraries take it, or raw bytes. Never in the URL, a log line or
a dead letter's reason. Without one, open_sink is a usage error: every request is signed, there is
no unsigned mode.

The URL. The ``--sink`` URL is the endpoint, user and password included (HTTP Basic auth).
Its query is the endpoint's, sent as it is (only what cannot stand in a request line, a space or
non-ASCII text, percent-encoded), except the sink's own options, which are taken out:

    routes=PATH        a file mapping subject prefixes to endpoints, one ``PREFIX URL`` a line
                       (``#`` comments, blank lines); an event goes to the endpoint of the
                       longest prefix its subject starts with, whole tokens only
                       (``outbox.order`` takes ``outbox.order.paid``, not ``outbox.orders.x``);
                       a subject under none goes to the --sink URL
    connections=N      connections per host (default 16): runs of different aggregates are
                       posted in parallel up to this many per host

``--sink-option KEY=VALUE`` may set those two, and nothing else.

Outcomes. A 2xx is the ack: the event is published. A 4xx other than 408, 409, 425 and 429 is
permanent: the event is dead-lettered at once with the status and the first bytes of the
body (413 for a payload the receiver will never take, 400, 401, 403, 404, 422, ...). 408, 409,
425, 429, every 5xx, a timeout or a connection that fails are retried with the outbox's backoff.
A 3xx is not followed (a redirect could send the signed body to another host) and is retried
as a failure, naming where it points: the URL needs fixing, the events do not.

Retry-After (seconds or an HTTP date, on any status that is retried) is honoured inside the
batch: every request to that host waits until then, and the refused event is sent again, when
the wait is at most the publish timeout (the worker extends the batch's leases meanwhile); a
longer one fails the event with the delay in the error and in its ``retry_after``, and the
worker passes that to outbox_fail: the next attempt comes no sooner than the endpoint asked
(or the backoff, if longer), up to outbox_settings.backoff_cap. Requests to that host are
held back for the delay asked, at most MAX_HOLD seconds (a wrong header cannot stop a host for
long): one that would wait longer than the publish timeout fails without being sent.

Order. The events of one aggregate are posted one after another, each once the one before has
its 2xx, and a run stops at its first failure (the rest ``NotSent``); different aggregates are
posted in parallel, at most ``connections`` at a time per host: one aiohttp session for the
sink, its pool keeping up to ``connections`` connections per host alive (made as they are
needed). A request takes one of the host's ``connections`` slots before it is sent, so the pool
never makes it wait. (aiohttp's pool takes and gives back a connection at a cost that does not
grow with the connections.)

Time. Each request has the publish timeout for each of its steps (the connection, TLS included;
then from the request on, each wait for the answer's bytes);
the batch as a whole has no deadline of its own: a batch of many runs queues for the host's
connections, in this process, and must not fail for that (the worker extends its leases while
it runs). Once a request to a host of the batch fails without an answer (a timeout, a
connection refused or cut), the batch's requests to that host not yet sent fail at once, without
being sent: a host that is down costs a batch one publish timeout, not one per event.

HTTPS is verified against certifi's CAs unless ``$SSL_CERT_FILE`` / ``$SSL_CERT_DIR`` name
others. ``$HTTPS_PROXY``, ``$HTTP_PROXY``, ``$ALL_PROXY`` and ``$NO_PROXY`` are followed, as the
sink finds them when it first sends to an endpoint (user and password in the proxy's URL are
its Basic auth). Not aiohttp's ``trust_env``: that looks the proxy up again, in a thread, and
~/.netrc too, for every request, which tripled the client's CPU per request. No ~/.netrc, no
cookies kept, no redirect followed.

Start. ``start()`` loads the CAs the connections share and tries a TCP connection to each host (not
behind a proxy); one that cannot be reached is logged (``event=webhook_unreachable``), not an
exit: a receiver being down, or not yet deployed, when the worker starts is ordinary, and the
outbox is made for exactly that: the events wait in the table, in order, and are retried with
backoff until it answers. A worker
that exited instead would only restart in a loop under its supervisor. So ``start()`` raises
nothing for an unreachable host (exit 3 is never given), and a bad URL or routes file is a
ValueError at open_sink (exit 2). ``--ensure-sink`` has nothing to declare here and changes
nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import logging
import math
import os
import ssl
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

import aiohttp
import certifi
from multidict import CIMultiDict
from yarl import URL

from outboxpg.events import OutboxEvent, runs_of
from outboxpg.relay.publishers import PermanentError, not_sent_after
from outboxpg.sinks.base import SinkSettings, without_credentials
from outboxpg.sinks.webhook_signing import request_headers, signing_key
from outboxpg.text import printable

__all__ = ["MAX_HOLD", "WebhookFailed", "WebhookRefused", "WebhookSink", "open_sink", "retry_after_seconds"]

log = logging.getLogger("outboxpg.webhooks")

DEFAULT_CONNECTIONS = 16
OPTIONS = ("routes", "connections")
# The longest Retry-After a host's requests are held for.
MAX_HOLD = 60.0
# A refused event is sent again inside its batch at most this often (each after its Retry-After).
RESENDS = 3
# The bytes of a response body read: of an error, the first BODY_SHOWN go into the dead letter.
BODY_READ = 65536
BODY_SHOWN = 200
# Statuses of 4xx that are worth retrying: timeout, conflict, too early, too many requests.
RETRYABLE_4XX = frozenset({408, 409, 425, 429})
PROBE_TIMEOUT = 2.0


class WebhookFailed(Exception):
    """A failure worth retrying (5xx, 408/409/425/429, a 3xx, no answer, no connection).
    ``status``: the HTTP status, if one came; ``retry_after``: the seconds the endpoint asked to
    wait (its Retry-After), if it did."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class WebhookRefused(PermanentError):
    """A 4xx the endpoint will answer again, whatever the retry: dead-lettered at once."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    url: str                          # as given: credentials and query included; never logged
    shown: str                        # for logs and errors: no credentials, no query
    origin: tuple[str, str, int]      # (scheme, host, port): one client, one connection limit each

    @classmethod
    def parse(cls, url: str, where: str) -> Endpoint:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{where}: not a valid URL ({exc})") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"{where}: an endpoint is an http:// or https:// URL, not {scheme or 'no scheme'}")
        if not parts.hostname:
            raise ValueError(f"{where}: the URL names no host")
        if parts.fragment:
            raise ValueError(f"{where}: an endpoint URL has no #fragment")
        port = port or (443 if scheme == "https" else 80)
        return cls(url, without_credentials(url), (scheme, parts.hostname.lower(), port))

    def redact(self, text: str) -> str:
        """``text`` (a client error, a Location) without this endpoint's credentials or query."""
        parts = urlsplit(self.url)
        for secret in (self.url, parts.query, parts.password, parts.password and unquote(parts.password)):
            if secret:
                text = text.replace(secret, "...")
        return text


def open_sink(settings: SinkSettings) -> WebhookSink:
    """The sink for an http:// or https:// ``settings.url``: ValueError (one line) for a URL,
    an option or a routes file that is not valid, or no signing secret."""
    url = settings.url.strip()
    from_url = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))
    options = {**from_url, **settings.options}   # as url_options merges them, whoever built the settings
    for key, value in options.items():
        if key not in OPTIONS and from_url.get(key) != value:
            raise ValueError(f"--sink-option {key}: the webhooks sink takes {' and '.join(OPTIONS)} only")
    endpoint = Endpoint.parse(_without_options(url), f"--sink {_shown(url)}")
    connections = options.get("connections", str(DEFAULT_CONNECTIONS))
    try:
        limit = int(connections)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ValueError(f"--sink option connections must be a whole number from 1, got {connections!r}")
    routes = _read_routes(options["routes"]) if options.get("routes") else []
    if settings.secret is None or not settings.secret.strip():
        raise ValueError(f"the {endpoint.origin[0]}:// sink signs every request: give the signing secret in "
                         "$OUTBOXPG_WEBHOOK_SECRET or --webhook-secret-file")
    hmac_key = signing_key(settings.secret)
    return WebhookSink(endpoint, routes, hmac_key, settings.publish_timeout, limit)


def _shown(url: str) -> str:
    """without_credentials(url), also for a URL it cannot parse (a port out of range)."""
    try:
        return without_credentials(url)
    except ValueError:
        parts = urlsplit(url)
        return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def _without_options(url: str) -> str:
    """The URL less the sink's options in its query; the endpoint's own parameters stay as written."""
    parts = urlsplit(url)
    kept = [p for p in parts.query.split("&") if p and unquote(p.split("=", 1)[0]) not in OPTIONS]
    return urlunsplit(parts._replace(query="&".join(kept)))


def _read_routes(path: str) -> list[tuple[str, Endpoint]]:
    """The routes file: (prefix, endpoint) pairs, longest prefix first."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise ValueError(f"--sink option routes={path}: cannot read it: {why.lower()}") from None
    routes: dict[str, Endpoint] = {}
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if len(fields) > 2 and fields[2].startswith("#"):
            fields = fields[:2]        # a comment after the route
        if not fields or fields[0].startswith("#"):
            continue
        where = f"--sink option routes={path}, line {number}"
        if len(fields) != 2:
            raise ValueError(f"{where}: a route is 'SUBJECT_PREFIX URL', got {len(fields)} fields")
        prefix = fields[0].removesuffix(".>").rstrip(".")
        if not prefix:
            raise ValueError(f"{where}: the subject prefix is empty")
        if prefix in routes:
            raise ValueError(f"{where}: the prefix {prefix} is routed twice")
        routes[prefix] = Endpoint.parse(fields[1], where)
    return sorted(routes.items(), key=lambda item: len(item[0]), reverse=True)


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A Retry-After header's seconds from now (delay-seconds or an HTTP date; 0 for a past
    date), None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


class WebhookSink:
    """Posts each event to its endpoint; see the module's docstring."""

    run_publishing = "sequential-requests"   # the worker logs it at start

    def __init__(self, endpoint: Endpoint, routes: Sequence[tuple[str, Endpoint]], key: bytes, timeout: float,
                 connections: int = DEFAULT_CONNECTIONS) -> None:
        self.endpoint = endpoint
        self.routes = list(routes)
        self._key = key
        self.timeout = timeout
        self.connections = connections
        self._slots: dict[tuple[str, str, int], asyncio.Semaphore] = {}   # origin -> its ``connections`` slots
        self._session: aiohttp.ClientSession | None = None
        self._targets: dict[str, _Target] = {}                 # endpoint URL -> how to send to it
        self._tls: ssl.SSLContext | None = None                # one for every connection: loading the CAs is slow
        self._holds: dict[tuple[str, str, int], float] = {}    # origin -> loop time its requests wait for
        self._route_of: dict[str, Endpoint] = {}               # subject -> endpoint, as looked up

    def describe(self) -> str:
        more = f" (+{len(self.routes)} routed by subject prefix)" if self.routes else ""
        return f"signed webhooks to {self.endpoint.shown}{more}"

    def endpoints(self) -> list[Endpoint]:
        return [self.endpoint, *(e for _, e in self.routes)]

    async def start(self) -> None:
        self._client()   # the CAs loaded, before the first event waits for them
        for endpoint in self.endpoints():
            self._target(endpoint)
        if urllib.request.getproxies():
            return   # requests go through a proxy ($HTTPS_PROXY, ...): a direct connection proves nothing
        origins = {e.origin: e for e in self.endpoints()}
        await asyncio.gather(*(self._probe(e) for e in origins.values()))

    async def _probe(self, endpoint: Endpoint) -> None:
        _, host, port = endpoint.origin
        try:
            async with asyncio.timeout(min(PROBE_TIMEOUT, self.timeout)):
                _, writer = await asyncio.open_connection(host, port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        except (OSError, TimeoutError) as exc:
            why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
            log.warning("event=webhook_unreachable endpoint=%s error=%r note=%r", endpoint.shown, why,
                        "events wait in the outbox and are retried until it answers")

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()

    def _client(self) -> aiohttp.ClientSession:
        """The sink's one session, made on first use (inside the running loop)."""
        if self._session is None:
            # limit_per_host as the slots are: a request holding a slot always finds a connection.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=self.connections, ssl=self._tls_context())
            # Each step within the publish timeout: the connection (the name looked up, TCP and TLS:
            # connect; the socket's own: sock_connect), then each wait for the answer's bytes; no
            # deadline for the whole (total=None: aiohttp's default is 5 min).
            timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout, sock_connect=self.timeout,
                                            sock_read=self.timeout)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:   # certifi's CAs, or those $SSL_CERT_FILE / $SSL_CERT_DIR name
            if os.environ.get("SSL_CERT_FILE"):
                self._tls = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
            elif os.environ.get("SSL_CERT_DIR"):
                self._tls = ssl.create_default_context(capath=os.environ["SSL_CERT_DIR"])
            else:
                self._tls = ssl.create_default_context(cafile=certifi.where())
        return self._tls

    def _target(self, endpoint: Endpoint) -> _Target:
        found = self._targets.get(endpoint.url)
        if found is None:
            found = self._targets[endpoint.url] = _Target.of(endpoint)
        return found

    def endpoint_for(self, subject: str) -> Endpoint:
        """The endpoint of the longest routed prefix ``subject`` starts with (whole tokens), else
        the --sink URL's."""
        endpoint = self._route_of.get(subject)
        if endpoint is None:
            endpoint = self.endpoint
            for prefix, routed in self.routes:
                if subject == prefix or subject.startswith(prefix + "."):
                    endpoint = routed
                    break
            if len(self._route_of) < 10_000:
                self._route_of[subject] = endpoint
        return endpoint

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        outcomes: list[BaseException | None] = [None] * len(events)
        down: dict[tuple[str, str, int], str] = {}   # hosts this batch could not reach, and why
        await asyncio.gather(*(self._run(events, run, outcomes, down) for run in runs_of(events)))
        return outcomes

    async def _run(self, events: Sequence[OutboxEvent], run: list[int], outcomes: list[BaseException | None],
                   down: dict[tuple[str, str, int], str]) -> None:
        for n, i in enumerate(run):
            outcome = await self._deliver(events[i], down)
            if outcome is not None:
                outcomes[i] = outcome
                not_sent_after(events, run[n + 1:], events[i].id, outcomes)
                return

    async def _deliver(self, event: OutboxEvent, down: dict[tuple[str, str, int], str]) -> BaseException | None:
        """Post one event, sent again after a Retry-After within the publish timeout."""
        loop = asyncio.get_running_loop()
        endpoint = self.endpoint_for(event.subject)
        origin = endpoint.origin
        resends = 0
        while True:
            wait = self._holds.get(origin, 0.0) - loop.time()
            if wait > 0:
                if wait > self.timeout:
                    return WebhookFailed(f"POST {endpoint.shown}: not sent, the endpoint asked to wait {wait:.1f}s "
                                         f"more (Retry-After), over the publish timeout of {self.timeout:g}s",
                                         retry_after=wait)
                await asyncio.sleep(wait)
            outcome = await self._post(event, endpoint, down)
            if not isinstance(outcome, WebhookFailed) or outcome.retry_after is None:
                return outcome
            delay = min(outcome.retry_after, MAX_HOLD)
            self._holds[origin] = max(self._holds.get(origin, 0.0), loop.time() + delay)
            if resends >= RESENDS or delay > self.timeout:
                return outcome
            resends += 1

    async def _post(self, event: OutboxEvent, endpoint: Endpoint,
                    down: dict[tuple[str, str, int], str]) -> BaseException | None:
        slots = self._slots.get(endpoint.origin)
        if slots is None:
            slots = self._slots[endpoint.origin] = asyncio.Semaphore(self.connections)
        # A request takes a slot before it is sent, so that it looks at the batch's failures once
        # it is its turn: the request that held the slot may have failed.
        async with slots:
            if endpoint.origin in down:
                return WebhookFailed(f"POST {endpoint.shown}: not sent, an earlier request of this batch to this "
                                     f"host failed: {down[endpoint.origin]}")
            headers = request_headers(event, self._key, int(time.time()))
            if isinstance(headers, PermanentError):
                return headers
            target = self._target(endpoint)
            if target.headers:
                headers.update(target.headers)
            try:
                async with self._client().post(target.url, data=event.payload, headers=headers,
                                               allow_redirects=False, proxy=target.proxy,
                                               proxy_headers=target.proxy_headers) as response:
                    body = await _read_some(response)
            except TimeoutError as exc:   # aiohttp's timeouts are asyncio's TimeoutError too
                what = "no connection" if isinstance(exc, aiohttp.ConnectionTimeoutError) else "no answer"
                down[endpoint.origin] = f"{what} within {self.timeout:g}s"
                return WebhookFailed(f"POST {endpoint.shown}: {what} within the publish timeout of {self.timeout:g}s")
            except aiohttp.ClientError as exc:
                why = f"{type(exc).__name__}: {endpoint.redact(printable(str(exc).strip())) or 'failed'}"
                down[endpoint.origin] = why
                return WebhookFailed(f"POST {endpoint.shown}: {why}")
        return _outcome(endpoint, response, body)


@dataclass(frozen=True)
class _Target:
    """An endpoint as aiohttp takes it, worked out once: its URL without user and password (as
    written, only what cannot stand in a request line percent-encoded); the headers those add
    (Authorization, and Proxy-Authorization for an http:// endpoint behind a proxy that has
    them); the proxy the environment names for it, and the headers of its CONNECT (https://)."""

    url: URL
    headers: dict[str, str]
    proxy: URL | None
    proxy_headers: CIMultiDict[str] | None

    @classmethod
    def of(cls, endpoint: Endpoint) -> _Target:
        parts = urlsplit(endpoint.url)
        headers = {}
        if authorization := _basic_auth(parts.username, parts.password):
            headers["Authorization"] = authorization
        origin = str(URL(f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"))   # an IDN host as IDNA
        rest = urlunsplit(("", "", parts.path, parts.query, ""))
        url = URL(origin.rstrip("/") + quote(rest, safe="!$%&'()*+,/:;=?@[]~"), encoded=True)
        proxy, proxy_headers = None, None
        proxies = urllib.request.getproxies()
        named = proxies.get(parts.scheme.lower()) or proxies.get("all")
        if named and not urllib.request.proxy_bypass(parts.hostname or ""):
            given = urlsplit(named if "://" in named else "http://" + named)
            proxy = URL(urlunsplit(given._replace(netloc=given.netloc.rpartition("@")[2])))
            if proxy_auth := _basic_auth(given.username, given.password):
                if parts.scheme.lower() == "https":   # said to the proxy alone, in the tunnel's CONNECT
                    proxy_headers = CIMultiDict({"Proxy-Authorization": proxy_auth})
                else:                                 # the request itself goes to the proxy
                    headers["Proxy-Authorization"] = proxy_auth
        return cls(url, headers, proxy, proxy_headers)


def _basic_auth(user: str | None, password: str | None) -> str | None:
    """The Basic auth header value of a URL's (percent-encoded) user and password, if it has them."""
    if user is None and password is None:
        return None
    pair = f"{unquote(user or '')}:{unquote(password or '')}".encode()
    return "Basic " + base64.b64encode(pair).decode()


async def _read_some(response: aiohttp.ClientResponse) -> bytes:
    """Up to BODY_READ bytes of the body (a longer one is cut, and its connection not reused)."""
    body = b""
    while len(body) < BODY_READ:
        chunk = await response.content.readany()
        if not chunk:
            break
        body += chunk
    return body


def _outcome(endpoint: Endpoint, response: aiohttp.ClientResponse, body: bytes) -> BaseException | None:
    status = response.status
    if 200 <= status < 300:
        return None
    said = f"HTTP {status}{' ' + response.reason if response.reason else ''} from {endpoint.shown}"
    shown = endpoint.redact(_body_shown(body))   # a receiver may echo the request's URL
    if 300 <= status < 400:
        location = response.headers.get("location", "")
        # Where it points, as a log line names a URL: no credentials, no query.
        location = endpoint.redact(printable(_shown(location) if "://" in location else location.split("?")[0]))
        return WebhookFailed(f"{said}: redirects are not followed (to {location or 'nowhere'}); "
                             "point the sink at the final URL", status)
    if 400 <= status < 500 and status not in RETRYABLE_4XX:
        return WebhookRefused(f"{said}: {shown}" if shown else said, status)
    retry_after = retry_after_seconds(response.headers.get("retry-after"))
    if retry_after is not None:
        said += f" (Retry-After {math.ceil(retry_after)}s)"
    return WebhookFailed(f"{said}: {shown}" if shown else said, status, retry_after)


def _body_shown(body: bytes) -> str:
    """The first bytes of a response body, on one line."""
    text = body[:BODY_SHOWN].decode("utf-8", "replace").strip()
    text = " ".join(text.split())
    return printable(text) + ("..." if len(body) > BODY_SHOWN else "")

