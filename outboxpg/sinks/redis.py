"""Redis Streams: ``outboxpg-worker --sink redis://[user:password@]host[:port][/db]?...`` (``rediss://``
for TLS), through redis-py's asyncio client (extra ``redis``).

Where. Each event is one entry, ``XADD``-ed into the stream named by its subject
(``outbox.order.created``), or with ``stream=NAME`` into that one stream for every subject.

The entry's fields, in this order:

    msg_id                  the event's identity (the same on every retry; deduplicate on it)
    subject                 the event's subject
    Outbox-Id               the row's id: increasing in stream order per aggregate (not an identity)
    Outbox-Event-Type, Outbox-Aggregate-Type, Outbox-Aggregate-Id
    Outbox-Attempt          the attempt that stored it, from 1
    <name>                  one per row header (traceparent, Outbox-Replay-Of, ...), as named
    payload                 the stored JSON text, as bytes

The Outbox-* fields are named and valued as the NATS headers (docs/reference/headers.md). A row
header named like one of the fields above, in any case, is not written (a consumer finds each of
the sink's own fields once, with the sink's value).

De-duplication. A retried publish (after a lost reply, a timeout, a crash after the XADD) must
not store an event twice. Every XADD goes through one Lua script, which Redis runs atomically:
it looks up the key ``<dedupe_prefix><msg_id>``; if present, the event is stored already and the
script answers the entry id recorded there (refreshing the key's expiry); if not, it XADDs and
records the new entry id under the key, expiring ``dedupe_window`` seconds later. The window must
cover the time between an event's first store and its last retry: at least the worker's lease
plus ``outbox_settings.backoff_cap`` (30 s + 5 min by default; the default window is 600 s). Two
events with the same msg_id within the window are one event: the second is not stored again. The
keys take about 200 bytes each (Redis 7.0, a UUID msg_id), as many as the window times the event
rate. With ``maxmemory`` and an evicting policy Redis may drop them early (use ``noeviction`` or a
``volatile-*`` policy with room to spare).

Order per aggregate. A claimed batch's runs (one aggregate's events, in id order) go as one
script call per run, for up to 64 events or 1 MiB at a time; a run longer than that goes in
chunks, each sent only once the one before was answered. The script adds the chunk's events in
order and stops at the first that fails, so Redis can never hold an event without the ones
before it: a script runs atomically (nothing else runs between its commands), and with AOF its
writes are replicated and persisted as one MULTI/EXEC. The script calls of a round (one per run
still going) are written at once on one pooled connection and their answers read in order: one
round trip for a batch of 500 one-event runs. Answers lost with the connection: the round is
sent once more on a new connection (the script finds what the first sending stored); lost again,
each run's event in flight fails and the rest of its run is NotSent, and the worker's retry finds
the stored ones by their msg_id and stores the rest.

Outcomes. Stored (or found stored): None. ``WRONGTYPE`` (the stream's key, or a dedupe key,
holds another type): PermanentError with Redis' reply, dead-lettered at once. An event with a
value larger than the server's ``proto-max-bulk-len`` (read with CONFIG GET at start; 512 MB if
the login may not; or the ``max_bulk_len`` option): PermanentError naming the sizes, never sent
(the server would close the connection). Any other error reply (OOM, READONLY on a replica,
NOPERM, BUSY, LOADING), a connection error or no answer within ``publish_timeout`` (the whole
batch): an ordinary failure, retried with backoff. ``health_problem()`` (the worker's /readyz)
is the last round's failure to reach Redis, until a round is answered again.

Start. PING (unreachable, refused login, a server that does not speak Redis: SinkUnreachable,
exit 3); CONFIG GET proto-max-bulk-len (if allowed); a check script: the login may run scripts
and, on Redis 7 and later (``redis.acl_check_cmd``), XADD to the stream (with ``stream=``; else
to a key in the dedupe namespace) and GET, SET and EXPIRE the dedupe keys; otherwise
SinkRefused (exit 5). Redis Cluster is not supported (the script touches the stream and the
dedupe key in one call, which a cluster takes only within one hash slot): a cluster answers the
check with CROSSSLOT, MOVED or CLUSTERDOWN, which is SinkRefused.

Options (the URL's query, or flags): ``stream`` (one stream for every subject), ``maxlen``
(``XADD MAXLEN ~ N``: approximate trimming of each stream to about N entries; default none),
``dedupe_window`` (seconds, default 600), ``dedupe_prefix`` (default ``outboxpg:dedupe:``),
``max_bulk_len`` (bytes; default: the server's), and redis-py's connection options ``db``,
``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from outboxpg.events import OutboxEvent, runs_of
from outboxpg.relay.publishers import NotSent, PermanentError, not_sent_after
from outboxpg.sinks.base import SinkRefused, SinkSettings, SinkUnreachable, url_options, without_credentials
from outboxpg.text import describe

__all__ = ["RedisSink", "open_sink", "ADD_SCRIPT"]

DEFAULT_DEDUPE_WINDOW = 600
DEFAULT_DEDUPE_PREFIX = "outboxpg:dedupe:"
DEFAULT_MAX_BULK_LEN = 512 * 1024 * 1024   # Redis' default proto-max-bulk-len
CHUNK_EVENTS = 64                           # events per script call, at most
CHUNK_BYTES = 1024 * 1024                   # bytes of fields per script call, at most (one larger event goes alone)

# KEYS: per event, its stream and its dedupe key. ARGV: the window (seconds), MAXLEN ('' for none),
# then per event the number of its field values and names, then those. Returns one item per event
# tried: its entry id, '=' .. the recorded entry id (stored before), or '!' .. the error reply of
# the event that failed, which is the last item.
ADD_SCRIPT = """
local window = ARGV[1]
local maxlen = ARGV[2]
local out = {}
local a = 3
for i = 1, #KEYS, 2 do
  local n = tonumber(ARGV[a])
  local earlier = redis.pcall('GET', KEYS[i + 1])
  if type(earlier) == 'table' then
    out[#out + 1] = '!' .. earlier.err
    return out
  end
  if earlier then
    redis.pcall('EXPIRE', KEYS[i + 1], window)
    out[#out + 1] = '=' .. earlier
  else
    local xadd = {'XADD', KEYS[i]}
    if maxlen ~= '' then
      xadd[3] = 'MAXLEN'
      xadd[4] = '~'
      xadd[5] = maxlen
    end
    xadd[#xadd + 1] = '*'
    for j = a + 1, a + n do
      xadd[#xadd + 1] = ARGV[j]
    end
    local id = redis.pcall(unpack(xadd))
    if type(id) == 'table' then
      out[#out + 1] = '!' .. id.err
      return out
    end
    redis.pcall('SET', KEYS[i + 1], id, 'EX', window)
    out[#out + 1] = id
  end
  a = a + 1 + n
end
return out
"""

# The start check: what the login may do (Redis 7+: redis.acl_check_cmd; -1 where it cannot say).
_CHECK_SCRIPT = """
if redis.acl_check_cmd == nil then return -1 end
if not redis.acl_check_cmd('XADD', KEYS[1], '*', 'f', 'v') then return 'XADD to ' .. KEYS[1] end
if not redis.acl_check_cmd('GET', KEYS[2]) then return 'GET of ' .. KEYS[2] end
if not redis.acl_check_cmd('SET', KEYS[2], 'v', 'EX', '1') then return 'SET of ' .. KEYS[2] end
if not redis.acl_check_cmd('EXPIRE', KEYS[2], '1') then return 'EXPIRE of ' .. KEYS[2] end
return 0
"""

# The fields the sink writes itself, lower-cased: a row header named like one of them gives way.
_TAKEN = frozenset({"msg_id", "subject", "payload", "outbox-id", "outbox-event-type", "outbox-aggregate-type",
                    "outbox-aggregate-id", "outbox-attempt"})
_OWN_OPTIONS = ("stream", "maxlen", "dedupe_window", "dedupe_prefix", "max_bulk_len")
_CLIENT_OPTIONS = ("db", "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
# Error replies (their first word) that no retry can fix.
_PERMANENT_REPLIES = frozenset({"WRONGTYPE"})
_CLUSTER_REPLIES = ("CROSSSLOT", "MOVED", "ASK", "CLUSTERDOWN")


def _positive_int(options: Mapping[str, str], name: str) -> int | None:
    value = options.get(name)
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"redis sink option {name}={value!r}: must be a whole number of at least 1")
    return n


class RedisSink:
    """Redis Streams sink (see the module's docstring). ``duplicates`` counts events found stored
    already (a retry after a lost reply)."""

    run_publishing = f"script-per-run(chunks of {CHUNK_EVENTS})+sequential-chunks"

    def __init__(self, settings: SinkSettings) -> None:
        parts = urlsplit(settings.url.strip())
        if parts.scheme.lower() not in ("redis", "rediss"):
            raise ValueError(f"not a redis:// or rediss:// URL: {without_credentials(settings.url)!r}")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"--sink {parts.scheme}://{parts.hostname}:...: the port is not a number") from None
        if not parts.hostname:
            raise ValueError(f"--sink {parts.scheme}://...: the URL names no host")
        options = url_options(settings.url, settings.options)
        unknown = sorted(set(options) - set(_OWN_OPTIONS) - set(_CLIENT_OPTIONS))
        if unknown:
            raise ValueError(f"redis sink: unknown option {unknown[0]!r}; the options are "
                             f"{', '.join(_OWN_OPTIONS + _CLIENT_OPTIONS)}")
        stream = options.get("stream")
        if stream == "":
            raise ValueError("redis sink option stream=: an empty stream name")
        self.stream = stream
        self.maxlen = _positive_int(options, "maxlen")
        self.dedupe_window = _positive_int(options, "dedupe_window") or DEFAULT_DEDUPE_WINDOW
        self.dedupe_prefix = options.get("dedupe_prefix", DEFAULT_DEDUPE_PREFIX)
        self.max_bulk_len_option = _positive_int(options, "max_bulk_len")
        self.max_bulk_len = self.max_bulk_len_option or DEFAULT_MAX_BULK_LEN
        client_options: dict[str, Any] = {k: options[k] for k in _CLIENT_OPTIONS if k in options}
        if "db" in client_options:
            try:
                client_options["db"] = int(client_options["db"])
            except ValueError:
                raise ValueError(f"redis sink option db={client_options['db']!r}: not a number") from None
        if "ssl_check_hostname" in client_options:
            client_options["ssl_check_hostname"] = client_options["ssl_check_hostname"].lower() in ("1", "true", "yes")
        self.client_options = client_options
        self.url = urlunsplit((parts.scheme.lower(), parts.netloc, parts.path, "", ""))   # credentials kept
        password = parts.password or ""
        self.secrets = sorted({password, unquote(password)} - {""}, key=len, reverse=True)   # never shown
        self.port = port
        self.publish_timeout = settings.publish_timeout
        self.client: redis.asyncio.Redis | None = None
        self.sha: str | None = None
        self.duplicates = 0
        self.closed = False
        self.problem: str | None = None   # the last round's failure to reach Redis, until one is answered
        self._maxlen_arg = b"" if self.maxlen is None else str(self.maxlen).encode()
        self._window_arg = str(self.dedupe_window).encode()

    def describe(self) -> str:
        where = f"stream {self.stream!r}" if self.stream else "a stream per subject"
        trim = f" maxlen~{self.maxlen}" if self.maxlen else ""
        return f"{without_credentials(self.url)} ({where}{trim}, dedupe window {self.dedupe_window}s)"

    def health_problem(self) -> str | None:
        """Why Redis cannot take publishes now, or None (the worker's /readyz): the last round of
        script calls that could not reach it, until one is answered again."""
        return self.problem

    def _text(self, exc: BaseException) -> str:
        """An exception as one line, never with the URL's password."""
        return self._scrub(describe(exc))

    def _scrub(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    async def start(self) -> None:
        if self.client is not None:
            return   # started already
        timeout = self.publish_timeout
        client = redis.asyncio.from_url(
            self.url, protocol=2, socket_timeout=timeout, socket_connect_timeout=min(timeout, 10.0),
            retry=Retry(NoBackoff(), 1), **self.client_options)
        try:
            self.sha = await self._check(client)
        except BaseException:
            with contextlib.suppress(Exception):
                await client.aclose()
            raise
        self.client = client

    async def _check(self, client: redis.asyncio.Redis) -> str:
        """Reach the server, read its limit, check what the login may do; the script's SHA1."""
        try:
            async with asyncio.timeout(self.publish_timeout + 1):
                await client.ping()
        except redis.exceptions.NoPermissionError:
            pass   # reached and logged in; PING itself is not allowed to this login
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            raise SinkUnreachable(self._unreachable(exc)) from None
        if self.max_bulk_len_option is None:
            with contextlib.suppress(redis.exceptions.RedisError):
                found: dict[Any, Any] = await client.config_get("proto-max-bulk-len")
                for value in found.values():
                    self.max_bulk_len = int(value)
        stream_key = self.stream or f"{self.dedupe_prefix}check"
        try:
            denied = await client.eval(_CHECK_SCRIPT, 2, stream_key, f"{self.dedupe_prefix}check")
            sha = str(await client.script_load(ADD_SCRIPT))
        except redis.exceptions.ResponseError as exc:
            first = str(exc).split(" ", 1)[0].upper()
            if first in _CLUSTER_REPLIES or isinstance(exc, redis.exceptions.ClusterError):
                raise SinkRefused(f"Redis Cluster is not supported (the server answered {self._text(exc)})") from None
            if isinstance(exc, redis.exceptions.NoPermissionError) and "key" in str(exc):
                raise SinkRefused(f"the login may not use the key {stream_key!r} or the keys "
                                  f"{self.dedupe_prefix}*: {self._text(exc)}") from None
            raise SinkRefused(f"the login may not run the sink's scripts: {self._text(exc)}") from None
        except (redis.exceptions.RedisError, OSError, TimeoutError) as exc:
            raise SinkUnreachable(self._unreachable(exc)) from None
        if isinstance(denied, bytes):
            raise SinkRefused(f"the login may not {denied.decode(errors='replace')} "
                              "(the Redis ACL; the sink needs XADD, GET, SET, EXPIRE, EVALSHA, SCRIPT LOAD)")
        return sha

    def _unreachable(self, exc: BaseException) -> str:
        if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.AuthorizationError):
            return f"login refused: {self._text(exc)}"
        if isinstance(exc, redis.exceptions.InvalidResponse | redis.exceptions.ResponseError):
            return f"not a Redis server? {self._text(exc)}"
        if isinstance(exc, TimeoutError | redis.exceptions.TimeoutError):
            return f"no answer within {self.publish_timeout:g}s (is it a Redis server?)"
        return self._text(exc)

    async def close(self) -> None:
        self.closed = True
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    # -- publishing ------------------------------------------------------------------------------

    def _fields(self, event: OutboxEvent) -> list[bytes] | PermanentError:
        """The entry's field names and values, flat, or why the event can never be stored."""
        fields = [b"msg_id", event.msg_id.encode(), b"subject", event.subject.encode(),
                  b"Outbox-Id", str(event.id).encode(), b"Outbox-Event-Type", event.event_type.encode(),
                  b"Outbox-Aggregate-Type", event.aggregate_type.encode(),
                  b"Outbox-Aggregate-Id", event.aggregate_id.encode(), b"Outbox-Attempt", str(event.attempt).encode()]
        for name, value in event.headers.items():
            if name.lower() not in _TAKEN:
                fields.append(name.encode())
                fields.append(str(value).encode())
        fields.append(b"payload")
        fields.append(event.payload)
        largest = max(map(len, fields))
        if largest > self.max_bulk_len:
            what = "payload" if largest == len(event.payload) else "a header value"
            return PermanentError(f"{what} of {largest} bytes exceeds the Redis server's proto-max-bulk-len "
                                  f"of {self.max_bulk_len}")
        return fields

    def _keys(self, event: OutboxEvent) -> tuple[str, str]:
        return self.stream or event.subject, self.dedupe_prefix + event.msg_id

    async def publish_batch(self, events: Sequence[OutboxEvent]) -> Sequence[BaseException | None]:
        """Store a claimed batch, in order per aggregate (see the module's docstring)."""
        assert self.client is not None and self.sha is not None, "RedisSink.start() was not awaited"
        outcomes: list[BaseException | None] = [None] * len(events)
        runs = [_Run(positions) for positions in runs_of(events)]
        try:
            async with asyncio.timeout(self.publish_timeout):
                while True:
                    calls: list[tuple[_Run, _Chunk]] = []
                    for run in runs:
                        chunk = None if run.finished else self._next_chunk(events, run, outcomes)
                        if chunk is not None:
                            calls.append((run, chunk))
                    if not calls:
                        break
                    await self._round(events, calls, outcomes)
        except TimeoutError:
            error = TimeoutError(f"no answer from Redis within {self.publish_timeout:g}s")
            for run in runs:
                if not run.finished:
                    self._fail(events, run, error, outcomes)
        finally:
            # Cancelled (or timed out) in the middle of a round: what was not answered is not known stored.
            for run in runs:
                if not run.finished:
                    self._fail(events, run, NotSent("not sent: the batch was cancelled"), outcomes)
        return outcomes

    def _next_chunk(self, events: Sequence[OutboxEvent], run: _Run,
                    outcomes: list[BaseException | None]) -> _Chunk | None:
        """The run's next script call, or None when the run is finished (an event never storable
        ends it here, with its PermanentError)."""
        chunk = _Chunk()
        size = 0
        positions = run.positions
        while run.next + len(chunk.positions) < len(positions) and len(chunk.positions) < CHUNK_EVENTS:
            i = positions[run.next + len(chunk.positions)]
            fields = self._fields(events[i])
            if isinstance(fields, PermanentError):
                if not chunk.positions:
                    self._fail(events, run, fields, outcomes)
                    return None
                break   # the chunk so far goes first; this event fails when it comes next
            event_bytes = sum(map(len, fields))
            if chunk.positions and size + event_bytes > CHUNK_BYTES:
                break
            size += event_bytes
            chunk.positions.append(i)
            stream, dedupe = self._keys(events[i])
            chunk.keys += (stream.encode(), dedupe.encode())
            chunk.values.append(str(len(fields)).encode())
            chunk.values += fields
        if not chunk.positions:
            run.finished = True
            return None
        return chunk

    async def _round(self, events: Sequence[OutboxEvent], calls: list[tuple[_Run, _Chunk]],
                     outcomes: list[BaseException | None]) -> None:
        """One script call per run, all in one pipeline; then each run's outcome."""
        assert self.client is not None and self.sha is not None
        pending = calls
        for _ in range(2):   # a second time only for the calls that found the script not loaded
            head = [b"EVALSHA", self.sha.encode(), b"", self._window_arg, self._maxlen_arg]
            commands = []
            for _run, chunk in pending:
                head[2] = str(len(chunk.keys)).encode()
                commands.append(_pack(head[:2] + [head[2], *chunk.keys] + head[3:] + chunk.values))
            try:
                replies = await self._exchange(commands)
            except (redis.exceptions.RedisError, OSError) as exc:
                error = RuntimeError(f"Redis: {self._text(exc)}")
                self.problem = str(error)
                for run, _chunk in pending:
                    self._fail(events, run, error, outcomes)
                return
            self.problem = None
            reload: list[tuple[_Run, _Chunk]] = []
            for (run, chunk), reply in zip(pending, replies):
                if isinstance(reply, redis.exceptions.NoScriptError):
                    reload.append((run, chunk))   # not run at all: safe to send again
                elif isinstance(reply, BaseException):
                    self._fail(events, run, self._reply_error(reply, events[chunk.positions[0]]), outcomes)
                else:
                    self._answered(events, run, chunk, reply, outcomes)
            if not reload:
                return
            pending = reload
            try:
                self.sha = str(await self.client.script_load(ADD_SCRIPT))
            except (redis.exceptions.RedisError, OSError) as exc:
                error = RuntimeError(f"Redis: loading the script failed: {self._text(exc)}")
                for run, _chunk in pending:
                    self._fail(events, run, error, outcomes)
                return
        for run, _chunk in pending:
            self._fail(events, run, RuntimeError("Redis: the script was unloaded again right after loading"),
                       outcomes)

    async def _exchange(self, commands: list[bytes]) -> list[Any]:
        """Send the packed commands at once on one connection of the pool and read an answer for
        each (an error reply as its ResponseError). Lost on the way (a connection error, no answer
        in time): sent once more on a new connection (the script finds what the first sending
        stored), then the error. redis-py's own pipeline does the same, packing each command
        with far more work per argument."""
        assert self.client is not None
        pool = self.client.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        data = b"".join(commands)
        try:
            for attempt in (1, 2):
                try:
                    await conn.send_packed_command(data)
                    replies: list[Any] = []
                    for _ in commands:
                        try:
                            replies.append(await conn.read_response())
                        except redis.exceptions.ResponseError as exc:
                            replies.append(exc)
                    return replies
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
                    await conn.disconnect()
                    if attempt == 2:
                        raise
            raise AssertionError("unreachable")
        finally:
            await pool.release(conn)

    def _answered(self, events: Sequence[OutboxEvent], run: _Run, chunk: _Chunk, reply: Any,
                  outcomes: list[BaseException | None]) -> None:
        items = list(reply) if isinstance(reply, list) else []
        for n, item in enumerate(items[:len(chunk.positions)]):
            text = item.decode(errors="replace") if isinstance(item, bytes) else str(item)
            if text.startswith("!"):
                self._fail(events, run, self._event_error(text[1:], events[chunk.positions[n]]), outcomes)
                return
            if text.startswith("="):
                self.duplicates += 1
            run.next += 1
        if len(items) < len(chunk.positions):
            self._fail(events, run, RuntimeError(f"Redis: unexpected answer to the script: {reply!r:.200}"), outcomes)
        elif run.next == len(run.positions):
            run.finished = True

    def _event_error(self, reply: str, event: OutboxEvent) -> BaseException:
        stream, _ = self._keys(event)
        text = f"Redis refused the event (stream {stream!r}): {reply}"
        if reply.split(" ", 1)[0].upper() in _PERMANENT_REPLIES:
            return PermanentError(text)
        return RuntimeError(text)

    def _reply_error(self, exc: BaseException, event: OutboxEvent) -> BaseException:
        return self._event_error(self._scrub(str(exc).strip() or type(exc).__name__), event)

    def _fail(self, events: Sequence[OutboxEvent], run: _Run, outcome: BaseException,
              outcomes: list[BaseException | None]) -> None:
        """End the run: ``outcome`` for its next event, NotSent for the ones after it."""
        if run.finished:
            return
        run.finished = True
        i = run.positions[run.next]
        outcomes[i] = outcome
        not_sent_after(events, run.positions[run.next + 1:], events[i].id, outcomes)


def _pack(args: list[bytes]) -> bytes:
    """One command in the Redis protocol (RESP): an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(parts)


class _Run:
    __slots__ = ("positions", "next", "finished")

    def __init__(self, positions: list[int]) -> None:
        self.positions = positions
        self.next = 0          # the first event not yet stored
        self.finished = False


class _Chunk:
    __slots__ = ("positions", "keys", "values")

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.keys: list[bytes] = []
        self.values: list[bytes] = []


def open_sink(settings: SinkSettings) -> RedisSink:
    """The Redis Streams sink for ``settings`` (not started): ValueError for a bad URL or option."""
    return RedisSink(settings)
