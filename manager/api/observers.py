"""/observers: create, list, read, delete, restart, history."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status

from contracts.kinds import get_kind
from contracts.statuses import ObserverStatus
from manager import repository as repo
from manager.api.deps import RuntimeDep
from manager.db import autocommit, transaction
from manager.schemas import ObserverCreate, ObserverEventOut, ObserverOut, ObserverPage, Problem

router = APIRouter(prefix="/observers", tags=["observers"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem},
    409: {"model": Problem},
    422: {"model": Problem},
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=ObserverOut,
    responses={**_ERRORS, 413: {"model": Problem}},
)
async def create_observer(body: ObserverCreate, state: RuntimeDep) -> dict[str, object]:
    """Start an observer. It is `created` at once and `processing` when a service takes it."""
    spec = get_kind(state.kinds, body.kind)
    params = spec.validate_params(body.params)
    if len(json.dumps(params)) > state.settings.max_params_bytes:
        raise HTTPException(
            413,
            f"params are larger than {state.settings.max_params_bytes} bytes",
        )
    policy = body.restart_policy.model_dump() if body.restart_policy else None
    async with autocommit(state.engine) as conn:  # one statement: row, history, outbox
        row, pending = await repo.create_observer(
            conn, name=body.name, kind=body.kind, params=params, restart_policy=policy
        )
    await state.outbox.publish_now([pending])
    return row


@router.get("", response_model=ObserverPage)
async def list_observers(
    state: RuntimeDep,
    status_: Annotated[ObserverStatus | None, Query(alias="status")] = None,
    kind: str | None = None,
    service_id: uuid.UUID | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, object]:
    async with autocommit(state.engine) as conn:
        items = await repo.list_observers(
            conn, status=status_, kind=kind, service_id=service_id, limit=limit, offset=offset
        )
    return {
        "items": items,
        "limit": limit,
        "offset": offset,
        "next_offset": offset + limit if len(items) == limit else None,
    }


@router.get("/{observer_id}", response_model=ObserverOut, responses=_ERRORS)
async def get_observer(observer_id: uuid.UUID, state: RuntimeDep) -> dict[str, object]:
    async with autocommit(state.engine) as conn:
        return await repo.get_observer(conn, observer_id)


@router.get("/{observer_id}/events", response_model=list[ObserverEventOut], responses=_ERRORS)
async def observer_events(observer_id: uuid.UUID, state: RuntimeDep) -> list[dict[str, object]]:
    """History: every take (with its service and epoch), release, restart, failure, deletion."""
    async with autocommit(state.engine) as conn:
        return await repo.list_events(conn, observer_id)


@router.delete(
    "/{observer_id}",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=ObserverOut,
    responses=_ERRORS,
)
async def delete_observer(observer_id: uuid.UUID, state: RuntimeDep) -> dict[str, object]:
    """Cancel an observer: `deleted` at once if nothing runs it, else `on_deleting` until its
    service has stopped it. Repeating the call is harmless."""
    async with transaction(state.engine) as conn:
        row, pending = await repo.delete_observer(conn, observer_id)
    await state.outbox.publish_now(pending)
    return row


@router.post("/{observer_id}/restart", response_model=ObserverOut, responses=_ERRORS)
async def restart_observer(observer_id: uuid.UUID, state: RuntimeDep) -> dict[str, object]:
    """Revive a `failed` observer: it starts again (from its last checkpoint) on some service."""
    async with transaction(state.engine) as conn:
        row, pending = await repo.restart_observer(conn, observer_id)
    await state.outbox.publish_now(pending)
    return row
