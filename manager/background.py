"""The loops the elected leader runs: outbox relay, dead-service sweeper, lost-message audit."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

from aio_pika.exceptions import AMQPError
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from manager import outbox
from manager.outbox import Outbox
from manager.publisher import START, Publisher
from manager.repository import start_body

log = logging.getLogger(__name__)

TRANSIENT = (DBAPIError, OSError, AMQPError, TimeoutError)


def every(
    seconds: float, once: Callable[[], Awaitable[object]], what: str
) -> Callable[[], Awaitable[None]]:
    """A loop calling ``once`` every ``seconds``; transient server errors are logged, not fatal."""

    async def loop() -> None:
        while True:
            try:
                await once()
            except TRANSIENT as exc:
                log.warning("%s: %s", what, exc)
            await asyncio.sleep(seconds)

    return loop


async def _redispatch(
    conn: AsyncConnection, ids: list[uuid.UUID], why: str
) -> list[outbox.Pending]:
    """New dispatch ids for these observers (their old messages become stale), via the outbox."""
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
    return await outbox.add_many(conn, START, [start_body(r.id, r.dispatch_id) for r in rows])


async def sweep_once(engine: AsyncEngine, box: Outbox) -> int:
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
        pending = await _redispatch(conn, moving, "holder lost its lease")
    if moving:
        log.warning("re-dispatching %d observers of dead services", len(moving))
    await box.publish_now(pending)
    return len(orphans)


async def audit_once(engine: AsyncEngine, box: Outbox, publisher: Publisher, grace: float) -> int:
    """Re-dispatch live observers that nobody holds and whose message seems lost.

    Only when the work queue has nothing ready: then a start message for an unowned observer can
    only be in flight for a moment, and ``grace`` covers that.
    """
    if await publisher.work_queue_ready() > 0:
        return 0
    async with engine.begin() as conn:
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
        pending = await _redispatch(conn, list(ids), "audit: no start message found")
    if ids:
        log.warning("audit re-dispatched %d observers whose start message was lost", len(ids))
    await box.publish_now(pending)
    return len(ids)
