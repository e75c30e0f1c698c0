"""The FastAPI application: routes, error mapping, and the lifespan that owns the connections
and the leader election."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts import __version__
from contracts.kinds import InvalidParams, UnknownKind, load_kinds
from manager import background
from manager.api import health, observers, services
from manager.api.deps import AppState
from manager.db import make_engine
from manager.leader import Leadership
from manager.outbox import Outbox
from manager.publisher import Publisher
from manager.rebalance import Rebalancer
from manager.repository import Conflict, NameTaken, NotFound
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


def create_app(settings: ManagerSettings | None = None) -> FastAPI:
    settings = settings or ManagerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        kinds = load_kinds(settings.kind_module_list)
        engine = make_engine(settings)
        publisher = Publisher(settings)
        await publisher.start()
        box = Outbox(engine, publisher)
        # Directed starts go only to services whose lease outlives a renewal period.
        margin = settings.lease_ttl / 2
        loops = {
            "outbox-relay": background.every(
                settings.relay_interval,
                lambda: box.relay_once(grace=settings.relay_grace),
                "outbox relay",
            ),
            "sweeper": background.every(
                settings.sweep_interval,
                lambda: background.sweep_once(engine, box, margin=margin),
                "sweeper",
            ),
            "audit": background.every(
                settings.audit_interval,
                lambda: background.audit_once(
                    engine, box, publisher, grace=settings.audit_grace, margin=margin
                ),
                "audit",
            ),
        }
        if settings.rebalance:
            rebalancer = Rebalancer(
                engine,
                box,
                pace=settings.rebalance_pace,
                min_age=settings.rebalance_min_age,
                cooldown=settings.rebalance_cooldown,
            )
            loops["rebalance"] = background.every(
                settings.rebalance_interval, rebalancer.once, "rebalance"
            )
        leadership = Leadership(engine, loops=loops, ttl=settings.lease_ttl)
        app.state.orch = AppState(settings, engine, publisher, box, kinds, leadership)
        tasks: list[asyncio.Task[None]] = [
            asyncio.create_task(
                background.every(0.1, box.delete_published, "outbox cleanup")(),
                name="outbox-cleanup",
            )
        ]
        if settings.background:
            tasks.append(asyncio.create_task(leadership.run(), name="leadership"))
        for task in tasks:
            task.add_done_callback(_die_loudly)
        try:
            yield
        finally:
            for task in tasks:
                task.remove_done_callback(_die_loudly)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if settings.background:
                await leadership.release()
            with contextlib.suppress(Exception):
                await box.delete_published()
            await publisher.close()
            await engine.dispose()

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


def _die_loudly(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    log.critical("%s died (%r): stopping the manager", task.get_name(), task.exception())
    os.kill(os.getpid(), signal.SIGTERM)


def _error_handlers(app: FastAPI) -> None:
    def problem(code: int) -> Any:
        async def handler(_: Request, exc: Exception) -> JSONResponse:
            detail = str(exc)
            if isinstance(exc, NameTaken):
                detail = f"an observer named {exc} already exists (and is not deleted)"
            return JSONResponse({"detail": detail}, status_code=code)

        return handler

    app.add_exception_handler(NotFound, problem(404))
    app.add_exception_handler(NameTaken, problem(409))
    app.add_exception_handler(Conflict, problem(409))
    app.add_exception_handler(UnknownKind, problem(422))
    app.add_exception_handler(InvalidParams, problem(422))

    async def unavailable(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database error: %s", exc)
        return JSONResponse({"detail": "database unavailable, try again"}, status_code=503)

    app.add_exception_handler(DBAPIError, unavailable)
    app.add_exception_handler(OSError, unavailable)
