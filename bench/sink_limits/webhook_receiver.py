"""A webhook receiver for the benchmarks (bench/sink_drain.py --sink http://...): asyncio, one
process, HTTP/1.1 keep-alive; checks each request's Standard Webhooks signature (HMAC-SHA256 over
"id.timestamp.body") and answers 204, or 401. ``GET /count?prefix=P`` answers how many distinct
webhook-ids it took whose Outbox-Subject starts with ``P.`` (bench/sink_limits/webhooks.py's
``stored``); ``GET /times?prefix=P`` a JSON object of those webhook-ids and the Unix time each
first arrived, read as it arrived (``stored_at``: the latency's commit -> stored).

    export OUTBOXPG_WEBHOOK_SECRET="whsec_$(head -c 32 /dev/urandom | base64)"
    .venv/bin/python bench/sink_limits/webhook_receiver.py --port 8099 &
    .venv/bin/python bench/sink_drain.py --sink http://127.0.0.1:8099/hooks

Small on purpose (no framework): the drain and the limit both post to it, so whatever it costs is
the same on both sides of the ratio. Not a production server: see examples/webhook_receiver.py.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import json
import os
import sys
import time
from collections import defaultdict
from urllib.parse import parse_qs, urlsplit

SECRET_VARIABLE = "OUTBOXPG_WEBHOOK_SECRET"


def key_of(secret: bytes) -> bytes:
    """As the sink takes it: whsec_<base64> decoded, any other secret as its bytes."""
    secret = secret.strip()
    if secret.startswith(b"whsec_"):
        text = secret[6:]
        return base64.b64decode(text + b"=" * (-len(text) % 4))
    return secret


class Receiver:
    def __init__(self, key: bytes) -> None:
        self.key = key
        # subject's first token -> webhook-id -> when it first arrived
        self.ids: dict[str, dict[str, float]] = defaultdict(dict)
        self.refused = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                arrived = time.time()
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "GET":
                    parts = urlsplit(target)
                    taken = self.ids.get(parse_qs(parts.query).get("prefix", [""])[0], {})
                    answer = json.dumps(taken).encode() if parts.path == "/times" else str(len(taken)).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
                elif self.verified(headers, body):
                    subject = headers.get("outbox-subject", "")
                    self.ids[subject.split(".", 1)[0]].setdefault(headers["webhook-id"], arrived)
                    writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
                else:
                    self.refused += 1
                    writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    def verified(self, headers: dict[str, str], body: bytes) -> bool:
        msg_id, ts, sig = headers.get("webhook-id"), headers.get("webhook-timestamp"), headers.get("webhook-signature")
        if not (msg_id and ts and sig):
            return False
        mac = hmac.new(self.key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
        expected = "v1," + base64.b64encode(mac).decode()
        return any(hmac.compare_digest(expected, s) for s in sig.split(" "))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8099)
    a = ap.parse_args()
    secret = os.environ.get(SECRET_VARIABLE, "").encode()
    if not secret.strip():
        print(f"webhook_receiver: set ${SECRET_VARIABLE} (the worker's signing secret)", file=sys.stderr)
        return 2
    receiver = Receiver(key_of(secret))
    server = await asyncio.start_server(receiver.serve, a.host, a.port, backlog=1024)
    print(f"listening on http://{a.host}:{server.sockets[0].getsockname()[1]}/", flush=True)
    async with server:
        await server.serve_forever()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(0)
