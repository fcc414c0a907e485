"""The signed webhooks case: the example receiver (examples/webhook_receiver.py) as a process of the
case's own, which verifies every signature with the Standard Webhooks reference library, answers
413 to a body over MAX_BODY and records every request it answered 2xx in a file; the worker
reaches it through a TcpProxy, with the secret in a file given with --webhook-secret-file.
stop() ends the receiver (SIGTERM, by its PID), start() runs it again on the same port; the
record file stays.

read_back: every request the receiver answered 2xx, in arrival order, duplicates included (the
receiver handles a webhook-id once and acknowledges the copies; the sink does not de-duplicate,
so ``dedups`` is False: a request whose answer a cut lost is sent again). The subject is
Outbox-Subject; the row's headers come back under their own names (Outbox-Header-<name>, the
values percent-decoded, as a receiver reads them), beside the Outbox-* ids."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import unquote

import pytest
from conformance import SinkCase, Stored
from proxy import TcpProxy

from outboxpg.sinks.webhook_signing import ROW_HEADER_PREFIX

RECEIVER = Path(__file__).resolve().parents[3] / "examples" / "webhook_receiver.py"
MAX_BODY = 256 * 1024


def stored(line: bytes) -> Stored:
    request = json.loads(line)
    headers: dict[str, str] = {}
    for name, value in request["headers"].items():
        if name.startswith(ROW_HEADER_PREFIX.lower()):
            name = unquote(name[len(ROW_HEADER_PREFIX):])
        headers[name] = unquote(value)
    return Stored(msg_id=request["headers"]["webhook-id"], subject=headers.get("outbox-subject", ""),
                  headers=headers, payload=base64.b64decode(request["body"]))


class Receiver:
    """examples/webhook_receiver.py as a process of the test's own."""

    def __init__(self, directory: Path) -> None:
        self.secret_file = directory / "webhook-secret"
        self.secret_file.write_bytes(b"whsec_" + base64.b64encode(os.urandom(32)) + b"\n")
        self.record = directory / "received.jsonl"
        self.record.touch()
        self.log = directory / "receiver.log"
        self.port = 0
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.p = subprocess.Popen(
                [sys.executable, str(RECEIVER), "--port", str(self.port), "--secret-file", str(self.secret_file),
                 "--max-body", str(MAX_BODY), "--record", str(self.record), "--quiet"],
                stdout=subprocess.PIPE, stderr=log)
        assert self.p.stdout is not None
        line = self.p.stdout.readline().decode()     # "listening on http://127.0.0.1:PORT/"
        assert line.startswith("listening on "), f"the receiver did not start: {line!r} {self.log.read_text()}"
        self.port = int(line.rsplit(":", 1)[1].strip("/\n"))

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        if self.p is not None and self.p.stdout is not None:
            self.p.stdout.close()
        self.p = None


class WebhooksCase(SinkCase):
    name = "webhooks"
    too_large = b'"' + b"x" * MAX_BODY + b'"'
    refused_reason = "HTTP 413"
    dedups = False

    def __init__(self, receiver: Receiver, proxy: TcpProxy) -> None:
        self.receiver = receiver
        self.proxy = proxy
        self.url = f"http://127.0.0.1:{proxy.port}/hooks/outbox"
        self.worker_args = ("--webhook-secret-file", str(receiver.secret_file))

    async def read_back(self) -> list[Stored]:
        return [stored(line) for line in self.receiver.record.read_bytes().splitlines() if line]

    async def stop(self) -> None:
        await asyncio.to_thread(self.receiver.stop)

    async def start(self) -> None:
        await asyncio.to_thread(self.receiver.start)


@pytest.fixture
async def webhooks_case(tmp_path: Path) -> AsyncIterator[WebhooksCase]:
    receiver = Receiver(tmp_path)
    await asyncio.to_thread(receiver.start)
    proxy = TcpProxy("127.0.0.1", receiver.port)
    try:
        await proxy.start()
        yield WebhooksCase(receiver, proxy)
    finally:
        await proxy.close()
        await asyncio.to_thread(receiver.stop)
