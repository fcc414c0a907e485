"""A private redis-server for a test (``RedisServer``: started and stopped by its PID, its data in
the test's directory, kept across stop/start by an AOF), and a proxy that lets a command through
and loses its answer (``ReplyLoser``): the case of a publish stored by the server whose
acknowledgement never reaches the worker."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis.asyncio

from outboxpg.embedded import free_port

__all__ = ["RedisServer", "ReplyLoser", "redis_server_binary"]


def redis_server_binary() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed on this machine")
    return exe


class RedisServer:
    """``redis-server`` on a free port of 127.0.0.1, run from ``directory`` with ``args`` (e.g.
    ("--proto-max-bulk-len", "1mb")). Persistence: an AOF fsynced on every write, so that
    stop() and start() keep what it stored."""

    def __init__(self, directory: Path, args: Sequence[str] = (), *, tls: bool = False) -> None:
        """``tls``: TLS only, on ``port``, with a certificate for 127.0.0.1 signed by a CA of its
        own (``ca_file``), made with openssl in ``directory``."""
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.ca_file = directory / "ca.pem"
        if tls:
            self.args = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                         *make_certificates(directory), *self.args]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def tls(self) -> bool:
        return "--tls-port" in self.args

    def client(self, **kw: object) -> redis.asyncio.Redis:
        return redis.asyncio.Redis(host="127.0.0.1", port=self.port, protocol=2, **kw)  # type: ignore[arg-type]

    async def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no",
             "--logfile", str(self.directory / "redis.log"), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise AssertionError(f"redis-server exited with {self.proc.returncode}: {log}")
            if self.tls:
                with contextlib.suppress(OSError):
                    _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                    writer.close()
                    await asyncio.sleep(0.1)
                    if self.proc.poll() is None:
                        return
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(b"PING\r\n")
                answer = await reader.read(100)   # +PONG, or -NOAUTH with a password; b'' if it went away
                writer.close()
                if answer and self.proc.poll() is None:
                    return
            if time.monotonic() > deadline:
                raise AssertionError("redis-server did not take connections within 10 s")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)


def make_certificates(directory: Path) -> list[str]:
    """A CA (ca.pem) and a server certificate for IP 127.0.0.1 signed by it; redis-server's flags."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed on this machine (the TLS test makes its certificates with it)")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    d = str(directory)
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in ([openssl, "req", "-x509", *ec, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem", "-days", "2",
                 "-subj", "/CN=outboxpg test CA"],
                [openssl, "req", *ec, "-keyout", f"{d}/server.key", "-out", f"{d}/server.csr", "-subj", "/CN=127.0.0.1"],
                [openssl, "x509", "-req", "-in", f"{d}/server.csr", "-CA", f"{d}/ca.pem", "-CAkey", f"{d}/ca.key",
                 "-CAcreateserial", "-out", f"{d}/server.pem", "-days", "2", "-extfile", f"{d}/san.ext"]):
        subprocess.run(cmd, check=True, capture_output=True)
    return ["--tls-cert-file", f"{d}/server.pem", "--tls-key-file", f"{d}/server.key", "--tls-ca-cert-file",
            f"{d}/ca.pem"]


class ReplyLoser:
    """A TCP proxy in front of a server: the next ``lose`` answers the server sends are dropped,
    each with its connection (both sides cut), so the client sent a command the server ran and
    never learns so. ``lost`` counts them."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.lose = 0
        self.lost = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        ends = (writer, up_writer)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, answers: bool) -> None:
            try:
                while data := await src.read(65536):
                    if answers and self.lose > 0:
                        self.lose -= 1
                        self.lost += 1
                        for w in ends:
                            w.transport.abort()
                        return
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                for w in ends:
                    w.transport.abort()

        for task in (asyncio.create_task(pump(reader, up_writer, False)),
                     asyncio.create_task(pump(up_reader, writer, True))):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
