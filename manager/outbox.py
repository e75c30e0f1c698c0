"""Transactional outbox: a message is written with the change that needs it, then published.

The API publishes its own rows right after commit (fast path) and deletes them; the leader's
relay publishes rows that stayed behind (the manager crashed or the broker was down).
A row is deleted only after the broker confirmed it, so a crash can duplicate a message but
never lose one; consumers drop duplicates by dispatch id.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from manager.publisher import Publisher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    id: int
    target: str
    body: dict[str, Any]


async def add(conn: AsyncConnection, target: str, body: dict[str, Any]) -> Pending:
    row_id = (
        await conn.execute(
            text("INSERT INTO outbox (target, body) VALUES (:t, CAST(:b AS jsonb)) RETURNING id"),
            {"t": target, "b": json.dumps(body, default=str)},
        )
    ).scalar_one()
    return Pending(row_id, target, body)


async def add_many(
    conn: AsyncConnection, messages: list[tuple[str, dict[str, Any]]]
) -> list[Pending]:
    """Several outbox records, each with its own target, in one statement."""
    if not messages:
        return []
    ids = (
        (
            await conn.execute(
                text(
                    "INSERT INTO outbox (target, body) "
                    "SELECT t, CAST(b AS jsonb) "
                    "FROM unnest(CAST(:ts AS text[]), CAST(:bs AS text[])) AS m(t, b) "
                    "RETURNING id"
                ),
                {
                    "ts": [t for t, _ in messages],
                    "bs": [json.dumps(b, default=str) for _, b in messages],
                },
            )
        )
        .scalars()
        .all()
    )
    return [Pending(i, t, b) for i, (t, b) in zip(ids, messages, strict=True)]


class Outbox:
    def __init__(self, engine: AsyncEngine, publisher: Publisher) -> None:
        self.engine = engine
        self.publisher = publisher
        self._published: list[int] = []  # confirmed, to be deleted by delete_published
        self._in_flight: set[int] = set()  # being published here, not yet confirmed

    async def _publish(self, rows: list[Pending]) -> list[int]:
        results = await asyncio.gather(
            *(self.publisher.publish(r.target, r.body) for r in rows), return_exceptions=True
        )
        done = [r.id for r, res in zip(rows, results, strict=True) if res is None]
        failed = [res for res in results if res is not None]
        if failed:
            log.warning(
                "%d outbox messages not published yet (the relay retries): %s",
                len(failed),
                failed[0],
            )
        return done

    async def publish_now(self, rows: list[Pending]) -> None:
        """Publish rows just committed; whatever fails stays for the relay. Never raises.

        Published rows are deleted in batches by ``delete_published`` (every manager runs it):
        a crash before that only makes the relay publish them again, a harmless duplicate.
        """
        if not rows:
            return
        ids = {r.id for r in rows}
        self._in_flight |= ids  # a confirm can take longer than the relay's grace (fsync)
        try:
            self._published.extend(await self._publish(rows))
        except Exception as exc:
            log.warning("outbox fast path failed (the relay retries): %s", exc)
        finally:
            self._in_flight -= ids

    async def delete_published(self) -> int:
        """Delete confirmed rows; they stay in the relay's skip list until the delete commits."""
        ids = list(self._published)
        if ids:
            async with self.engine.begin() as conn:
                await conn.execute(text("DELETE FROM outbox WHERE id = ANY(:ids)"), {"ids": ids})
            done = set(ids)
            self._published = [i for i in self._published if i not in done]
        return len(ids)

    async def relay_once(self, *, grace: float, limit: int = 500) -> int:
        """Publish rows older than ``grace`` seconds; returns how many were published."""
        async with self.engine.begin() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT id, target, body FROM outbox "
                        "WHERE created_at < now() - make_interval(secs => :g) "
                        "AND NOT (id = ANY(:skip)) "
                        "ORDER BY id LIMIT :n FOR UPDATE SKIP LOCKED"
                    ),
                    {"g": grace, "n": limit, "skip": [*self._published, *self._in_flight]},
                )
            ).all()
            if not rows:
                return 0
            done = await self._publish([Pending(r.id, r.target, r.body) for r in rows])
            await conn.execute(text("DELETE FROM outbox WHERE id = ANY(:ids)"), {"ids": done})
            return len(done)
