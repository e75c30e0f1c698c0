"""The service's reads and writes in Postgres. Every write for a running observer is fenced by
its epoch: it lands only while that epoch is still the observer's."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg

from contracts.statuses import ObserverStatus
from observer_service.take import Decision, Facts, decide


@dataclass(frozen=True)
class Taken:
    observer_id: uuid.UUID
    name: str
    kind: str
    params: dict[str, Any]
    checkpoint: Any
    restart_policy: dict[str, Any] | None
    epoch: int
    dispatch_id: uuid.UUID


@dataclass(frozen=True)
class TakeResult:
    decision: Decision
    taken: Taken | None = None
    #: For WAIT: seconds until the holder's lease expires.
    holder_remaining: float = 0.0


_FACTS_SQL = """
SELECT o.status, o.dispatch_id, o.service_id, o.epoch, o.name, o.kind, o.params, o.checkpoint,
       o.restart_policy, s.lock_key,
       (s.id IS NOT NULL AND NOT s.is_deleted AND s.lease_expires_at > clock_timestamp())
           AS holder_live,
       EXTRACT(EPOCH FROM (s.lease_expires_at - clock_timestamp()))::float8 AS holder_remaining
  FROM observers o LEFT JOIN services s ON s.id = o.service_id
 WHERE o.id = $1
   FOR UPDATE OF o
"""


class Store:
    def __init__(self, pool: asyncpg.Pool, service_id: uuid.UUID) -> None:
        self.pool = pool
        self.me = service_id

    async def take(
        self,
        observer_id: uuid.UUID,
        dispatch_id: uuid.UUID,
        *,
        redelivered: bool,
        running_here_on_open_channel: bool,
    ) -> TakeResult:
        """Decide on a start message with the observer's row locked; on TAKE, bump the epoch."""
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(_FACTS_SQL, observer_id)
            if row is None:
                return TakeResult(Decision.DROP_MISSING)
            facts = Facts(
                exists=True,
                status=ObserverStatus(row["status"]),
                dispatch_current=row["dispatch_id"] == dispatch_id,
                holder=row["service_id"],
                holder_live=bool(row["holder_live"]),
            )

            def decide_with(f: Facts) -> Decision:
                return decide(
                    f,
                    me=self.me,
                    redelivered=redelivered,
                    running_here_on_open_channel=running_here_on_open_channel,
                )

            decision = decide_with(facts)
            if decision is Decision.CHECK_HOLDER_LOCK:
                # The holder keeps a session-level advisory lock for as long as its process
                # lives; getting it (for this transaction only) proves that session has ended.
                gone = await conn.fetchval("SELECT pg_try_advisory_xact_lock($1)", row["lock_key"])
                decision = decide_with(dataclasses.replace(facts, holder_gone=bool(gone)))
            if decision is Decision.DROP_DELETED and row["status"] != ObserverStatus.DELETED:
                await conn.execute(
                    "UPDATE observers SET status = 'deleted', service_id = NULL, "
                    "modified_at = now() WHERE id = $1",
                    observer_id,
                )
                await self._event(conn, observer_id, "deleted", row["epoch"], "not running")
            if decision is not Decision.TAKE:
                return TakeResult(decision, holder_remaining=float(row["holder_remaining"] or 0))
            epoch = await conn.fetchval(
                "UPDATE observers SET status = 'processing', service_id = $2, epoch = epoch + 1, "
                "started_at = now(), modified_at = now() WHERE id = $1 RETURNING epoch",
                observer_id,
                self.me,
            )
            detail = f"from {row['service_id']}" if row["service_id"] else None
            await self._event(conn, observer_id, "taken", epoch, detail)
            return TakeResult(
                decision,
                Taken(
                    observer_id=observer_id,
                    name=row["name"],
                    kind=row["kind"],
                    params=json.loads(row["params"]),
                    checkpoint=json.loads(row["checkpoint"]) if row["checkpoint"] else None,
                    restart_policy=(
                        json.loads(row["restart_policy"]) if row["restart_policy"] else None
                    ),
                    epoch=epoch,
                    dispatch_id=dispatch_id,
                ),
            )

    async def release(self, held: list[tuple[uuid.UUID, int]], reason: str) -> set[uuid.UUID]:
        """Let go of observers (still processing) so that others take them without a wait."""
        if not held:
            return set()
        async with self.pool.acquire() as conn, conn.transaction():
            rows = await conn.fetch(
                """
                UPDATE observers o SET service_id = NULL, modified_at = now()
                  FROM unnest($1::uuid[], $2::bigint[]) AS v(id, epoch)
                 WHERE o.id = v.id AND o.epoch = v.epoch AND o.service_id = $3
                   AND o.status = 'processing'
                RETURNING o.id, o.epoch
                """,
                [h[0] for h in held],
                [h[1] for h in held],
                self.me,
            )
            await self._events(conn, [(r["id"], r["epoch"]) for r in rows], "released", reason)
        return {r["id"] for r in rows}

    async def release_orphans(self, keep: set[uuid.UUID]) -> int:
        """Release what the database says we hold but we do not run (after a fence)."""
        result = await self.pool.execute(
            "UPDATE observers SET service_id = NULL, modified_at = now() "
            "WHERE service_id = $1 AND status = 'processing' AND NOT (id = ANY($2::uuid[]))",
            self.me,
            list(keep),
        )
        return int(result.split()[-1])

    async def mark_deleted(self, observer_id: uuid.UUID, epoch: int) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            done = await conn.fetchval(
                "UPDATE observers SET status = 'deleted', service_id = NULL, modified_at = now() "
                "WHERE id = $1 AND epoch = $2 AND status = 'on_deleting' RETURNING true",
                observer_id,
                epoch,
            )
            if done:
                await self._event(conn, observer_id, "deleted", epoch, "stopped by holder")
        return bool(done)

    async def record_restart(self, observer_id: uuid.UUID, epoch: int, error: str) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            done = await conn.fetchval(
                "UPDATE observers SET restart_count = restart_count + 1, last_error = $3, "
                "modified_at = now() WHERE id = $1 AND epoch = $2 AND status = 'processing' "
                "RETURNING true",
                observer_id,
                epoch,
                error,
            )
            if done:
                await self._event(conn, observer_id, "restarted", epoch, error)
        return bool(done)

    async def mark_failed(self, observer_id: uuid.UUID, epoch: int, error: str) -> bool:
        async with self.pool.acquire() as conn, conn.transaction():
            done = await conn.fetchval(
                "UPDATE observers SET status = 'failed', service_id = NULL, last_error = $3, "
                "modified_at = now() WHERE id = $1 AND epoch = $2 AND status = 'processing' "
                "RETURNING true",
                observer_id,
                epoch,
                error,
            )
            if done:
                await self._event(conn, observer_id, "failed", epoch, error)
        return bool(done)

    async def _event(
        self,
        conn: asyncpg.Connection,
        observer_id: uuid.UUID,
        event: str,
        epoch: int,
        detail: str | None,
    ) -> None:
        await conn.execute(
            "INSERT INTO observer_events (observer_id, event, service_id, epoch, detail) "
            "VALUES ($1, $2, $3, $4, $5)",
            observer_id,
            event,
            self.me,
            epoch,
            detail,
        )

    async def _events(
        self, conn: asyncpg.Connection, held: list[tuple[uuid.UUID, int]], event: str, detail: str
    ) -> None:
        if held:
            await conn.execute(
                "INSERT INTO observer_events (observer_id, event, service_id, epoch, detail) "
                "SELECT v.id, $3, $4, v.epoch, $5 FROM unnest($1::uuid[], $2::bigint[]) "
                "AS v(id, epoch)",
                [h[0] for h in held],
                [h[1] for h in held],
                event,
                self.me,
                detail,
            )
