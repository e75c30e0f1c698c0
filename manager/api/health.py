"""/healthz (the process answers) and /readyz (Postgres and RabbitMQ reachable)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from contracts.errors import Transient
from manager import queries as q
from manager.api.deps import RuntimeDep
from manager.db import autocommit

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: RuntimeDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        async with autocommit(state.engine) as conn:
            await conn.execute(text(q.PING))
        checks["database"] = "ok"
    except Transient as exc:
        checks["database"] = f"unreachable: {exc}"
    checks["broker"] = "ok" if state.publisher.connected else "unreachable"
    ready = all(v == "ok" for v in checks.values())
    body = {
        "status": "ready" if ready else "not ready",
        **checks,
        "leader": state.leadership.is_leader,
    }
    return JSONResponse(body, status_code=200 if ready else 503)
