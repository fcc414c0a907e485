"""A real HTTP webhook receiver for the tests: a ThreadingHTTPServer (HTTP/1.1, keep-alive) in a
thread of this process, which checks every request's Standard Webhooks signature by the spec (its
own few lines, not the sink's code), answers as the test tells it (``answer``), and records what
came. ``stop()`` closes the listening socket and every open connection; ``start()`` listens again
on the same port."""

from __future__ import annotations

import base64
import hashlib
import hmac
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Answer", "HttpReceiver", "Request", "spec_signature"]

TOLERANCE = 300   # seconds, the spec's recommendation


def spec_signature(key: bytes, msg_id: str, timestamp: str, body: bytes) -> str:
    """The Standard Webhooks v1 signature, written from the spec."""
    signed = msg_id.encode() + b"." + timestamp.encode() + b"." + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


@dataclass
class Request:
    path: str                          # with its query
    headers: list[tuple[str, str]]     # as received, in order, names as sent
    body: bytes
    verified: bool                     # signature and timestamp good
    at: float = field(default_factory=time.monotonic)
    status: int = 0                    # what the receiver answered

    def header(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k.lower() == name.lower()]
        assert len(found) <= 1, f"header {name} came {len(found)} times"
        return found[0] if found else None

    @property
    def msg_id(self) -> str:
        return self.header("webhook-id") or ""


@dataclass
class Answer:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0                 # seconds before answering (cut short by stop())


class HttpReceiver:
    def __init__(self, key: bytes, *, port: int = 0, max_body: int | None = None) -> None:
        self.key = key
        self.max_body = max_body       # larger bodies get 413, never stored
        self.answer: Callable[[Request], Answer] = lambda _r: Answer()
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.posted_on: set[int] = set()   # the client ports of the connections that carried requests
        self.port = port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def accepted(self) -> list[Request]:
        """Requests answered 2xx with a good signature, in arrival order."""
        with self.lock:
            return [r for r in self.requests if 200 <= r.status < 300 and r.verified]

    def stored(self) -> list[Request]:
        """accepted(), de-duplicated by webhook-id as a receiver should (the first one kept)."""
        seen: set[str] = set()
        out = []
        for r in self.accepted():
            if r.msg_id not in seen:
                seen.add(r.msg_id)
                out.append(r)
        return out

    def start(self) -> HttpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Each answer in one segment, sent at once: with Nagle's algorithm on and the body
            # written after the headers, every answer waited for the client's delayed ACK (40 ms).
            disable_nagle_algorithm = True
            wbufsize = 65536

            def setup(self) -> None:
                super().setup()
                with receiver.lock:
                    receiver._conns.add(self.connection)

            def finish(self) -> None:
                with receiver.lock:
                    receiver._conns.discard(self.connection)
                super().finish()

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                if receiver.max_body is not None and length > receiver.max_body:
                    self.rfile.read(length)
                    self._send(Answer(413, b"payload too large for this receiver"), None)
                    return
                body = self.rfile.read(length)
                request = Request(self.path, list(self.headers.items()), body, receiver._verify(self.headers, body))
                with receiver.lock:
                    receiver.requests.append(request)
                    receiver.posted_on.add(self.client_address[1])
                    receiver.in_flight += 1
                    receiver.most_in_flight = max(receiver.most_in_flight, receiver.in_flight)
                try:
                    answer = receiver.answer(request) if request.verified else Answer(401, b"bad signature")
                    if answer.delay and receiver._stopped.wait(answer.delay):
                        return   # stopped meanwhile: the connection is closed without an answer
                    request.status = answer.status
                    self._send(answer, request)
                finally:
                    with receiver.lock:
                        receiver.in_flight -= 1

            def _send(self, answer: Answer, request: Request | None) -> None:
                self.send_response(answer.status)
                for k, v in answer.headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)

        class Server(ThreadingHTTPServer):
            allow_reuse_address = True
            daemon_threads = True
            request_queue_size = 128   # not 5: the sink opens 16 connections at once

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass   # a client gone before its answer (a timeout test): nothing to print

        self._stopped.clear()
        self._server = Server(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="http-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and close every open connection (requests waiting get no answer)."""
        self._stopped.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def _verify(self, headers: Any, body: bytes) -> bool:
        msg_id, ts, sigs = (headers.get("webhook-id"), headers.get("webhook-timestamp"),
                            headers.get("webhook-signature"))
        if not (msg_id and ts and sigs) or not ts.isdigit() or abs(time.time() - int(ts)) > TOLERANCE:
            return False
        expected = spec_signature(self.key, msg_id, ts, body)
        return any(hmac.compare_digest(expected, s) for s in sigs.split(" "))

    def __enter__(self) -> HttpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
