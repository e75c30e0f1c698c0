"""/console: the live console, a page and its static files (no build step). Every answer under
/console (the page at /console and /console/, its files, their 404s) carries the same headers:
the page's CSP (which forbids framing it) and the frame, type and referrer headers."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
