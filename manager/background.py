"""The loops the elected leader runs: outbox relay, dead-service sweeper, lost-message audit."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aio_pika.exceptions import AMQPError
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from contracts.messages import DirectedStart
from manager import outbox
from manager.outbox import Outbox
from manager.publisher import START, Publisher, direct
from manager.repository import start_body

log = logging.getLogger(__name__)

#: Server errors a leader loop outlives (Postgres or RabbitMQ down or restarting); anything else
#: is a bug and stops the manager loudly. ConnectionError is an OSError.
TRANSIENT = (DBAPIError, OSError, AMQPError, TimeoutError)


def every(
    seconds: float, once: Callable[[], Awaitable[object]], what: str
) -> Callable[[], Coroutine[Any, Any, None]]:
    """A loop calling ``once`` every ``seconds``; transient server errors are logged, not fatal."""

    async def loop() -> None:
        while True:
            try:
                await once()
            except TRANSIENT as exc:
                log.warning("%s: %s", what, exc)
            await asyncio.sleep(seconds)

    return loop


async def _free_slots(conn: AsyncConnection, margin: float) -> dict[uuid.UUID, int]:
    """Free slots of every service that surely lives (lease valid for ``margin`` more seconds)
    and takes work."""
    rows = (
        await conn.execute(
            text(
                "SELECT s.id, s.worker_count - (SELECT count(*) FROM observers o "
                "  WHERE o.service_id = s.id AND o.status IN ('processing', 'on_deleting')) "
                "  AS free "
                "FROM services s WHERE NOT s.is_deleted AND NOT s.draining "
                "AND s.lease_expires_at > clock_timestamp() + make_interval(secs => :m)"
            ),
            {"m": margin},
        )
    ).all()
    return {r.id: int(r.free) for r in rows if r.free > 0}


def place(free: dict[uuid.UUID, int], count: int) -> list[uuid.UUID | None]:
    """Targets for ``count`` observers: the service with the most free slots first; None (the
    shared work queue) once every live service is full."""
    slots = dict(free)
    out: list[uuid.UUID | None] = []
    for _ in range(count):
        best = max(slots, key=lambda k: slots[k], default=None)
        if best is None or slots[best] <= 0:
            out.append(None)
            continue
        slots[best] -= 1
        out.append(best)
    return out


async def _redispatch(
    conn: AsyncConnection, ids: list[uuid.UUID], why: str, *, margin: float
) -> list[outbox.Pending]:
    """New dispatch ids for these observers (their old messages become stale), each sent to a
    live service with room, chosen here from the leases, not by the broker."""
    if not ids:
        return []
    rows = (
        await conn.execute(
            text(
                "UPDATE observers o SET dispatch_id = gen_random_uuid(), service_id = NULL, "
                "dispatched_at = now(), modified_at = now() WHERE o.id = ANY(:ids) "
                "RETURNING o.id, o.dispatch_id"
            ),
            {"ids": ids},
        )
    ).all()
    await conn.execute(
        text(
            "INSERT INTO observer_events (observer_id, event, detail) "
            "SELECT i, 'redispatched', :why FROM unnest(CAST(:ids AS uuid[])) AS i"
        ),
        {"ids": [r.id for r in rows], "why": why},
    )
    targets = place(await _free_slots(conn, margin), len(rows))
    messages = [
        (START, start_body(r.id, r.dispatch_id))
        if target is None
        else (
            direct(target),
            DirectedStart(observer_id=r.id, dispatch_id=r.dispatch_id).model_dump(mode="json"),
        )
        for r, target in zip(rows, targets, strict=True)
    ]
    return await outbox.add_many(conn, messages)


async def sweep_once(engine: AsyncEngine, box: Outbox, *, margin: float) -> int:
    """Mark services whose lease expired deleted; move their observers elsewhere."""
    async with engine.begin() as conn:
        dead = (
            await conn.execute(
                text(
                    "UPDATE services SET is_deleted = true, modified_at = now() "
                    "WHERE NOT is_deleted AND lease_expires_at < clock_timestamp() "
                    "RETURNING id, name"
                )
            )
        ).all()
        for d in dead:
            log.warning("service %s (%s) missed its lease: marked deleted", d.id, d.name)
        orphans = (
            await conn.execute(
                text(
                    "SELECT o.id, o.status FROM observers o JOIN services s ON s.id = o.service_id "
                    "WHERE o.status IN ('processing', 'on_deleting') "
                    "AND (s.is_deleted OR s.lease_expires_at < clock_timestamp()) "
                    "FOR UPDATE OF o SKIP LOCKED"
                )
            )
        ).all()
        deleting = [o.id for o in orphans if o.status == "on_deleting"]
        if deleting:
            await conn.execute(
                text(
                    "UPDATE observers SET status = 'deleted', service_id = NULL, "
                    "modified_at = now() "
                    "WHERE id = ANY(:ids)"
                ),
                {"ids": deleting},
            )
        moving = [o.id for o in orphans if o.status == "processing"]
        pending = await _redispatch(conn, moving, "holder lost its lease", margin=margin)
    if moving:
        log.warning("re-dispatching %d observers of dead services", len(moving))
    await box.publish_now(pending)
    return len(orphans)


async def audit_once(
    engine: AsyncEngine, box: Outbox, publisher: Publisher, *, grace: float, margin: float
) -> int:
    """Re-dispatch live observers that nobody holds and whose start message is stuck or lost.

    Only when the work queue has nothing ready and nothing was taken for ``grace`` seconds: then
    the message of an unowned observer is not waiting for capacity nor in a busy service's
    backlog; it sits unacked at a consumer that does not take it (a frozen service still has
    free prefetch slots, and the broker fills them) or it was lost. A new dispatch id makes the
    stuck copy stale.
    """
    if await publisher.work_queue_ready() > 0:
        return 0
    async with engine.begin() as conn:
        # A service working through a large prefetch backlog also leaves nothing ready while
        # observers wait unowned; it takes observers all the while. Act only when nothing was
        # taken lately: then the waiting ones really are stuck at a silent consumer.
        busy = (
            await conn.execute(
                text("SELECT max(started_at) > now() - make_interval(secs => :g) FROM observers"),
                {"g": grace},
            )
        ).scalar_one()
        if busy:
            return 0
        ids = (
            (
                await conn.execute(
                    text(
                        "SELECT o.id FROM observers o WHERE o.status IN ('created', 'processing') "
                        "AND o.service_id IS NULL "
                        "AND o.dispatched_at < now() - make_interval(secs => :g) "
                        "AND o.modified_at < now() - make_interval(secs => :g) "
                        "AND NOT EXISTS (SELECT 1 FROM outbox b "
                        "                WHERE b.body->>'observer_id' = o.id::text) "
                        "LIMIT 1000 FOR UPDATE OF o SKIP LOCKED"
                    ),
                    {"g": grace},
                )
            )
            .scalars()
            .all()
        )
        pending = await _redispatch(
            conn, list(ids), "audit: start message stuck or lost", margin=margin
        )
    if ids:
        log.warning("audit re-dispatched %d observers whose start message was stuck", len(ids))
    await box.publish_now(pending)
    return len(ids)
