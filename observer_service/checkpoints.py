"""Fenced checkpoint writes, batched: one UPDATE carries every checkpoint queued meanwhile."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg

from observer_service.errors import Fenced

_BATCH_SQL = """
UPDATE observers AS o
   SET checkpoint = v.cp::jsonb, checkpointed_at = clock_timestamp(), modified_at = now()
  FROM unnest($1::uuid[], $2::bigint[], $3::text[]) AS v(id, epoch, cp)
 WHERE o.id = v.id AND o.epoch = v.epoch AND o.status IN ('processing', 'on_deleting')
RETURNING o.id, o.epoch
"""

_Pending = tuple[uuid.UUID, int, str, asyncio.Future[None]]


class CheckpointWriter:
    """Writes checkpoints as they come when idle, and in batches under load."""

    def __init__(self, pool: asyncpg.Pool, *, max_batch: int = 1000) -> None:
        self._pool = pool
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._max_batch = max_batch

    async def write(self, observer_id: uuid.UUID, epoch: int, state: Any) -> None:
        """Save ``state``; raises Fenced when ``epoch`` is no longer the observer's."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((observer_id, epoch, json.dumps(state), fut))
        await fut

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            live = [p for p in batch if not p[3].done()]
            if live:
                await self._flush(live)

    async def _flush(self, batch: list[_Pending]) -> None:
        # One row per observer: the newest state wins, the older writes share its outcome.
        newest = list({p[0]: p for p in batch}.values())
        try:
            rows = await self._pool.fetch(
                _BATCH_SQL, [p[0] for p in newest], [p[1] for p in newest], [p[2] for p in newest]
            )
        except Exception as exc:
            for p in batch:
                if not p[3].done():
                    p[3].set_exception(exc)
            return
        accepted = {(r["id"], r["epoch"]) for r in rows}
        for observer_id, epoch, _, fut in batch:
            if fut.done():
                continue
            if (observer_id, epoch) in accepted:
                fut.set_result(None)
            else:
                fut.set_exception(Fenced(f"checkpoint of epoch {epoch} refused"))
