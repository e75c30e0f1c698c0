"""The FastAPI application: routes, the one error shape, who may call it, and the lifespan
that starts and stops the manager's runtime."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from contracts import __version__
from manager import problems
from manager.api import console, health, observers, services
from manager.auth import Authenticator, parse_tokens
from manager.http import BodyLimit, Measure
from manager.metrics import ManagerMetrics
from manager.runtime import ManagerRuntime
from manager.settings import ManagerSettings

DESCRIPTION = """Keeps infinite tasks (observers) running exactly once on a pool of services.

Every call but `/healthz`, `/readyz` and `/metrics` needs an API token (`Authorization: Bearer
…`): the `read` role may look, the `admin` role may also change things. Every error is a
problem document (RFC 9457): `type`, `title`, `status`, `detail`, and `errors` with the field
paths of a validation error."""


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
        description=DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.auth = Authenticator(parse_tokens(settings.api_tokens), enabled=settings.auth == "on")
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        timeout=settings.body_timeout,
        paths={"/observers/batch": settings.max_batch_body_bytes},
    )
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
    problems.install(app)

    def openapi() -> dict[str, object]:
        if app.openapi_schema is None:
            runtime_ = getattr(app.state, "orch", None)
            kinds = sorted(runtime_.kinds) if runtime_ is not None else None
            app.openapi_schema = problems.openapi_with_problems(app, kinds)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
