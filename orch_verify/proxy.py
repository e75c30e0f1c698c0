"""A TCP proxy that ``orch verify`` (and the tests) put between one process and one server, to
put that link through a fault.

- ``cut()`` blackholes every connection (bytes stop flowing both ways, sockets stay open), the
  way a network partition looks to both ends; ``heal()`` lets bytes flow again.
- ``reset()`` ends every open connection with a TCP reset, as a restarted pooler or a dropped
  NAT entry does.
- ``refuse()`` closes new connections at once until ``accept()``; ``blip(seconds)`` is a reset
  followed by refusing for ``seconds``: a sub-second database or broker outage.
- ``slow(low, high)`` delays every chunk by a random time in that range, in order, nothing
  lost: a congested or distant link that works; ``slow(0, 0)`` ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
from urllib.parse import urlsplit, urlunsplit


class Proxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._refusing = False
        self._delay = (0.0, 0.0)
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        #: Per open connection, set while its bytes flow (``hold_open``).
        self._open: list[asyncio.Event] = []
        #: Chunks read and waiting to be forwarded.
        self.held = 0

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def cut(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def hold_open(self) -> None:
        """Hold the bytes of the connections open now (sent, not forwarded: on the wire);
        new connections flow."""
        for flowing in self._open:
            flowing.clear()

    def release(self) -> None:
        for flowing in self._open:
            flowing.set()

    def slow(self, low: float, high: float) -> None:
        self._delay = (low, high)

    def refuse(self) -> None:
        self._refusing = True

    def accept(self) -> None:
        self._refusing = False

    def reset(self) -> None:
        """End every open connection (both sides) with a TCP reset."""
        for w in list(self._writers):
            _abort(w)
        self._writers.clear()

    async def blip(self, seconds: float) -> None:
        """Reset what is open and refuse new connections for ``seconds``."""
        self.refuse()
        self.reset()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.accept()

    @property
    def open_connections(self) -> int:
        return len(self._writers) // 2

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing:
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            _abort(writer)
            return
        self._writers.update((writer, up_writer))
        flowing = asyncio.Event()
        flowing.set()
        self._open.append(flowing)
        for a, b in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(a, b, flowing))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        flowing: asyncio.Event | None = None,
    ) -> None:
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                if (delay := self._delay) != (0.0, 0.0):
                    await asyncio.sleep(random.uniform(*delay))
                await self._flowing.wait()
                if flowing is not None and not flowing.is_set():
                    self.held += 1
                    await flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST rather than FIN: linger on, timeout 0."""
    sock = writer.get_extra_info("socket")
    with contextlib.suppress(OSError):
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def via(url: str, proxy: Proxy) -> str:
    """``url`` with its host and port replaced by the proxy's."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")
    creds = netloc[0] + "@" if netloc[1] else ""
    return urlunsplit(parts._replace(netloc=f"{creds}127.0.0.1:{proxy.port}"))
