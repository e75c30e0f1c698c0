"""The API's HTTP edge: the server's protocol (bounded request heads, read within a time), and
ASGI middleware: bounded request bodies, HEAD answered as GET without a body, and the measure of
every request (latency histogram by route template, and an access line that names who made it)."""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import time
from typing import Any, ClassVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from manager.metrics import ManagerMetrics
from manager.problems import MEDIA_TYPE, problem, problem_of

access = logging.getLogger("manager.access")


class BodyLimit:
    """Read the whole body before the app sees it: over ``limit`` bytes is 413 (whether or not
    the client said its size, chunked or not), not complete within ``timeout`` seconds is 408
    (a slow client holds no worker for long)."""

    def __init__(
        self, app: ASGIApp, *, limit: int, timeout: float, paths: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout
        #: Paths with a limit of their own (a bulk create).
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope["path"], self.limit)
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > limit:
                if int(value) <= self._drain_cap(limit):
                    await self._drain(receive)
                await self._answer(scope, receive, send, 413, limit)
                return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.timeout):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        if message.get("more_body", False):
                            await self._drain(receive, self._drain_cap(limit) - size)
                        await self._answer(scope, receive, send, 413, limit)
                        return
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except TimeoutError:
            await self._answer(scope, receive, send, 408, limit)
            return
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            await problem(422, "the request body is not UTF-8")(scope, receive, send)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _drain_cap(limit: int) -> int:
        return 4 * max(limit, 1 << 20)

    async def _drain(self, receive: Receive, budget: int | None = None) -> None:
        """Read and drop the rest of a body refused as too large, so that a client still
        sending reads the 413 rather than a reset connection. Bounded in bytes and in time:
        past either, the connection is closed on it."""
        left = budget if budget is not None else 1 << 62
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(self.timeout, 2.0)):
                while left > 0:
                    message = await receive()
                    if message["type"] != "http.request":
                        return
                    left -= len(message.get("body", b""))
                    if not message.get("more_body", False):
                        return

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, code: int, limit: int
    ) -> None:
        detail = (
            f"request body larger than {limit} bytes"
            if code == 413
            else f"request body not received within {self.timeout:g} s"
        )
        await problem(code, detail, headers={"Connection": "close"})(scope, receive, send)


class Measure:
    """Time every request; label it by its route template (never by an id in its path)."""

    def __init__(self, app: ASGIApp, *, metrics: ManagerMetrics | None, access_log: bool) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (self.metrics is None and not self.access_log):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        code = 500

        async def sending(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            took = time.perf_counter() - started
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            if self.metrics is not None:
                self.metrics.observe_request(route, scope["method"], code, took)
            if self.access_log:
                client = (scope.get("client") or ("-", 0))[0]
                who = scope.get("state", {}).get("who", "-")
                access.info(
                    "%s %s %d %.1fms %s %s",
                    scope["method"],
                    scope["path"],
                    code,
                    took * 1000,
                    client,
                    who,
                    extra={"who": who},
                )


class HeadAsGet:
    """HEAD is GET without a body: the route of a GET answers it, with the same status and
    headers (Content-Length included); the body is not sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        # A copy: the server reads its own scope's method to know it must send no body.
        inner = {**scope, "method": "GET"}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        try:
            await self.app(inner, receive, sending)
        finally:
            if "route" in inner:  # for the measure, outside
                scope["route"] = inner["route"]


class _Refused(Exception):
    """Raised in a parser callback to stop reading a head that was refused (already answered)."""


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol (the fast C parser) with bounded request heads.

    - The head (request line and headers) must be complete within ``header_timeout`` seconds of
      the connection or of its first byte: a client that trickles it (a slowloris) gets 408 and
      the connection closed; one that sends nothing at all is closed.
    - A head over ``max_header_bytes`` is 431, counted as it arrives (httptools itself buffers a
      header of any size) and measured exactly once complete, before the app runs.
    - More than ``max_headers`` header fields is 431. Chunked trailers count with the head.
    - Between body bytes, no more than ``max_header_bytes`` may arrive that are not body (chunk
      framing, trailers: httptools buffers a trailer of any size too).
    - A request answered before its body was all read (a GET the app never reads the body of,
      one refused with 413) has the header timeout to send the rest, then its connection is
      closed: it is not read on for ever.

    Configure a subclass with :func:`guarded_http` and pass it as ``http=`` to uvicorn.Config."""

    max_header_bytes: ClassVar[int] = 32 << 10
    max_headers: ClassVar[int] = 100
    header_timeout: ClassVar[float] = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        #: Between the end of one request (or the connection's start) and its next head's end.
        self._in_head = True
        #: Bytes received since then, or since the last body bytes (an upper bound of the head,
        #: or of the framing and trailers after it, that the parser may be buffering).
        self._head_received = 0
        #: The head's exact size and field count so far (from the parser's callbacks).
        self._head_size = 0
        self._head_fields = 0
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._head_received += len(data)
        super().data_received(data)
        if not self._refused and self._head_received > self.max_header_bytes:
            what = "request head" if self._in_head else "chunk framing or trailers"
            self._refuse(431, f"{what} larger than {self.max_header_bytes} bytes")

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # a refusal raised in a callback was answered already
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = self._head_fields = 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_size += len(url)
        self._check()

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        self._head_size += len(name) + len(value) + 4
        self._head_fields += 1
        self._check()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_received = 0
        self._disarm()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._head_received = 0
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_received = 0
        self._disarm()  # the rest of a body that came after its answer: it is all here

    def on_response_complete(self) -> None:
        if not self._in_head:
            # Answered before its body was all read (a GET with a body, a 413): the rest may
            # still come, on a connection the client may reuse, but within the header timeout.
            self._arm()
        super().on_response_complete()

    def _check(self) -> None:
        if self._head_fields > self.max_headers:
            self._refuse(431, f"more than {self.max_headers} header fields")
        elif self._head_size > self.max_header_bytes:
            self._refuse(431, f"request head larger than {self.max_header_bytes} bytes")
        else:
            return
        raise _Refused  # stop the parser: nothing more of this connection is read

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._refused:
            return
        if not self._in_head:
            if self.cycle is not None and self.cycle.response_complete:
                self.transport.close()  # the body of an answered request never ended
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self._arm()  # a head pipelined behind a response on its way: judged after it
            return
        if self._head_received:
            self._refuse(408, f"request head not received within {self.header_timeout:g} s")
        else:
            self.transport.close()  # a connection that sent nothing: nothing to answer

    def _refuse(self, status: int, detail: str) -> None:
        """Answer a problem document outside the app (the head never became a request), then
        close."""
        self._refused = True
        self._disarm()
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # Pipelined behind a response on its way: an answer now would cut into it. That
            # response ends the connection; nothing more is read.
            self.cycle.keep_alive = False
            self.transport.pause_reading()
            return
        phrase = http.HTTPStatus(status).phrase
        body = json.dumps(problem_of(status, detail)).encode()
        head = (
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: {MEDIA_TYPE}\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def guarded_http(
    *, max_header_bytes: int, max_headers: int, header_timeout: float
) -> type[GuardedHttpTools]:
    """A :class:`GuardedHttpTools` with these limits (uvicorn makes the protocol from a class)."""
    return type(
        "GuardedHttpTools",
        (GuardedHttpTools,),
        {
            "max_header_bytes": max_header_bytes,
            "max_headers": max_headers,
            "header_timeout": header_timeout,
        },
    )
