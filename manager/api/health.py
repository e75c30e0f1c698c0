"""/healthz (the process answers), /readyz (Postgres and RabbitMQ reachable), /metrics."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from contracts.errors import NotFound, Transient
from manager import repository as repo
from manager.api.deps import RuntimeDep

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])


@router.get("/healthz", operation_id="health")
async def healthz() -> dict[str, str]:
    """The process answers."""
    return {"status": "ok"}


@router.get("/metrics", include_in_schema=False)
async def metrics(state: RuntimeDep) -> Response:
    """Prometheus metrics; the cluster's state is read from the database at most every
    ``ORCH_METRICS_REFRESH`` seconds (and kept as it was while the database is away)."""
    if not state.settings.metrics:
        raise NotFound("metrics are off (ORCH_METRICS=false)")
    try:
        await state.metrics.refresh(state.store, leads=state.leadership.is_leader)
    except Transient as exc:
        log.warning("metrics: cluster state not refreshed: %s", exc)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz", operation_id="ready", responses={503: {"description": "not ready"}})
async def readyz(state: RuntimeDep) -> JSONResponse:
    """Ready when both the database and the broker answer."""
    checks: dict[str, str] = {}
    try:
        async with state.store.autocommit() as tx:
            await repo.ping(tx)
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
