"""/console: the live console, a page and its static files (no build step). Every answer under
/console (the page at /console and /console/, its files, their 404s) carries the same headers:
the page's CSP (which forbids framing it) and the frame, type and referrer headers."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orch_contracts.errors import NotFound

HERE = Path(__file__).resolve().parent.parent / "console"
#: The page may load only its own script and style, and talk only to this API; no page may
#: frame it.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_RAW = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in HEADERS.items()]
_NAMES = {k for k, _ in _RAW}

router = APIRouter(include_in_schema=False)

#: The ``orch verify`` report is one self-contained page: its own inline style and SVG, nothing
#: else (no script, no request anywhere), never framed.
REPORT_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'; "
        "base-uri 'none'; form-action 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@router.get("/verify-report")
def verify_report(request: Request) -> FileResponse:
    """The last ``orch verify`` report (ORCH_VERIFY_REPORT), open like the console's files: it
    holds what a throw-away cluster did, nothing of this one."""
    path: Path | None = request.app.state.verify_report
    if path is None or not path.is_file():
        raise NotFound("no orch verify report here (ORCH_VERIFY_REPORT)")
    return FileResponse(path, media_type="text/html", headers=REPORT_HEADERS)


@router.get("/console")
@router.get("/console/")
async def console() -> FileResponse:
    return FileResponse(HERE / "index.html", headers=HEADERS)


static = StaticFiles(directory=HERE)


class ConsoleHeaders:
    """Put :data:`HEADERS` on every answer under /console (replacing any of the same name):
    a file served by the static mount is the same page as /console, and must be as safe."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != "/console" and not path.startswith("/console/"):
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in _NAMES]
                message = {**message, "headers": [*kept, *_RAW]}
            await send(message)

        await self.app(scope, receive, sending)
