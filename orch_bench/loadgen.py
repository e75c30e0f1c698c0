"""A lean HTTP/1.1 keep-alive client for load: general-purpose clients spend more CPU per
request than the API under test does, on the same two cores."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any


class RawClient:
    def __init__(self, port: int, token: str | None = None) -> None:
        self.port = port
        self._auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
        if self._writer is None or self._reader is None or self._reader.at_eof():
            # New, or the server closed an idle keep-alive connection.
            self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self._reader is not None
        data = json.dumps(body).encode()
        self._writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{self._auth}Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        head = await self._reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return status, await self._reader.readexactly(length)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


async def create_for(
    port: int,
    seconds: float,
    *,
    token: str | None = None,
    clients: int,
    body: Callable[[int, int], dict[str, Any]],
    progress: Callable[[], None] | None = None,
) -> tuple[int, float, list[float]]:
    """POST /observers from ``clients`` connections for ``seconds``.

    Returns (created, elapsed seconds, latencies)."""
    stop_at = time.monotonic() + seconds
    created = 0
    latencies: list[float] = []

    async def one(c: int) -> None:
        nonlocal created
        client = RawClient(port, token)
        i = 0
        try:
            while time.monotonic() < stop_at:
                t = time.perf_counter()
                status, text = await client.post("/observers", body(c, i))
                if status != 201:
                    raise RuntimeError(f"create failed: {status} {text[:200]!r}")
                latencies.append(time.perf_counter() - t)
                created += 1
                i += 1
                if progress is not None and created % 100 == 0:
                    progress()
        finally:
            await client.close()

    began = time.monotonic()
    await asyncio.gather(*(one(c) for c in range(clients)))
    return created, time.monotonic() - began, latencies
