"""The API's HTTP edge: the server's protocol (bounded request heads, read within a time, a
bounded number of connections, answers taken within a time), and ASGI middleware: the token of a
request with a body checked before the body is read, bounded request bodies, relative redirects,
HEAD answered as GET without a body, and the measure of every request (latency histogram by
route template, and an access line that names who made it)."""

from __future__ import annotations

import asyncio
import contextlib
import http
import json
import logging
import time
from typing import Any, ClassVar
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orch_manager.auth import Authenticator
from orch_manager.metrics import ManagerMetrics
from orch_manager.problems import MEDIA_TYPE, problem, problem_of

access = logging.getLogger("orch_manager.access")
log = logging.getLogger(__name__)

#: Methods whose body nothing reads (the body limit lets them through; no route takes one).
BODILESS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value)
    return None


def bearer(scope: Scope) -> str | None:
    """The token of ``Authorization: Bearer …``, as FastAPI's HTTPBearer reads it."""
    raw = _header(scope, b"authorization")
    if raw is None:
        return None
    scheme, _, token = raw.decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def _declared_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


async def drain(receive: Receive, *, budget: int, timeout: float) -> None:
    """Read and drop up to ``budget`` bytes of a body refused before it was read (nothing of it
    is kept), so that a client still sending reads the answer rather than a reset connection.
    Past the budget or the time, the connection is closed on it."""
    left = budget
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            while left > 0:
                message = await receive()
                if message["type"] != "http.request":
                    return
                left -= len(message.get("body", b""))
                if not message.get("more_body", False):
                    return


class TokenFirst:
    """The token of a request with a body is checked before a byte of the body is read: without
    a known token it is 401, the body never parsed nor kept (the route's own check, later, says
    403 for a token without the role). What a client sends of a body within ``limit`` is read and
    dropped first (within ``min(timeout, 2)`` s), so that it reads the 401 rather than a reset; a
    body declared larger is not read at all, nor one that waits for ``100 Continue`` (it never
    comes: such a client sends no body). Every route that takes a body needs a token, so this
    refuses nothing the routes would let in."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        auth: Authenticator,
        limit: int,
        timeout: float,
        paths: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.auth = auth
        self.limit = limit
        self.timeout = timeout
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] in BODILESS
            or not self.auth.enabled
            or self.auth.identify(bearer(scope)) is not None
        ):
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope["path"], self.limit)
        declared = _declared_length(scope)
        waits = (_header(scope, b"expect") or b"").lower() == b"100-continue"
        if not waits and (declared is None or declared <= limit):
            await drain(receive, budget=limit, timeout=min(self.timeout, 2.0))
        await problem(
            401,
            "a valid API token is needed (Authorization: Bearer …)",
            headers={"WWW-Authenticate": "Bearer", "Connection": "close"},
        )(scope, receive, send)


def relative(location: str) -> str:
    """A Location on this server, whatever Host the request named: its path and query only,
    one leading slash (``//host`` and ``/\\host`` would name another host to a browser)."""
    parts = urlsplit(location)
    path = "/" + parts.path.lstrip("/\\")
    return f"{path}?{parts.query}" if parts.query else path


class RelativeRedirects:
    """Every redirect's Location is relative: Starlette builds an absolute one from the
    request's Host header (``/observers/`` → ``http://<Host>/observers``), which a client sent;
    a relative one leads to this server whatever Host said."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and 300 <= message["status"] < 400:
                message = {
                    **message,
                    "headers": [
                        (k, relative(v.decode("latin-1")).encode("latin-1"))
                        if k.lower() == b"location"
                        else (k, v)
                        for k, v in message.get("headers", [])
                    ],
                }
            await send(message)

        await self.app(scope, receive, sending)


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
        if scope["type"] != "http" or scope["method"] in BODILESS:
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
        """The rest of a body refused as too large, read and dropped (see :func:`drain`)."""
        left = budget if budget is not None else 1 << 62
        await drain(receive, budget=left, timeout=min(self.timeout, 2.0))

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
    - Any byte between requests starts the head's clock, not only the first byte of a request
      line: llhttp skips the empty lines (CRLF) before one without a callback, and uvicorn stops
      its keep-alive timer on any byte, so a connection that sent a CRLF after an answer was
      held for ever.
    - An answer the client does not take (the write buffer over its high-water mark for
      ``send_timeout`` seconds) ends the connection: a client that never reads holds no task.
    - At most ``max_connections`` connections at once in this process: one past it is answered
      503 and closed before anything of it is read.

    Configure a subclass with :func:`guarded_http` and pass it as ``http=`` to uvicorn.Config."""

    max_header_bytes: ClassVar[int] = 32 << 10
    max_headers: ClassVar[int] = 100
    header_timeout: ClassVar[float] = 10.0
    send_timeout: ClassVar[float] = 30.0
    max_connections: ClassVar[int] = 1000

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
        self._send_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            self._warn_full()
            self._refuse(503, f"more than {self.max_connections} connections open; try again")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._head_received += len(data)
        super().data_received(data)
        if (
            self._in_head
            and not self._refused
            and (self.cycle is None or self.cycle.response_complete)
        ):
            # Bytes after an answer that began no request (a CRLF calls no callback), and
            # uvicorn's keep-alive timer stopped on them: the head's clock starts.
            self._arm()
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

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout, self._send_late)

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        super().resume_writing()

    def _send_late(self) -> None:
        """The client took nothing of an answer for ``send_timeout`` s: cut (a close would wait
        for a buffer that never drains)."""
        self._send_timer = None
        self.transport.abort()

    #: When a refused connection was last logged (one warning a minute, not one a connection).
    _full_warned: ClassVar[float] = -float("inf")

    def _warn_full(self) -> None:
        now = time.monotonic()
        if now - GuardedHttpTools._full_warned >= 60:
            GuardedHttpTools._full_warned = now
            log.warning(
                "refusing connections: %d open, ORCH_MAX_CONNECTIONS is %d (warned once a minute)",
                len(self.connections) - 1,
                self.max_connections,
            )

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
    *,
    max_header_bytes: int,
    max_headers: int,
    header_timeout: float,
    send_timeout: float = GuardedHttpTools.send_timeout,
    max_connections: int = GuardedHttpTools.max_connections,
) -> type[GuardedHttpTools]:
    """A :class:`GuardedHttpTools` with these limits (uvicorn makes the protocol from a class)."""
    return type(
        "GuardedHttpTools",
        (GuardedHttpTools,),
        {
            "max_header_bytes": max_header_bytes,
            "max_headers": max_headers,
            "header_timeout": header_timeout,
            "send_timeout": send_timeout,
            "max_connections": max_connections,
        },
    )


def room_for(connections: int) -> None:
    """Raise this process's open-file limit (its soft limit, up to the hard one) so that
    ``connections`` fit beside the database pool, the broker and the files; warn when the hard
    limit is too low (a connection past it fails at accept, not with a 503)."""
    import resource

    wanted = connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
            soft = top
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "the open-file limit is %d: ORCH_MAX_CONNECTIONS=%d needs about %d (ulimit -n)",
            soft,
            connections,
            wanted,
        )
