"""ASGI middleware of the API: the body limit, and the measure of every request (latency
histogram by route template, and an access line when asked for)."""

from __future__ import annotations

import logging
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from manager.metrics import ManagerMetrics

access = logging.getLogger("manager.access")


class BodyLimit:
    """Refuse request bodies over ``limit`` bytes with 413, whether or not they say their size."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope.get("headers", []):
            if key == b"content-length" and value.isdigit() and int(value) > self.limit:
                await _too_large(self.limit, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge()
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await _too_large(self.limit, send)


class _TooLarge(Exception):
    pass


async def _too_large(limit: int, send: Send) -> None:
    response = JSONResponse({"detail": f"request body larger than {limit} bytes"}, 413)
    await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


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
                access.info(
                    "%s %s %d %.1fms %s",
                    scope["method"],
                    scope["path"],
                    code,
                    took * 1000,
                    client,
                    extra={"who": scope.get("state", {}).get("who")},
                )
