"""Leader election over a Postgres lease: exactly one manager runs the background loops.

Acquire takes the row only when it has expired (or is already ours); renew extends it only while
we still hold it. The loops are cancelled the moment a renewal fails or the local deadline
(monotonic, from when the renewal was sent) passes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from contracts.settings import default_host

log = logging.getLogger(__name__)

_ACQUIRE = """
INSERT INTO leader_leases AS l (name, holder, acquired_at, expires_at)
VALUES (:name, :holder, now(), clock_timestamp() + make_interval(secs => :ttl))
ON CONFLICT (name) DO UPDATE
   SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at,
       acquired_at = CASE WHEN l.holder = EXCLUDED.holder THEN l.acquired_at ELSE now() END
 WHERE l.expires_at <= clock_timestamp() OR l.holder = EXCLUDED.holder
RETURNING holder
"""

_RENEW = """
UPDATE leader_leases SET expires_at = clock_timestamp() + make_interval(secs => :ttl)
 WHERE name = :name AND holder = :holder AND expires_at > clock_timestamp()
RETURNING holder
"""

Loop = Callable[[], Coroutine[Any, Any, None]]


def new_holder_id() -> str:
    return f"{default_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Leadership:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        loops: dict[str, Loop],
        ttl: float,
        name: str = "manager",
        holder: str | None = None,
    ) -> None:
        self.engine = engine
        self.loops = loops
        self.ttl = ttl
        self.name = name
        self.holder = holder or new_holder_id()
        self.renew_interval = ttl / 5
        self.margin = min(1.0, ttl / 5)
        self.is_leader = False

    async def _exec(self, sql: str) -> bool:
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    text(sql), {"name": self.name, "holder": self.holder, "ttl": self.ttl}
                )
            ).one_or_none()
        return row is not None

    async def run(self) -> None:
        while True:
            sent = time.monotonic()
            try:
                won = await asyncio.wait_for(self._exec(_ACQUIRE), self.ttl / 2)
            except Exception as exc:
                log.warning("leader election failed: %s", exc)
                won = False
            if won:
                await self._lead(sent + self.ttl - self.margin)
            await asyncio.sleep(self.renew_interval)

    async def _lead(self, valid_until: float) -> None:
        self.is_leader = True
        log.info("%s leads (%s)", self.holder, ", ".join(self.loops))
        tasks: list[asyncio.Task[None]] = [
            asyncio.create_task(fn(), name=f"leader:{n}") for n, fn in self.loops.items()
        ]
        try:
            while True:
                done, _ = await asyncio.wait(
                    tasks,
                    timeout=max(0.0, min(self.renew_interval, valid_until - time.monotonic())),
                )
                for t in done:
                    raise RuntimeError(f"leader loop {t.get_name()} died") from t.exception()
                sent = time.monotonic()
                try:
                    ok = await asyncio.wait_for(self._exec(_RENEW), max(0.05, valid_until - sent))
                except Exception as exc:
                    log.warning("leader renewal failed: %s", exc)
                    ok = False
                if not ok or time.monotonic() >= valid_until:
                    log.warning(
                        "%s lost the leadership; stopping the background loops", self.holder
                    )
                    return
                valid_until = sent + self.ttl - self.margin
        finally:
            self.is_leader = False
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def release(self) -> None:
        try:
            async with self.engine.begin() as conn:
                await conn.execute(
                    text("DELETE FROM leader_leases WHERE name = :name AND holder = :holder"),
                    {"name": self.name, "holder": self.holder},
                )
        except Exception as exc:
            log.warning("could not release the leadership: %s", exc)


async def current_leader(engine: AsyncEngine, name: str = "manager") -> dict[str, object] | None:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT holder, acquired_at, expires_at, "
                    "expires_at > clock_timestamp() AS live "
                    "FROM leader_leases WHERE name = :name"
                ),
                {"name": name},
            )
        ).one_or_none()
    return None if row is None else dict(row._mapping)
