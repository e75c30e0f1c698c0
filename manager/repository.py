"""The manager's reads and writes for the API. Every state change writes its broker message to
the outbox in the same transaction. Callers convert driver errors (``manager.db``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from contracts.errors import Conflict, NameTaken, NotFound, database_errors
from contracts.messages import CancelMessage, DrainMessage, Message, StartMessage
from contracts.routing import BROADCAST, WORK, Destination, Route
from contracts.statuses import Event, ObserverStatus
from manager import outbox
from manager import queries as q
from manager.db import to_json


def _row(row: Any) -> dict[str, Any]:
    return dict(row._mapping)


async def record_events(
    conn: AsyncConnection,
    ids: Sequence[uuid.UUID],
    event: Event,
    detail: str | Sequence[str] | None = None,
) -> None:
    """History rows: one event for each observer, with one detail for all or one each. The one
    writer of history on the manager's side."""
    if not ids:
        return
    if detail is None or isinstance(detail, str):
        await conn.execute(
            text(q.EVENTS), {"ids": list(ids), "event": event.value, "detail": detail}
        )
    else:
        await conn.execute(
            text(q.EVENTS_EACH),
            {"ids": list(ids), "event": event.value, "details": list(detail)},
        )


async def create_observer(
    conn: AsyncConnection,
    *,
    name: str,
    kind: str,
    params: dict[str, Any],
    restart_policy: dict[str, Any] | None,
) -> tuple[dict[str, Any], outbox.Pending]:
    """Row, history and outbox record in one statement (one round trip)."""
    observer_id, dispatch_id = uuid.uuid4(), uuid.uuid4()
    start = StartMessage(observer_id=observer_id, dispatch_id=dispatch_id)
    try:
        with database_errors():
            row = (
                await conn.execute(
                    text(q.CREATE),
                    {
                        "id": observer_id,
                        "name": name,
                        "kind": kind,
                        "params": to_json(params),
                        "d": dispatch_id,
                        "rp": to_json(restart_policy) if restart_policy else None,
                        "route": Route.WORK.value,
                        "body": to_json(start.to_json()),
                    },
                )
            ).one()
    except NameTaken:
        raise NameTaken(name) from None
    data = _row(row)
    return data, outbox.Pending(data.pop("outbox_id"), WORK, start)


async def get_observer(conn: AsyncConnection, observer_id: uuid.UUID) -> dict[str, Any]:
    row = (await conn.execute(text(q.GET), {"id": observer_id})).one_or_none()
    if row is None:
        raise NotFound(f"no observer with id {observer_id}")
    return _row(row)


async def list_observers(
    conn: AsyncConnection,
    *,
    status: ObserverStatus | None,
    kind: str | None,
    service_id: uuid.UUID | None,
    limit: int,
    offset: int,
) -> list[dict[str, Any]]:
    rows = (
        await conn.execute(
            text(q.LIST),
            {
                "status": status.value if status else None,
                "kind": kind,
                "sid": service_id,
                "limit": limit,
                "offset": offset,
            },
        )
    ).all()
    return [_row(r) for r in rows]


async def list_events(conn: AsyncConnection, observer_id: uuid.UUID) -> list[dict[str, Any]]:
    await get_observer(conn, observer_id)
    rows = (await conn.execute(text(q.LIST_EVENTS), {"id": observer_id})).all()
    return [_row(r) for r in rows]


async def _lock(conn: AsyncConnection, observer_id: uuid.UUID) -> Any:
    row = (await conn.execute(text(q.LOCK_WITH_HOLDER), {"id": observer_id})).one_or_none()
    if row is None:
        raise NotFound(f"no observer with id {observer_id}")
    return row


async def delete_observer(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Deleted at once when nothing runs it; on_deleting plus a cancel broadcast otherwise."""
    row = await _lock(conn, observer_id)
    status = ObserverStatus(row.status)
    messages: list[tuple[Destination, Message]] = []
    if status is ObserverStatus.DELETED:
        pass
    elif status is not ObserverStatus.ON_DELETING and not row.live:
        await conn.execute(text(q.DELETE_NOW), {"ids": [observer_id]})
        await record_events(conn, [observer_id], Event.DELETED, "was not running")
    else:
        if status is not ObserverStatus.ON_DELETING:
            await conn.execute(
                text(q.SET_STATUS),
                {"id": observer_id, "status": ObserverStatus.ON_DELETING.value},
            )
            await record_events(conn, [observer_id], Event.DELETING)
        messages.append((BROADCAST, CancelMessage(observer_id=observer_id)))
    pending = await outbox.add_many(conn, messages)
    return await get_observer(conn, observer_id), pending


async def restart_observer(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Revive a failed observer with a fresh restart budget and a new dispatch."""
    row = await _lock(conn, observer_id)
    if row.status != ObserverStatus.FAILED:
        raise Conflict(f"only a failed observer can be restarted; this one is {row.status}")
    dispatch_id = uuid.uuid4()
    await conn.execute(text(q.RESTART), {"id": observer_id, "d": dispatch_id})
    await record_events(conn, [observer_id], Event.RESTART_REQUESTED)
    start = StartMessage(observer_id=observer_id, dispatch_id=dispatch_id)
    pending = await outbox.add_many(conn, [(WORK, start)])
    return await get_observer(conn, observer_id), pending


async def list_services(conn: AsyncConnection, *, include_deleted: bool) -> list[dict[str, Any]]:
    rows = (await conn.execute(text(q.LIST_SERVICES), {"all": include_deleted})).all()
    return [_row(r) for r in rows]


async def drain_service(
    conn: AsyncConnection, service_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Mark a live service draining and tell it; it hands its observers over and takes none."""
    done = (await conn.execute(text(q.DRAIN), {"id": service_id})).one_or_none()
    if done is None:
        raise NotFound(f"no live service with id {service_id}")
    pending = await outbox.add_many(conn, [(BROADCAST, DrainMessage(service_id=service_id))])
    row = (await conn.execute(text(q.GET_SERVICE), {"id": service_id})).one()
    return _row(row), pending
