"""The manager's reads and writes for the API. Every state change writes its broker message to
the outbox in the same transaction. Callers convert driver errors (``manager.db``)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from contracts.errors import Conflict, NameTaken, NotFound, database_errors
from contracts.messages import (
    CancelMessage,
    DrainMessage,
    Message,
    StartMessage,
    UndrainMessage,
)
from contracts.routing import BROADCAST, WORK, Destination, Route
from contracts.statuses import STOPPED, STOPPING, Event, ObserverStatus
from manager import outbox
from manager import queries as q
from manager.db import to_json


def _like(text_: str) -> str:
    """``text_`` for ILIKE, its wildcards taken literally."""
    return text_.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


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


@dataclass(frozen=True)
class NewObserver:
    name: str
    kind: str
    params: dict[str, Any]
    restart_policy: dict[str, Any] | None = None


async def create_observers(
    conn: AsyncConnection, new: Sequence[NewObserver]
) -> tuple[list[dict[str, Any] | None], list[outbox.Pending]]:
    """Rows, history and outbox records in one statement (one round trip). Each row, in the
    order asked for, or None where a live observer already has that name."""
    starts = [StartMessage(observer_id=uuid.uuid4(), dispatch_id=uuid.uuid4()) for _ in new]
    with database_errors():
        rows = (
            await conn.execute(
                text(q.CREATE_MANY),
                {
                    "ids": [s.observer_id for s in starts],
                    "names": [n.name for n in new],
                    "kinds": [n.kind for n in new],
                    "params": [to_json(n.params) for n in new],
                    "ds": [s.dispatch_id for s in starts],
                    "rps": [to_json(n.restart_policy) if n.restart_policy else None for n in new],
                    "route": Route.WORK.value,
                    "bodies": [to_json(s.to_json()) for s in starts],
                },
            )
        ).all()
    made = {r.id: _row(r) for r in rows}
    pending = [
        outbox.Pending(made[s.observer_id].pop("outbox_id"), WORK, s)
        for s in starts
        if s.observer_id in made
    ]
    return [made.get(s.observer_id) for s in starts], pending


async def create_observer(
    conn: AsyncConnection, new: NewObserver
) -> tuple[dict[str, Any], outbox.Pending]:
    (row,), pending = await create_observers(conn, [new])
    if row is None:
        raise NameTaken(new.name)
    return row, pending[0]


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
    name: str | None = None,
    limit: int,
    offset: int,
) -> list[dict[str, Any]]:
    """A page of observers, oldest first; ``name`` matches any part of the name."""
    rows = (
        await conn.execute(
            text(q.LIST),
            {
                "status": status.value if status else None,
                "kind": kind,
                "sid": service_id,
                "name": _like(name) if name else None,
                "limit": limit,
                "offset": offset,
            },
        )
    ).all()
    return [_row(r) for r in rows]


async def list_events(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The observer (NotFound if there is none) and its history."""
    observer = await get_observer(conn, observer_id)
    rows = (await conn.execute(text(q.LIST_EVENTS), {"id": observer_id})).all()
    return observer, [_row(r) for r in rows]


async def _lock(conn: AsyncConnection, observer_id: uuid.UUID) -> Any:
    row = (await conn.execute(text(q.LOCK_WITH_HOLDER), {"id": observer_id})).one_or_none()
    if row is None:
        raise NotFound(f"no observer with id {observer_id}")
    return row


async def _stop(
    conn: AsyncConnection,
    observer_id: uuid.UUID,
    stopping: ObserverStatus,
    refuse: frozenset[ObserverStatus] = frozenset(),
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Delete or pause: at once when nothing runs it, else ``stopping`` plus a cancel broadcast
    (its holder stops the copy, and the row becomes what its stop makes of it). Repeating it is
    harmless: the broadcast goes again."""
    row = await _lock(conn, observer_id)
    final = STOPPED[stopping]
    messages: list[tuple[Destination, Message]] = []
    if row.status in refuse:
        raise Conflict(f"a {row.status} observer cannot be {final}")
    if row.status == final:
        pass
    elif row.status not in STOPPING and not row.live:
        # Nothing runs it (created, paused, failed, or a holder that is gone).
        await conn.execute(text(q.STOP_NOW), {"id": observer_id, "status": final.value})
        await record_events(conn, [observer_id], Event(final.value), "was not running")
    else:
        if row.status != stopping:
            await conn.execute(text(q.SET_STATUS), {"id": observer_id, "status": stopping.value})
            await record_events(conn, [observer_id], _ASKED[stopping])
        messages.append((BROADCAST, CancelMessage(observer_id=observer_id)))
    pending = await outbox.add_many(conn, messages)
    return await get_observer(conn, observer_id), pending


_ASKED = {ObserverStatus.ON_DELETING: Event.DELETING, ObserverStatus.PAUSING: Event.PAUSING}
_NOT_PAUSABLE = frozenset(
    {ObserverStatus.ON_DELETING, ObserverStatus.DELETED, ObserverStatus.FAILED}
)


async def delete_observer(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Deleted at once when nothing runs it; on_deleting plus a cancel broadcast otherwise. A
    delete wins over a pause under way."""
    return await _stop(conn, observer_id, ObserverStatus.ON_DELETING)


async def pause_observer(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Paused at once when nothing runs it; pausing plus a cancel broadcast otherwise (its
    holder stops it and its checkpoint stays)."""
    return await _stop(conn, observer_id, ObserverStatus.PAUSING, _NOT_PAUSABLE)


@dataclass(frozen=True)
class _Revival:
    only: ObserverStatus
    verb: str
    sql: str
    event: Event


_RESTART = _Revival(ObserverStatus.FAILED, "restarted", q.RESTART, Event.RESTART_REQUESTED)
_RESUME = _Revival(ObserverStatus.PAUSED, "resumed", q.RESUME, Event.RESUMED)


async def _start_anew(
    conn: AsyncConnection, observer_id: uuid.UUID, how: _Revival
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Created again with a new dispatch id (older start messages become stale), published."""
    row = await _lock(conn, observer_id)
    if row.status != how.only:
        later = " (try again once it is paused)" if row.status == ObserverStatus.PAUSING else ""
        raise Conflict(
            f"only a {how.only} observer can be {how.verb}; this one is {row.status}{later}"
        )
    dispatch_id = uuid.uuid4()
    await conn.execute(text(how.sql), {"id": observer_id, "d": dispatch_id})
    await record_events(conn, [observer_id], how.event)
    start = StartMessage(observer_id=observer_id, dispatch_id=dispatch_id)
    pending = await outbox.add_many(conn, [(WORK, start)])
    return await get_observer(conn, observer_id), pending


async def restart_observer(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Revive a failed observer with a fresh restart budget and a new dispatch."""
    return await _start_anew(conn, observer_id, _RESTART)


async def resume_observer(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """A paused observer starts again, from its last checkpoint, on some service."""
    return await _start_anew(conn, observer_id, _RESUME)


async def list_services(conn: AsyncConnection, *, include_deleted: bool) -> list[dict[str, Any]]:
    rows = (await conn.execute(text(q.LIST_SERVICES), {"all": include_deleted})).all()
    return [_row(r) for r in rows]


async def drain_service(
    conn: AsyncConnection, service_id: uuid.UUID, *, draining: bool = True
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Mark a live service draining and tell it: it hands its observers over and takes none.
    With ``draining=False``, undo that: it takes work again (undraining one that does not drain
    changes nothing)."""
    found = await conn.execute(text(q.DRAIN if draining else q.UNDRAIN), {"id": service_id})
    if found.one_or_none() is None:
        raise NotFound(f"no live service with id {service_id}")
    message = (DrainMessage if draining else UndrainMessage)(service_id=service_id)
    pending = await outbox.add_many(conn, [(BROADCAST, message)])
    row = (await conn.execute(text(q.GET_SERVICE), {"id": service_id})).one()
    return _row(row), pending
