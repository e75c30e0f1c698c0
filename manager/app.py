"""The FastAPI application: routes, error mapping, and the lifespan that owns the connections
and the leader election."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts import __version__
from contracts.errors import Conflict, InvalidInput, NotFound, OrchError, Transient
from manager.api import health, observers, services
from manager.runtime import ManagerRuntime
from manager.settings import ManagerSettings

log = logging.getLogger(__name__)


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


def create_app(
    settings: ManagerSettings | None = None, *, runtime: ManagerRuntime | None = None
) -> FastAPI:
    """The API. ``runtime`` (built here unless given) is started and stopped with the app."""
    settings = settings or ManagerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime or ManagerRuntime(settings)
        await rt.start()
        app.state.orch = rt
        try:
            yield
        finally:
            await rt.stop()

    app = FastAPI(
        title="observer-orchestrator",
        version=__version__,
        description="Keeps infinite tasks (observers) running exactly once on a pool of services.",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.include_router(observers.router)
    app.include_router(services.router)
    app.include_router(health.router)
    _error_handlers(app)
    return app


_STATUS: list[tuple[type[OrchError], int]] = [
    (NotFound, 404),
    (Conflict, 409),
    (InvalidInput, 422),
    (Transient, 503),
]


def _error_handlers(app: FastAPI) -> None:
    for cls, code in _STATUS:

        async def handler(_: Request, exc: Exception, code: int = code) -> JSONResponse:
            if isinstance(exc, Transient):
                log.warning("unavailable: %s", exc)
                return JSONResponse({"detail": "database or broker unavailable, try again"}, 503)
            return JSONResponse({"detail": str(exc)}, status_code=code)

        app.add_exception_handler(cls, handler)
