"""/observers: create, list, read, delete, restart, history."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, status
from sqlalchemy.ext.asyncio import AsyncConnection

from contracts.kinds import get_kind
from contracts.statuses import ObserverStatus
from manager import repository as repo
from manager.api.deps import RuntimeDep
from manager.db import autocommit, transaction
from manager.outbox import Pending
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
    name: Annotated[
        str | None, Query(max_length=200, description="matches any part of the name")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, object]:
    async with autocommit(state.engine) as conn:
        items = await repo.list_observers(
            conn,
            status=status_,
            kind=kind,
            service_id=service_id,
            name=name,
            limit=limit,
            offset=offset,
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


Change = Callable[[AsyncConnection, uuid.UUID], Awaitable[tuple[dict[str, Any], list[Pending]]]]


async def _change(state: RuntimeDep, change: Change, observer_id: uuid.UUID) -> dict[str, Any]:
    """One state change: the row and its outbox records in one transaction, then published."""
    async with transaction(state.engine) as conn:
        row, pending = await change(conn, observer_id)
    await state.outbox.publish_now(pending)
    return row


def _route(method: str, suffix: str, change: Change, code: int, doc: str) -> None:
    """One state-change route: the change and its outbox records in one transaction, then
    published."""

    async def route(observer_id: uuid.UUID, state: RuntimeDep) -> dict[str, Any]:
        return await _change(state, change, observer_id)

    route.__doc__ = doc
    name = change.__name__
    router.add_api_route(
        "/{observer_id}" + suffix,
        route,
        methods=[method],
        name=name,
        operation_id=name,
        status_code=code,
        response_model=ObserverOut,
        responses=_ERRORS,
    )


_route(
    "DELETE",
    "",
    repo.delete_observer,
    status.HTTP_202_ACCEPTED,
    """Cancel an observer: `deleted` at once if nothing runs it, else `on_deleting` until its
    service has stopped it. Repeating the call is harmless.""",
)
_route(
    "POST",
    "/restart",
    repo.restart_observer,
    status.HTTP_200_OK,
    "Revive a `failed` observer: it starts again (from its last checkpoint) on some service.",
)
_route(
    "POST",
    "/pause",
    repo.pause_observer,
    status.HTTP_202_ACCEPTED,
    """Stop an observer and keep it: `paused` at once if nothing runs it, else `pausing` until
    its service has stopped it (its last checkpoint stays). A delete wins over a pause.""",
)
_route(
    "POST",
    "/resume",
    repo.resume_observer,
    status.HTTP_200_OK,
    "Start a `paused` observer again, from its last checkpoint, on some service.",
)
