"""The FastAPI application: routes, the one error shape, who may call it, and the lifespan
that starts and stops the manager's runtime."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

from contracts import __version__
from manager import problems
from manager.api import console, health, observers, services, views
from manager.auth import Authenticator, parse_tokens
from manager.http import BodyLimit, HeadAsGet, Measure, RelativeRedirects, TokenFirst
from manager.metrics import ManagerMetrics
from manager.runtime import ManagerRuntime
from manager.settings import ManagerSettings

DESCRIPTION = """Keeps infinite tasks (observers) running exactly once on a pool of services.

Every call but `/healthz`, `/readyz`, `/metrics` (unless `ORCH_METRICS_AUTH=token`),
`/openapi.json` (and the console's files) needs an API token (`Authorization: Bearer …`): the
`read` role may look, the `admin` role may also change things. A request with a body is 401
before its body is read when it has no valid token. Every error is a problem document
(RFC 9457): `type`, `title`, `status`, `detail`, and `errors` with the field paths of a
validation error."""


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
        # Served by _docs below, if at all (FastAPI's pages load a floating version from a CDN).
        docs_url=None,
        redoc_url=None,
    )
    app.state.verify_report = settings.verify_report
    app.state.auth = Authenticator(parse_tokens(settings.api_tokens), enabled=settings.auth == "on")
    body_limits = {"/observers/batch": settings.max_batch_body_bytes}
    app.add_middleware(
        BodyLimit,
        limit=settings.max_body_bytes,
        timeout=settings.body_timeout,
        paths=body_limits,
    )
    # Outside the body limit: no body is read for a caller without a token.
    app.add_middleware(
        TokenFirst,
        auth=app.state.auth,
        limit=settings.max_body_bytes,
        timeout=settings.body_timeout,
        paths=body_limits,
    )
    app.add_middleware(RelativeRedirects)
    app.add_middleware(console.ConsoleHeaders)
    app.add_middleware(HeadAsGet)
    # Outermost: it measures every answer, the body limit's 413 included.
    app.add_middleware(
        Measure,
        metrics=metrics if settings.metrics else None,
        access_log=settings.access_log,
    )
    app.include_router(observers.router)
    app.include_router(services.router)
    app.include_router(health.router)
    app.include_router(views.router)
    app.include_router(console.router)
    app.mount("/console/static", console.static, name="console-static")
    problems.install(app)
    if settings.api_docs:
        _docs(app)

    def openapi() -> dict[str, object]:
        if app.openapi_schema is None:
            runtime_ = getattr(app.state, "orch", None)
            kinds = sorted(runtime_.kinds) if runtime_ is not None else None
            app.openapi_schema = problems.openapi_with_problems(app, kinds)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


#: Swagger UI and ReDoc, pinned to one version each with the digest of the very file (a CDN
#: that served anything else is refused by the browser). Off unless ORCH_API_DOCS=true.
CDN = "https://cdn.jsdelivr.net/npm"
SWAGGER_JS = (
    f"{CDN}/swagger-ui-dist@5.35.0/swagger-ui-bundle.js",
    "sha384-gjRm0bEPMeTmMh5jT2cHccIwCUZSTd8YC+j0d0sXw0MdGEfScduGpSyF3ZSSLkX9",
)
SWAGGER_CSS = (
    f"{CDN}/swagger-ui-dist@5.35.0/swagger-ui.css",
    "sha384-WlYgdmXYOOBWL5apwjDEZwN+U3HmXSSu5R6V5aGxEcf7z+KuRNwBhoxKVN1i3D5I",
)
REDOC_JS = (
    f"{CDN}/redoc@2.5.2/bundles/redoc.standalone.js",
    "sha384-70P5pmIdaQdVbxvjhrcTDv1uKcKqalZ3OHi7S2J+uzDl0PW8dO6L+pHOpm9EEjGJ",
)
DOCS_HEADERS = {
    "Content-Security-Policy": "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc, reading /openapi.json."""
    title = f"{app.title} {app.version}"

    def page(head: str, body: str) -> HTMLResponse:
        return HTMLResponse(
            f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"{head}</head><body>{body}</body></html>",
            headers=DOCS_HEADERS,
        )

    def script(src: tuple[str, str]) -> str:
        return f'<script src="{src[0]}" integrity="{src[1]}" crossorigin="anonymous"></script>'

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return page(
            f'<link rel="stylesheet" href="{SWAGGER_CSS[0]}" integrity="{SWAGGER_CSS[1]}" '
            'crossorigin="anonymous">',
            '<div id="swagger-ui"></div>'
            + script(SWAGGER_JS)
            + '<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui"})</script>',
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return page("", '<redoc spec-url="/openapi.json"></redoc>' + script(REDOC_JS))
