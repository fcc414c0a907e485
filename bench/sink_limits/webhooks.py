"""Signed webhooks (http://, https://) for bench/sink_drain.py, against the bench's receiver
(bench/sink_limits/webhook_receiver.py, started by hand: see its docstring), the signing secret
in $OUTBOXPG_WEBHOOK_SECRET for the worker and for this module alike.

``run``: httpx alone, no database: ``count`` POSTs of ``payload`` with the headers the sink sends
(the Standard Webhooks signature, computed per request, and the Outbox-* ids), each awaiting its
2xx, with as many requests in flight as the sink allows per host (its default ``connections``),
each lane over an httpx client of one connection, as the sink holds them. ``stored``: the
distinct webhook-ids the receiver took for the run's subject prefix; ``stored_at``: when the
receiver first had each (its clock, this machine's).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import time
import uuid
from urllib.parse import urlsplit

import httpx

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
    async with httpx.AsyncClient() as client:
        return int((await client.get(_count_url(url, prefix))).text)


async def stored_at(url: str, prefix: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as client:
        answer = await client.get(_count_url(url, prefix).replace("/count?", "/times?"))
        return {str(k): float(v) for k, v in answer.json().items()}


async def run(url: str, count: int, payload: bytes) -> float:
    key = _key()
    prefix = f"lim{uuid.uuid4().hex[:8]}"
    subject = f"{prefix}.order.updated"
    next_id = iter(range(1, count + 1))
    one = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    tls = httpx.create_ssl_context()

    async def lane() -> None:
        async with httpx.AsyncClient(limits=one, timeout=30, verify=tls) as client:
            for i in next_id:
                msg_id, ts = f"lim-{i}-{uuid.uuid4()}", str(int(time.time()))
                mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + payload, hashlib.sha256).digest()
                response = await client.post(url, content=payload, headers={
                    "Content-Type": "application/json", "webhook-id": msg_id, "webhook-timestamp": ts,
                    "webhook-signature": "v1," + base64.b64encode(mac).decode(), "Outbox-Id": str(i),
                    "Outbox-Subject": subject, "Outbox-Event-Type": "updated", "Outbox-Aggregate-Type": "order",
                    "Outbox-Aggregate-Id": str(i % INFLIGHT), "Outbox-Attempt": "1"})
                response.raise_for_status()

    t0 = time.monotonic()
    await asyncio.gather(*(lane() for _ in range(INFLIGHT)))
    elapsed = time.monotonic() - t0
    assert await stored(url, prefix) == count
    return count / elapsed
