"""A TCP proxy a test owns, in front of a server the worker talks to: it can cut every connection
at once (as a network failure would: whatever it read and had not forwarded is lost), refuse new
connections for a while, and delay what the server sends (a slow server, for the lease tests).

    proxy = TcpProxy("127.0.0.1", server_port)
    port = await proxy.start()          # the worker connects to 127.0.0.1:port
    proxy.latency = 0.3                 # each chunk from the server reaches the client 0.3 s late
    await proxy.cut(refuse_for=1.0)     # drop every connection; new ones are closed at once for 1 s
    await proxy.close()

It runs in the test's event loop: the test must await (not time.sleep) while the worker, another
process, talks through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

__all__ = ["TcpProxy"]

CHUNK = 65536


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.latency = 0.0          # seconds each chunk from the server is held back
        self.cuts = 0               # cut() calls so far
        self.accepted = 0           # connections accepted and forwarded so far
        self._refuse_until = 0.0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None, "TcpProxy.start() was not awaited"
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self.port

    @property
    def open_connections(self) -> int:
        return sum(1 for w in self._writers if not w.is_closing()) // 2

    async def cut(self, refuse_for: float = 0.0) -> None:
        """Drop every connection now (RST, nothing more forwarded); for ``refuse_for`` seconds
        new connections are accepted and closed at once."""
        self.cuts += 1
        self._refuse_until = time.monotonic() + refuse_for
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()
        await asyncio.sleep(0)

    def refuse(self, seconds: float) -> None:
        """Close new connections at once for ``seconds`` (those open stay up)."""
        self._refuse_until = time.monotonic() + seconds

    async def close(self) -> None:
        await self.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._refuse_until:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        self._writers.update((writer, up_writer))
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await asyncio.gather(self._pipe(reader, up_writer, delayed=False),
                                 self._pipe(up_reader, writer, delayed=True))
        finally:
            self._writers.difference_update((writer, up_writer))
            if task is not None:
                self._tasks.discard(task)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, delayed: bool) -> None:
        """Forward ``src`` to ``dst``; from the server, each chunk ``latency`` seconds after it came
        (a latency, not a bandwidth limit: later chunks are read meanwhile)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    return
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(send())
        try:
            with contextlib.suppress(Exception):
                while data := await src.read(CHUNK):
                    if sender.done():
                        break
                    queue.put_nowait((time.monotonic() + (self.latency if delayed else 0.0), data))
                queue.put_nowait((0.0, b""))
                await sender   # what was read before the server closed still goes, in time
        finally:
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
            dst.transport.abort()
