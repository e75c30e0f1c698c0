"""The manager's reads and writes. Every state change writes its broker message to the outbox
in the same transaction."""

from __future__ import annotations

import json
import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from contracts.messages import CancelMessage, DrainMessage, StartMessage
from contracts.statuses import ObserverStatus
from manager import outbox
from manager.publisher import CONTROL, START

OBSERVER_COLUMNS = (
    "o.id, o.name, o.kind, o.params, o.status, o.service_id, o.epoch, o.checkpoint, "
    "o.checkpointed_at, o.restart_count, o.last_error, o.restart_policy, o.created_at, "
    "o.modified_at, o.started_at"
)


class NameTaken(Exception):
    pass


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


def _row(row: Any) -> dict[str, Any]:
    return dict(row._mapping)


async def _event(
    conn: AsyncConnection, observer_id: uuid.UUID, event: str, detail: str | None = None
) -> None:
    await conn.execute(
        text("INSERT INTO observer_events (observer_id, event, detail) VALUES (:o, :e, :d)"),
        {"o": observer_id, "e": event, "d": detail},
    )


def start_body(observer_id: uuid.UUID, dispatch_id: uuid.UUID) -> dict[str, Any]:
    return StartMessage(observer_id=observer_id, dispatch_id=dispatch_id).model_dump(mode="json")


_CREATE = f"""
WITH o AS (
    INSERT INTO observers AS o (id, name, kind, params, status, dispatch_id, restart_policy)
    VALUES (:id, :name, :kind, CAST(:params AS jsonb), 'created', :d, CAST(:rp AS jsonb))
    RETURNING {OBSERVER_COLUMNS}
), e AS (
    INSERT INTO observer_events (observer_id, event) SELECT id, 'created' FROM o
), b AS (
    INSERT INTO outbox (target, body) VALUES (:target, CAST(:body AS jsonb)) RETURNING id
)
SELECT o.*, b.id AS outbox_id FROM o, b
"""


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
    body = start_body(observer_id, dispatch_id)
    try:
        row = (
            await conn.execute(
                text(_CREATE),
                {
                    "id": observer_id,
                    "name": name,
                    "kind": kind,
                    "params": json.dumps(params),
                    "d": dispatch_id,
                    "rp": json.dumps(restart_policy) if restart_policy else None,
                    "target": START,
                    "body": json.dumps(body),
                },
            )
        ).one()
    except IntegrityError as exc:
        if "uq_observers_live_name" in str(exc.orig):
            raise NameTaken(name) from exc
        raise
    data = _row(row)
    return data, outbox.Pending(data.pop("outbox_id"), START, body)


async def get_observer(conn: AsyncConnection, observer_id: uuid.UUID) -> dict[str, Any]:
    row = (
        await conn.execute(
            text(f"SELECT {OBSERVER_COLUMNS} FROM observers o WHERE o.id = :id"),
            {"id": observer_id},
        )
    ).one_or_none()
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
            text(
                f"SELECT {OBSERVER_COLUMNS} FROM observers o "
                "WHERE (CAST(:status AS text) IS NULL OR o.status = :status) "
                "AND (CAST(:kind AS text) IS NULL OR o.kind = :kind) "
                "AND (CAST(:sid AS uuid) IS NULL OR o.service_id = :sid) "
                "ORDER BY o.created_at, o.id LIMIT :limit OFFSET :offset"
            ),
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
    rows = (
        await conn.execute(
            text(
                "SELECT at, event, service_id, epoch, detail FROM observer_events "
                "WHERE observer_id = :id ORDER BY id"
            ),
            {"id": observer_id},
        )
    ).all()
    return [_row(r) for r in rows]


_LOCK_WITH_HOLDER = """
SELECT o.status, o.service_id,
       (s.id IS NOT NULL AND NOT s.is_deleted AND s.lease_expires_at > clock_timestamp()) AS live
  FROM observers o LEFT JOIN services s ON s.id = o.service_id
 WHERE o.id = :id FOR UPDATE OF o
"""


async def delete_observer(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Deleted at once when nothing runs it; on_deleting plus a cancel broadcast otherwise."""
    row = (await conn.execute(text(_LOCK_WITH_HOLDER), {"id": observer_id})).one_or_none()
    if row is None:
        raise NotFound(f"no observer with id {observer_id}")
    status = ObserverStatus(row.status)
    pending: list[outbox.Pending] = []
    if status is ObserverStatus.DELETED:
        pass
    elif status is not ObserverStatus.ON_DELETING and not row.live:
        await conn.execute(
            text(
                "UPDATE observers SET status = 'deleted', service_id = NULL, modified_at = now() "
                "WHERE id = :id"
            ),
            {"id": observer_id},
        )
        await _event(conn, observer_id, "deleted", "was not running")
    else:
        if status is not ObserverStatus.ON_DELETING:
            await conn.execute(
                text(
                    "UPDATE observers SET status = 'on_deleting', modified_at = now() "
                    "WHERE id = :id"
                ),
                {"id": observer_id},
            )
            await _event(conn, observer_id, "deleting")
        body = CancelMessage(observer_id=observer_id).model_dump(mode="json")
        pending.append(await outbox.add(conn, CONTROL, body))
    return await get_observer(conn, observer_id), pending


async def restart_observer(
    conn: AsyncConnection, observer_id: uuid.UUID
) -> tuple[dict[str, Any], outbox.Pending]:
    row = (await conn.execute(text(_LOCK_WITH_HOLDER), {"id": observer_id})).one_or_none()
    if row is None:
        raise NotFound(f"no observer with id {observer_id}")
    if row.status != ObserverStatus.FAILED:
        raise Conflict(f"only a failed observer can be restarted; this one is {row.status}")
    dispatch_id = uuid.uuid4()
    await conn.execute(
        text(
            "UPDATE observers SET status = 'created', service_id = NULL, restart_count = 0, "
            "dispatch_id = :d, dispatched_at = now(), modified_at = now() WHERE id = :id"
        ),
        {"id": observer_id, "d": dispatch_id},
    )
    await _event(conn, observer_id, "restart requested")
    pending = await outbox.add(conn, START, start_body(observer_id, dispatch_id))
    return await get_observer(conn, observer_id), pending


_SERVICE_COLUMNS = (
    "s.id, s.name, s.worker_count, s.host, s.pid, s.version, s.created_at, "
    "s.last_heartbeat_at, s.lease_expires_at, s.is_deleted, s.draining, "
    "(SELECT count(*) FROM observers o WHERE o.service_id = s.id "
    " AND o.status IN ('processing', 'on_deleting')) AS running"
)


async def list_services(conn: AsyncConnection, *, include_deleted: bool) -> list[dict[str, Any]]:
    rows = (
        await conn.execute(
            text(
                f"SELECT {_SERVICE_COLUMNS} FROM services s WHERE :all OR NOT s.is_deleted "
                "ORDER BY s.created_at"
            ),
            {"all": include_deleted},
        )
    ).all()
    return [_row(r) for r in rows]


async def drain_service(
    conn: AsyncConnection, service_id: uuid.UUID
) -> tuple[dict[str, Any], list[outbox.Pending]]:
    """Mark a live service draining and tell it; it hands its observers over and takes none."""
    done = (
        await conn.execute(
            text(
                "UPDATE services SET draining = true, modified_at = now() "
                "WHERE id = :id AND NOT is_deleted RETURNING id"
            ),
            {"id": service_id},
        )
    ).one_or_none()
    if done is None:
        raise NotFound(f"no live service with id {service_id}")
    body = DrainMessage(service_id=service_id).model_dump(mode="json")
    pending = [await outbox.add(conn, CONTROL, body)]
    row = (
        await conn.execute(
            text(f"SELECT {_SERVICE_COLUMNS} FROM services s WHERE s.id = :id"), {"id": service_id}
        )
    ).one()
    return _row(row), pending
