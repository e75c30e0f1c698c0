"""The HTTP edge of a real manager process (uvicorn as `orch manager` runs it), over raw sockets:
request heads are bounded in size, in header count and in time (a slowloris is cut); HEAD
answers on GET routes; every console file carries the console's CSP and frame headers; the API
docs pages are off by default, and pinned with subresource integrity when on."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import Cluster

KiB = 1 << 10
MiB = 1 << 20


async def _send(port: int, head: bytes, *, chunk: int = 64 * KiB, wait: float = 10) -> bytes:
    """Write ``head`` (in chunks, as far as the server lets it) and read what comes back until
    the server closes (or ``wait`` seconds). A reset connection gives what was read so far."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    got = b""
    try:
        try:
            for i in range(0, len(head), chunk):
                writer.write(head[i : i + chunk])
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        try:
            async with asyncio.timeout(wait):
                while part := await reader.read(65536):
                    got += part
        except (ConnectionError, OSError):
            pass
    finally:
        writer.close()
    return got


def _status(answer: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", answer)
    return int(m.group(1)) if m else None


def _get(*headers: bytes, path: bytes = b"/healthz") -> bytes:
    lines = [b"GET " + path + b" HTTP/1.1", b"Host: t", *headers, b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _refused(answer: bytes) -> bool:
    """431, or the connection closed without an answer: never a 2xx."""
    return _status(answer) in (431, None)


async def test_a_head_within_the_limits_is_served(cluster: Cluster) -> None:
    await cluster.start_manager()
    assert cluster.api_port is not None
    # 90 headers, 20 KiB in all: under 100 and 32 KiB.
    headers = [b"X-F%d: %s" % (i, b"v" * 220) for i in range(90)]
    answer = await _send(cluster.api_port, _get(*headers))
    assert _status(answer) == 200, answer[:200]


OVERSIZE: dict[str, Callable[[], bytes]] = {
    "16 MiB of headers": lambda: _get(*(b"X-F%d: %s" % (i, b"v" * 1000) for i in range(16 * KiB))),
    "one 4 MiB header line": lambda: _get(b"X-Big: " + b"v" * (4 * MiB)),
    "one 40 KiB header line": lambda: _get(b"X-Big: " + b"v" * (40 * KiB)),
    "a 40 KiB query": lambda: _get(path=b"/healthz?" + b"a" * (40 * KiB)),
    # Just over 32 KiB in one write: parsed whole, then measured exactly, before the app.
    "33 KiB of headers": lambda: _get(*(b"X-F%d: %s" % (i, b"v" * 500) for i in range(66))),
}


@pytest.mark.parametrize("what", list(OVERSIZE))
async def test_an_oversize_head_is_refused_quickly(cluster: Cluster, what: str) -> None:
    await cluster.start_manager()
    assert cluster.api_port is not None
    head = OVERSIZE[what]()
    started = time.monotonic()
    answer = await _send(cluster.api_port, head)
    took = time.monotonic() - started
    assert _refused(answer), f"{what}: {answer[:200]!r}"
    assert took < 3, f"{what}: refused after {took:.1f} s"
    print(f"{what}: status {_status(answer)} in {took * 1000:.0f} ms")


async def test_too_many_headers_are_refused(cluster: Cluster) -> None:
    await cluster.start_manager()
    assert cluster.api_port is not None
    answer = await _send(cluster.api_port, _get(*(b"X-F%d: v" % i for i in range(200))))
    assert _status(answer) == 431, answer[:200]
    assert b"application/problem+json" in answer
    assert b"more than 100 header fields" in answer


async def test_endless_chunked_trailers_end_the_connection(cluster: Cluster) -> None:
    # A GET whose chunked body never ends in a trailer line that grows: the parser would buffer
    # it whole, and the connection would be read for as long as bytes come.
    await cluster.start_manager()
    assert cluster.api_port is not None
    head = b"GET /healthz HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: "
    started = time.monotonic()
    answer = await _send(cluster.api_port, head + b"v" * (4 * MiB), wait=10)
    took = time.monotonic() - started
    assert _status(answer) in (200, 431, None), answer[:200]
    assert took < 3, f"the connection was kept {took:.1f} s"


async def _answer(reader: asyncio.StreamReader) -> int | None:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    await reader.readexactly(length)
    return _status(head)


async def test_a_body_sent_after_its_answer_keeps_the_connection(cluster: Cluster) -> None:
    # A GET with a body (httpx sends json={} so), the body in a packet of its own that arrives
    # after the answer: the client reuses the connection, which must still be there.
    await cluster.start_manager()
    assert cluster.api_port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.api_port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n")
        assert await _answer(reader) == 200
        writer.write(b"{}")
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert await _answer(reader) == 200
    finally:
        writer.close()


async def test_a_body_that_never_ends_after_its_answer_ends_the_connection(
    cluster: Cluster,
) -> None:
    await cluster.start_manager(header_timeout="2")
    assert cluster.api_port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.api_port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\nab")
        assert await _answer(reader) == 200
        started = time.monotonic()
        for _ in range(12):  # a byte a second, never the whole body
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(b"x")
                await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1), 1) == b"":
                    break
            except TimeoutError:
                continue
        took = time.monotonic() - started
    finally:
        writer.close()
    assert took < 3.5, f"the connection was kept {took:.1f} s"


async def test_a_refused_pipelined_head_does_not_cut_into_the_answer_before_it(
    cluster: Cluster,
) -> None:
    await cluster.start_manager()
    assert cluster.api_port is not None
    first = b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
    answer = await _send(cluster.api_port, first + _get(*(b"X-F%d: v" % i for i in range(200))))
    assert _status(answer) == 200, answer[:300]
    assert b"431" not in answer.split(b"\r\n\r\n", 1)[0], answer[:300]


async def test_a_slowloris_is_cut_within_the_header_timeout(cluster: Cluster) -> None:
    await cluster.start_manager(header_timeout="2")
    assert cluster.api_port is not None

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
        """One header line a second until the server answers or closes; the seconds it took
        (12 s at most: the connection was kept)."""
        started = time.monotonic()
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
        answer = asyncio.ensure_future(reader.read(65536))
        for i in range(12):
            done, _ = await asyncio.wait([answer], timeout=1)
            if done:
                break
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(b"X-Slow-%d: v\r\n" % i)
                await writer.drain()
        took = time.monotonic() - started
        if not answer.done():
            answer.cancel()
            return took
        try:
            got = answer.result()
        except (ConnectionError, OSError):
            got = b""
        assert got == b"" or _status(got) == 408, got[:200]
        return took

    # A fresh connection.
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.api_port)
    try:
        first = await trickle(reader, writer)
    finally:
        writer.close()
    # A keep-alive connection, after one answered request.
    reader, writer = await asyncio.open_connection("127.0.0.1", cluster.api_port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert _status(head) == 200
        length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
        await reader.readexactly(length)
        second = await trickle(reader, writer)
    finally:
        writer.close()
    print(f"slowloris cut after {first:.1f} s (fresh), {second:.1f} s (keep-alive)")
    # A 2 s timeout, and 1.5 s of margin.
    assert first < 3.5, first
    assert second < 3.5, second

    # Nothing sent at all: closed too, without an answer.
    started = time.monotonic()
    answer = await _send(cluster.api_port, b"", wait=8)
    idle = time.monotonic() - started
    assert answer == b""
    assert idle < 4, idle


async def test_head_answers_on_get_routes(cluster: Cluster) -> None:
    await cluster.start_manager()
    async with cluster.api() as api:
        for path in ("/healthz", "/observers", "/services", "/console"):
            got, head = await api.get(path), await api.head(path)
            assert head.status_code == 200 == got.status_code, (path, head.status_code)
            assert head.content == b""
            assert head.headers["content-type"] == got.headers["content-type"]
            if "content-length" in got.headers:
                assert head.headers["content-length"] == got.headers["content-length"]
        # HEAD needs the token GET needs.
        api.headers.pop("Authorization")
        assert (await api.head("/observers")).status_code == 401
    # Over a raw socket: no body follows the head (the next answer starts right after it).
    assert cluster.api_port is not None
    two = b"HEAD /healthz HTTP/1.1\r\nHost: t\r\n\r\n" + _get()
    answer = await _send(cluster.api_port, two)
    first, _, rest = answer.partition(b"\r\n\r\n")
    assert _status(first) == 200, answer
    assert _status(rest) == 200, answer


CONSOLE = (
    "/console",
    "/console/",
    "/console/static/index.html",
    "/console/static/console.js",
    "/console/static/console.css",
)


async def test_every_console_file_carries_the_csp_and_frame_headers(cluster: Cluster) -> None:
    await cluster.start_manager()
    async with cluster.api() as api:
        for path in (*CONSOLE, "/console/static/nothing.js"):
            for method in ("GET", "HEAD"):
                r = await api.request(method, path)
                assert r.status_code == (404 if "nothing" in path else 200), (method, path)
                csp = r.headers.get("content-security-policy", "")
                assert "frame-ancestors 'none'" in csp, (method, path, csp)
                assert "default-src 'none'" in csp, (path, csp)
                assert r.headers.get("x-frame-options") == "DENY", (method, path)
                assert r.headers.get("x-content-type-options") == "nosniff", (method, path)
                assert r.headers.get("referrer-policy") == "no-referrer", (method, path)
                assert len(r.headers.get_list("content-security-policy")) == 1, path


async def test_the_last_verify_report_is_served_as_a_page_without_scripts(
    cluster: Cluster, tmp_path: Path
) -> None:
    report = tmp_path / "report.html"
    manager = await cluster.start_manager(verify_report=str(report))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{manager.port}") as c:
        missing = await c.get("/verify-report")  # open like the console: no token
        assert missing.status_code == 404
        assert "ORCH_VERIFY_REPORT" in missing.json()["detail"]
        report.write_text("<!doctype html><style>p{}</style><p>verdict</p>")
        r = await c.get("/verify-report")
        assert r.status_code == 200
        assert r.text.endswith("<p>verdict</p>")
        assert r.headers["content-type"].startswith("text/html")
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp
        assert "script-src" not in csp  # no script may run in it
        assert "frame-ancestors 'none'" in csp
        assert (await c.head("/verify-report")).status_code == 200  # how the console asks


async def test_the_api_docs_are_off_by_default_and_pinned_when_on(cluster: Cluster) -> None:
    await cluster.start_manager()
    async with cluster.api() as api:
        assert (await api.get("/docs")).status_code == 404
        assert (await api.get("/redoc")).status_code == 404
    assert cluster.api_port is not None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.api_port}") as c:
        assert (await c.get("/openapi.json")).status_code == 200  # open, documented so
    on = await cluster.start_manager(api_docs="true")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{on.port}") as c:
        for path in ("/docs", "/redoc"):
            r = await c.get(path)
            assert r.status_code == 200, path
            assert r.headers["x-frame-options"] == "DENY"
            tags = re.findall(r"<(?:script|link)\b[^>]*>", r.text)
            external = [t for t in tags if re.search(r"(?:src|href)=\"https?:", t)]
            assert external, r.text
            for tag in external:
                assert re.search(r"@\d+\.\d+\.\d+/", tag), f"{path}: floating version: {tag}"
                assert re.search(r'integrity="sha384-[A-Za-z0-9+/=]{64}"', tag), tag
            assert "fonts.googleapis" not in r.text
