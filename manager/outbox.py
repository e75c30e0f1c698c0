"""Transactional outbox: a message is written with the change that needs it, then published.

The API publishes its own rows right after commit (fast path) and deletes them; the leader's
relay publishes rows that stayed behind (the manager crashed or the broker was down).
A row is deleted only after the broker confirmed it, so a crash can duplicate a message but
never lose one; consumers drop duplicates by dispatch id.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from contracts.errors import Transient
from contracts.messages import CONTROL_MESSAGE, Message, StartMessage
from contracts.routing import Destination, Route
from manager import queries as q
from manager.db import to_json, transaction
from manager.publisher import Publisher

log = logging.getLogger(__name__)

_START: TypeAdapter[StartMessage] = TypeAdapter(StartMessage)


@dataclass(frozen=True)
class Pending:
    """An outbox record committed and not yet confirmed by the broker."""

    id: int
    to: Destination
    message: Message


def parse(route: str, service_id: uuid.UUID | None, body: dict[str, Any]) -> Pending:
    to = Destination(Route(route), service_id)
    message: Message = (
        _START.validate_python(body)
        if to.route in (Route.WORK, Route.ERRORS)
        else CONTROL_MESSAGE.validate_python(body)
    )
    return Pending(0, to, message)


async def add_many(
    conn: AsyncConnection, messages: Sequence[tuple[Destination, Message]]
) -> list[Pending]:
    """Outbox records, each with its own destination, in one statement: the one way in."""
    if not messages:
        return []
    ids = (
        (
            await conn.execute(
                text(q.OUTBOX_ADD),
                {
                    "routes": [to.route.value for to, _ in messages],
                    "services": [to.service_id for to, _ in messages],
                    "bodies": [to_json(m.to_json()) for _, m in messages],
                },
            )
        )
        .scalars()
        .all()
    )
    return [Pending(i, to, m) for i, (to, m) in zip(ids, messages, strict=True)]


class Outbox:
    def __init__(self, engine: AsyncEngine, publisher: Publisher) -> None:
        self.engine = engine
        self.publisher = publisher
        self._published: list[int] = []  # confirmed, to be deleted by delete_published
        self._in_flight: set[int] = set()  # being published here, not yet confirmed

    async def _publish(self, rows: Sequence[Pending]) -> list[int]:
        results = await asyncio.gather(
            *(self.publisher.deliver(r.to, r.message) for r in rows), return_exceptions=True
        )
        done = [r.id for r, res in zip(rows, results, strict=True) if res is None]
        failed = [res for res in results if res is not None]
        for res in failed:
            if not isinstance(res, Transient):
                raise res  # a bug, not a broker outage
        if failed:
            log.warning(
                "%d outbox messages not published yet (the relay retries): %s",
                len(failed),
                failed[0],
            )
        return done

    async def publish_now(self, rows: Sequence[Pending]) -> None:
        """Publish rows just committed; whatever fails stays for the relay. Never raises for an
        unavailable broker.

        Published rows are deleted in batches by ``delete_published`` (every manager runs it):
        a crash before that only makes the relay publish them again, a harmless duplicate.
        """
        if not rows:
            return
        ids = {r.id for r in rows}
        self._in_flight |= ids  # a confirm can take longer than the relay's grace (fsync)
        try:
            done = await self._publish(rows)
            self._published.extend(done)  # the list as it is now: a cleanup may have replaced it
        finally:
            self._in_flight -= ids

    async def delete_published(self) -> int:
        """Delete confirmed rows; they stay in the relay's skip list until the delete commits."""
        ids = list(self._published)
        if ids:
            async with transaction(self.engine) as conn:
                await conn.execute(text(q.OUTBOX_DELETE), {"ids": ids})
            done = set(ids)
            self._published = [i for i in self._published if i not in done]
        return len(ids)

    async def relay_once(self, *, grace: float, limit: int = 500) -> int:
        """Publish rows older than ``grace`` seconds; returns how many were published."""
        async with transaction(self.engine) as conn:
            rows = (
                await conn.execute(
                    text(q.OUTBOX_DUE),
                    {"g": grace, "n": limit, "skip": [*self._published, *self._in_flight]},
                )
            ).all()
            if not rows:
                return 0
            pending = [
                Pending(r.id, p.to, p.message)
                for r in rows
                for p in (parse(r.route, r.service_id, r.body),)
            ]
            done = await self._publish(pending)
            await conn.execute(text(q.OUTBOX_DELETE), {"ids": done})
            return len(done)
