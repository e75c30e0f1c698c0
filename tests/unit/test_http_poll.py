"""http_poll, safe by default: a capped body, capped redirects, a timeout, allowed hosts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import ValidationError

from observer_service.kinds.http_poll import (
    BodyTooLarge,
    HttpPollParams,
    HttpPollSettings,
    NotAllowed,
    client_for,
    fetch,
)


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    request = await reader.readuntil(b"\r\n\r\n")
    path = request.split(b" ")[1].decode()
    if path.startswith("/hop/") and int(path.rsplit("/", 1)[1]) > 0:
        n = int(path.rsplit("/", 1)[1])
        head, body = f"HTTP/1.1 302 Found\r\nLocation: /hop/{n - 1}\r\n", b""
    elif path == "/big":
        head, body = "HTTP/1.1 200 OK\r\n", b"x" * (3 << 20)
    elif path == "/slow":
        await asyncio.sleep(5)
        head, body = "HTTP/1.1 200 OK\r\n", b"late"
    else:
        head, body = "HTTP/1.1 200 OK\r\n", b"hello"
    writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    writer.close()


@pytest.fixture
async def site() -> AsyncIterator[str]:
    server = await asyncio.start_server(_serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def _get(url: str, **params: object) -> tuple[int, str]:
    p = HttpPollParams.model_validate({"url": url, **params})
    async with client_for(p) as client:
        return await fetch(client, p)


async def test_a_body_is_read_up_to_its_cap(site: str) -> None:
    assert (await _get(f"{site}/small"))[0] == 200
    with pytest.raises(BodyTooLarge):
        await _get(f"{site}/big", max_bytes=1 << 20)


async def test_redirects_are_capped(site: str) -> None:
    assert (await _get(f"{site}/hop/3", max_redirects=5))[0] == 200
    with pytest.raises(httpx.TooManyRedirects):
        await _get(f"{site}/hop/9", max_redirects=5)


async def test_it_gives_up_after_its_timeout(site: str) -> None:
    with pytest.raises(httpx.TimeoutException):
        await _get(f"{site}/slow", timeout=0.3)


async def test_only_allowed_hosts(site: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "example.com, *.example.org")
    assert HttpPollSettings().allows("example.com")
    assert HttpPollSettings().allows("api.example.org")
    assert not HttpPollSettings().allows("example.net")
    with pytest.raises(ValidationError, match="not in ORCH_HTTP_POLL_ALLOW"):
        HttpPollParams.model_validate({"url": site})
    # A redirect off the allowed hosts is refused too.
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "127.0.0.1")
    p = HttpPollParams.model_validate({"url": f"{site}/small"})
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "example.com")
    async with client_for(p) as client:
        with pytest.raises(NotAllowed):
            await fetch(client, p)
