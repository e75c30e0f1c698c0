"""The FastAPI application: routes, error mapping, and the lifespan that owns the connections
and the leader election."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from contracts import __version__
from contracts.errors import Conflict, InvalidInput, NotFound, OrchError, Transient
from manager.api import console, health, observers, services
from manager.http import BodyLimit, Measure
from manager.metrics import ManagerMetrics
from manager.runtime import ManagerRuntime
from manager.settings import ManagerSettings

log = logging.getLogger(__name__)


def create_app(
    settings: ManagerSettings | None = None, *, runtime: ManagerRuntime | None = None
) -> FastAPI:
    """The API. ``runtime`` (built here unless given) is started and stopped with the app."""
    settings = settings or ManagerSettings()
    metrics = (
        runtime.metrics if runtime is not None else ManagerMetrics(refresh=settings.metrics_refresh)
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        rt = runtime or ManagerRuntime(settings, metrics=metrics)
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
    # Outermost: it measures every answer, the body limit's 413 included.
    app.add_middleware(
        Measure,
        metrics=metrics if settings.metrics else None,
        access_log=settings.access_log,
    )
    app.include_router(observers.router)
    app.include_router(services.router)
    app.include_router(health.router)
    app.include_router(console.router)
    app.mount("/console/static", console.static, name="console-static")
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
