"""A webhook receiver for ``outboxpg-worker --sink http://...``: verifies each request's Standard
Webhooks signature, handles each event once (by webhook-id) and prints it.

    echo "whsec_$(head -c 32 /dev/urandom | base64)" > secret      # the same file for the worker
    python3 examples/webhook_receiver.py --port 8000 --secret-file secret
    outboxpg-worker --dsn ... --sink http://127.0.0.1:8000/hooks --webhook-secret-file secret

Answers: 204 for an event verified and handled, or handled before (the worker sends an event again
when an answer was lost: same webhook-id); 401 for a missing or wrong signature, or a timestamp
more than 5 minutes off; 413 for a body over --max-body (the worker dead-letters the event). The
signature is checked with the Standard Webhooks reference library (pip install standardwebhooks):
a ``whsec_...`` secret as it is, any other secret as its raw bytes, as the worker takes it.
Outbox headers come percent-encoded where they are not plain ASCII; the row's own headers as
``Outbox-Header-<name>``. ``--record FILE`` appends every 2xx request as a JSON line. Stdlib
HTTP server, one thread per connection: an example, not a production server.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO
from urllib.parse import unquote

from standardwebhooks import Webhook, WebhookVerificationError

ROW_HEADER = "outbox-header-"


def shown(text: str) -> str:
    return text if text.isprintable() else repr(text)


class Receiver:
    def __init__(self, webhook: Webhook, max_body: int, record: BinaryIO | None, quiet: bool) -> None:
        self.webhook, self.max_body, self.record, self.quiet = webhook, max_body, record, quiet
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def handle(self, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        try:
            # Checks the three webhook-* headers, the timestamp (5 minutes either way) and the
            # signature over "id.timestamp.body", the body as received (before any JSON parsing).
            self.webhook.verify(body, headers, json_parse=False)
        except WebhookVerificationError as exc:
            return 401, f"signature not verified: {exc}".encode()
        msg_id = headers["webhook-id"]
        # Requests come on threads of their own: the line is printed under the lock too, since
        # print() writes the text and its newline apart, and two requests' lines would interleave.
        with self.lock:
            duplicate = msg_id in self.seen
            self.seen.add(msg_id)
            if self.record is not None:
                self.record.write(json.dumps({"headers": headers, "body": base64.b64encode(body).decode(),
                                              "duplicate": duplicate}).encode() + b"\n")
                self.record.flush()
            if not self.quiet:
                event = {k: unquote(v) for k, v in headers.items() if k.startswith("outbox-")}
                print(f"{'duplicate' if duplicate else 'event'} {shown(unquote(msg_id))} "
                      f"{shown(event.get('outbox-subject', ''))} "
                      f"{shown(event.get('outbox-aggregate-type', ''))}/{shown(event.get('outbox-aggregate-id', ''))} "
                      f"id={event.get('outbox-id')} attempt={event.get('outbox-attempt')} "
                      f"{shown(body[:200].decode('utf-8', 'replace'))}", flush=True)
        return 204, b""


def handler_for(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"      # keep-alive: the worker reuses its connections
        disable_nagle_algorithm = True     # answers go out at once
        wbufsize = 65536                   # each answer in one write

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > receiver.max_body:
                self.rfile.read(length)
                self.answer(413, f"body of {length} bytes over this receiver's {receiver.max_body}".encode())
                return
            body = self.rfile.read(length)
            headers = {k.lower(): v for k, v in self.headers.items()}
            self.answer(*receiver.handle(headers, body))

        def answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog: the worker opens up to --sink-option connections (16) at once; with
    # socketserver's default of 5, the connections over it wait for a SYN retransmission (1 s).
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):   # a client gone before its answer: no news
            super().handle_error(request, client_address)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--secret-file", help="the signing secret (default: $WEBHOOK_SECRET)")
    p.add_argument("--max-body", type=int, default=1024 * 1024, help="larger bodies get 413")
    p.add_argument("--record", help="append each 2xx request to this file as a JSON line")
    p.add_argument("--quiet", action="store_true", help="print no line per event")
    args = p.parse_args()
    if args.secret_file:
        secret = open(args.secret_file, "rb").read().strip()
    else:
        secret = os.environ.get("WEBHOOK_SECRET", "").strip().encode()
    if not secret:
        print("webhook_receiver: no secret: --secret-file or $WEBHOOK_SECRET", file=sys.stderr)
        return 2
    # whsec_<base64> as the library takes it; any other secret is the key's raw bytes.
    webhook = Webhook(secret.decode() if secret.startswith(b"whsec_") else secret)
    record = open(args.record, "ab") if args.record else None
    server = Server((args.host, args.port), handler_for(Receiver(webhook, args.max_body, record, args.quiet)))
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"listening on http://{args.host}:{server.server_address[1]}/", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
