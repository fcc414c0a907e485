"""Signed webhooks (http://, https://) for bench/sink_drain.py, against the bench's receiver
(bench/sink_limits/webhook_receiver.py, started by hand: see its docstring), the signing secret
in $OUTBOXPG_WEBHOOK_SECRET for the worker and for this module alike.

``run``: aiohttp's client alone, no database: ``count`` POSTs of ``payload`` with the headers the
sink sends (the Standard Webhooks signature, computed per request, and the Outbox-* ids), each
awaiting its 2xx, with as many requests in flight as the sink allows per host (its default
``connections``), over one session as the sink holds it (a TCPConnector keeping that many
connections to the host, no trust_env, no cookies, no redirects, the body read). ``stored``: the
distinct webhook-ids the receiver took for the run's subject prefix; ``stored_at``: when the
receiver first had each (its clock, this machine's).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import ssl
import time
import uuid
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from outboxpg.sinks.webhooks import DEFAULT_CONNECTIONS

WORKER_ARGS: list[str] = []     # the worker reads the secret from $OUTBOXPG_WEBHOOK_SECRET
INFLIGHT = DEFAULT_CONNECTIONS


def _key() -> bytes:
    secret = os.environ.get("OUTBOXPG_WEBHOOK_SECRET", "").strip().encode()
    if not secret:
        raise SystemExit("bench/sink_limits/webhooks.py: set $OUTBOXPG_WEBHOOK_SECRET, as for the worker")
    if secret.startswith(b"whsec_"):
        text = secret[6:]
        return base64.b64decode(text + b"=" * (-len(text) % 4))
    return secret


def _count_url(url: str, prefix: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/count?prefix={prefix}"


async def stored(url: str, prefix: str) -> int:
    async with aiohttp.ClientSession() as client, client.get(_count_url(url, prefix)) as answer:
        return int(await answer.text())


async def stored_at(url: str, prefix: str) -> dict[str, float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as client, \
            client.get(_count_url(url, prefix).replace("/count?", "/times?")) as answer:
        return {str(k): float(v) for k, v in (await answer.json(content_type=None)).items()}   # sent as no type


async def run(url: str, count: int, payload: bytes) -> float:
    key = _key()
    prefix = f"lim{uuid.uuid4().hex[:8]}"
    subject = f"{prefix}.order.updated"
    next_id = iter(range(1, count + 1))
    target = URL(url)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=INFLIGHT, ssl=ssl.create_default_context())
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=30)

    async def lane(client: aiohttp.ClientSession) -> None:
        for i in next_id:
            msg_id, ts = f"lim-{i}-{uuid.uuid4()}", str(int(time.time()))
            mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + payload, hashlib.sha256).digest()
            async with client.post(target, data=payload, allow_redirects=False, headers={
                    "Content-Type": "application/json", "webhook-id": msg_id, "webhook-timestamp": ts,
                    "webhook-signature": "v1," + base64.b64encode(mac).decode(), "Outbox-Id": str(i),
                    "Outbox-Subject": subject, "Outbox-Event-Type": "updated", "Outbox-Aggregate-Type": "order",
                    "Outbox-Aggregate-Id": str(i % INFLIGHT), "Outbox-Attempt": "1"}) as response:
                await response.content.readany()
                response.raise_for_status()

    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False,
                                     cookie_jar=aiohttp.DummyCookieJar()) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(lane(client) for _ in range(INFLIGHT)))
        elapsed = time.monotonic() - t0
    assert await stored(url, prefix) == count
    return count / elapsed
