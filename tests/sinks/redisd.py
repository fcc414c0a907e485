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

    def __init__(self, directory: Path, args: Sequence[str] = ()) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.args = list(args)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

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
