"""/healthz (the process answers), /readyz (Postgres and RabbitMQ reachable), /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from orch_contracts.errors import NotFound, Transient
from orch_manager import repository as repo
from orch_manager.api.deps import RuntimeDep
from orch_manager.auth import Authenticator, Unauthenticated
from orch_manager.http import bearer

router = APIRouter(tags=["health"])


@router.get("/healthz", operation_id="health")
async def healthz(state: RuntimeDep) -> dict[str, object]:
    """The process answers; with what it last read of its database server's settings, and a
    warning for each that weakens what it can promise (``manager/database_facts.py``). It
    asks the database nothing."""
    return {
        "status": "ok",
        "database": state.database.shown(),
        "warnings": state.database.warnings() + state.journal.warnings(),
    }


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, state: RuntimeDep) -> Response:
    """Prometheus metrics; the cluster's state as last read from the database (every
    ``ORCH_METRICS_REFRESH`` seconds while scraped, and kept as it was while the database is
    away): a scrape waits on the database only when it is the first.

    ``ORCH_METRICS_AUTH=open``: no token needed, and services are shown by name; a caller with
    a valid token (any role) also sees their ids. ``token``: a valid token is needed (401)."""
    if not state.settings.metrics:
        raise NotFound("metrics are off (ORCH_METRICS=false)")
    auth: Authenticator = request.app.state.auth
    known = not auth.enabled or auth.identify(bearer(request.scope)) is not None
    if not known and state.settings.metrics_auth == "token":
        raise Unauthenticated(
            "a valid API token is needed for /metrics (ORCH_METRICS_AUTH=token): "
            "Authorization: Bearer …"
        )
    await state.metrics.scraped(leads=state.leadership.is_leader)
    return Response(state.metrics.render(service_ids=known), media_type=CONTENT_TYPE_LATEST)


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
    if state.settings.require_synchronous_replication:
        durability = state.database.durability
        checks["replication"] = (
            "ok" if durability == "synchronous" else f"required synchronous, is {durability}"
        )
    ready = all(v == "ok" for v in checks.values())
    body = {
        "status": "ready" if ready else "not ready",
        **checks,
        "leader": state.leadership.is_leader,
    }
    return JSONResponse(body, status_code=200 if ready else 503)
