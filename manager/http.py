"""ASGI middleware of the API: bounded request bodies, and the measure of every request
(latency histogram by route template, and an access line that names who made it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from manager.metrics import ManagerMetrics
from manager.problems import problem

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
