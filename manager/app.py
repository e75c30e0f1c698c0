"""The FastAPI application: routes, the one error shape, who may call it, and the lifespan
that starts and stops the manager's runtime."""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import importlib.resources
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from starlette.types import Receive, Scope, Send

from orch_contracts import __version__, tracing
from orch_manager import problems
from orch_manager.api import console, health, observers, services, views
from orch_manager.auth import Authenticator, parse_tokens
from orch_manager.http import (
    BodyLimit,
    HeadAsGet,
    Measure,
    RelativeRedirects,
    TokenFirst,
    bearer,
)
from orch_manager.metrics import ManagerMetrics
from orch_manager.runtime import ManagerRuntime
from orch_manager.settings import ManagerSettings

DESCRIPTION = """Keeps infinite tasks (observers) running exactly once on a pool of services.

Every call but `/healthz`, `/readyz`, `/metrics` (unless `ORCH_METRICS_AUTH=token`),
`/openapi.json` (and the console's files) needs an API token (`Authorization: Bearer …`): the
`read` role may look, the `admin` role may also change things. A request with a body is 401
before its body is read when it has no valid token. Every error is a problem document
(RFC 9457): `type`, `title`, `status`, `detail`, and `errors` with the field paths of a
validation error."""


class ManagerApp(FastAPI):
    """The API, whose request spans (FastAPI's own, when tracing is on) see a request as
    ``tracing.for_traces`` leaves it: a caller's trace continued only once its token is known
    good, and never the Host it claims."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if tracing.enabled() and scope["type"] in ("http", "websocket"):
            auth: Authenticator = self.state.auth
            trusted = not auth.enabled or auth.identify(bearer(scope)) is not None
            scope = tracing.for_traces(scope, trusted=trusted)
        await super().__call__(scope, receive, send)


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

    app = ManagerApp(
        title="observer-orchestrator",
        version=__version__,
        description=DESCRIPTION,
        lifespan=lifespan,
        # Served by _docs below, if at all (FastAPI's pages load a floating version from a CDN).
        docs_url=None,
        redoc_url=None,
        # FastAPI (0.143+) makes each request's server span (the W3C context it came with
        # continued) with the provider contracts.tracing sets, when tracing is on. It sets up
        # no exporter (that is contracts.tracing) and no metrics or logs (ours are /metrics
        # and the log lines); no span per dependency, endpoint and serialization either: with
        # them, traced creates lost 40 % of their rate, against 33 % without (``orch bench
        # --only observability``).
        telemetry={
            "auto_configure": False,
            "metrics": False,
            "logs": False,
            "operation_spans": False,
        },
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


#: Swagger UI and ReDoc, served by the manager itself (no CDN: the pages work offline) from the
#: files the fastapi-offline package ships. Off unless ORCH_API_DOCS=true.
DOCS_ASSETS = "/docs/assets"
ASSET_TYPES = {
    "swagger-ui-bundle.js": "text/javascript; charset=utf-8",
    "swagger-ui.css": "text/css; charset=utf-8",
    "redoc.standalone.js": "text/javascript; charset=utf-8",
}
#: Swagger UI's start, a file of its own so that no inline script need be allowed. No validator:
#: Swagger UI would send the schema's address to validator.swagger.io for its badge.
SWAGGER_INIT = (
    'SwaggerUIBundle({url: "/openapi.json", dom_id: "#swagger-ui", validatorUrl: null});\n'
)
#: An asset's address carries its digest, so it may be cached for a year.
ASSET_CACHE = "public, max-age=31536000, immutable"
#: Only this origin's files, and no inline script.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)
SWAGGER_CSP = _CSP
#: ReDoc also writes its styles into the page and runs its search in a worker made from a blob.
REDOC_CSP = _CSP.replace("style-src 'self'", "style-src 'self' 'unsafe-inline'").replace(
    "connect-src 'self';", "connect-src 'self'; worker-src blob:;"
)
DOCS_HEADERS = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclasses.dataclass(frozen=True)
class _Asset:
    body: bytes
    #: None when gzip would not make it smaller.
    gzipped: bytes | None
    media_type: str
    #: ``?v=`` and the digest's start: a new version is a new address.
    url: str


def _assets() -> dict[str, _Asset]:
    """Swagger UI's and ReDoc's files, read (and gzipped) once, with Swagger UI's start."""
    import fastapi_offline  # only with the docs on

    static = importlib.resources.files(fastapi_offline) / "static"
    files = {name: (static / name).read_bytes() for name in ASSET_TYPES}
    files["swagger-init.js"] = SWAGGER_INIT.encode()
    types = {**ASSET_TYPES, "swagger-init.js": "text/javascript; charset=utf-8"}
    return {
        name: _Asset(
            body=body,
            gzipped=zipped if len(zipped := gzip.compress(body, mtime=0)) < len(body) else None,
            media_type=types[name],
            url=f"{DOCS_ASSETS}/{name}?v={hashlib.sha256(body).hexdigest()[:16]}",
        )
        for name, body in files.items()
    }


def _docs(app: FastAPI) -> None:
    """/docs (Swagger UI) and /redoc, reading /openapi.json, and their files under
    /docs/assets/: no token needed, like /openapi.json."""
    title = f"{app.title} {app.version}"
    assets = _assets()

    def page(head: str, body: str, csp: str) -> HTMLResponse:
        return HTMLResponse(
            f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f'<link rel="icon" href="data:,">{head}</head><body>{body}</body></html>',
            headers={**DOCS_HEADERS, "Content-Security-Policy": csp},
        )

    def script(name: str) -> str:
        return f'<script src="{assets[name].url}"></script>'

    @app.get("/docs", include_in_schema=False)
    async def swagger() -> HTMLResponse:
        return page(
            f'<link rel="stylesheet" href="{assets["swagger-ui.css"].url}">',
            '<div id="swagger-ui"></div>'
            + script("swagger-ui-bundle.js")
            + script("swagger-init.js"),
            SWAGGER_CSP,
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        redoc = '<redoc spec-url="/openapi.json"></redoc>' + script("redoc.standalone.js")
        return page("", redoc, REDOC_CSP)

    @app.get(DOCS_ASSETS + "/{name}", include_in_schema=False)
    async def asset(name: str, request: Request) -> Response:
        found = assets.get(name)
        if found is None:
            raise HTTPException(404, "no such docs asset")
        headers = {
            "Cache-Control": ASSET_CACHE,
            "X-Content-Type-Options": "nosniff",
            "Vary": "Accept-Encoding",
        }
        if found.gzipped is not None and _accepts_gzip(request.headers.get("accept-encoding", "")):
            headers["Content-Encoding"] = "gzip"
            return Response(found.gzipped, media_type=found.media_type, headers=headers)
        return Response(found.body, media_type=found.media_type, headers=headers)


def _accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding takes gzip (``gzip;q=0`` refuses it)."""
    for item in accept_encoding.lower().split(","):
        coding, _, params = item.partition(";")
        if coding.strip() in ("gzip", "x-gzip"):
            q = params.strip().removeprefix("q=").strip()
            return not q or q.strip("0.") != ""
    return False
