"""The service's reads and writes in Postgres. Every write for a running observer is fenced by
its epoch: it lands only while that epoch is still the observer's.

Each write is one statement (its history event inserted in the same statement), so it costs one
round trip and needs no explicit transaction.
"""

from __future__ import annotations

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


# A live holder keeps a session-level advisory lock for as long as its process lives; getting
# it (for this statement only) proves that session has ended. It never comes back: a new
# process takes a new key. So the proof stays true after the statement.
_FACTS = """
SELECT f.*, CASE WHEN f.holder_live THEN pg_try_advisory_xact_lock(f.lock_key) END AS holder_gone
  FROM (SELECT o.status, o.dispatch_id, o.service_id, o.epoch, o.name, o.kind, o.params,
               o.checkpoint, o.restart_policy, s.lock_key,
               (s.id IS NOT NULL AND NOT s.is_deleted
                AND s.lease_expires_at > clock_timestamp()) AS holder_live,
               EXTRACT(EPOCH FROM (s.lease_expires_at - clock_timestamp()))::float8
                   AS holder_remaining
          FROM observers o LEFT JOIN services s ON s.id = o.service_id
         WHERE o.id = $1) AS f
"""


def _with_event(update: str, event: str, detail: str) -> str:
    """``update`` (returning id and epoch) plus one history row per updated observer."""
    return f"""
WITH u AS ({update}),
     e AS (INSERT INTO observer_events (observer_id, event, service_id, epoch, detail)
           SELECT u.id, '{event}', $2::uuid, u.epoch, {detail} FROM u)
SELECT id, epoch FROM u
"""


# $1 observer, $2 me, $3 epoch seen, $4 dispatch seen, $5 status seen, $6 holder seen: the
# compare-and-set stands in for a row lock (the epoch is the row's version).
_UNCHANGED = (
    "id = $1 AND epoch = $3 AND dispatch_id = $4 AND status = $5 "
    "AND service_id IS NOT DISTINCT FROM $6"
)
_TAKE = _with_event(
    "UPDATE observers SET status = 'processing', service_id = $2, epoch = epoch + 1, "
    f"started_at = now(), modified_at = now() WHERE {_UNCHANGED} RETURNING id, epoch",
    "taken",
    "$7::text",
)
_DELETE_UNRUN = _with_event(
    "UPDATE observers SET status = 'deleted', service_id = NULL, modified_at = now() "
    f"WHERE {_UNCHANGED} RETURNING id, epoch",
    "deleted",
    "'not running'",
)
# $1 observers, $2 me, $3 epochs, $4 detail
_RELEASE = _with_event(
    "UPDATE observers o SET service_id = NULL, modified_at = now() "
    "FROM unnest($1::uuid[], $3::bigint[]) AS v(id, epoch) "
    "WHERE o.id = v.id AND o.epoch = v.epoch AND o.service_id = $2 AND o.status = 'processing' "
    "RETURNING o.id, o.epoch",
    "released",
    "$4::text",
)
# $1 observer, $2 me, $3 epoch, $4 error
_MARK_DELETED = _with_event(
    "UPDATE observers SET status = 'deleted', service_id = NULL, modified_at = now() "
    "WHERE id = $1 AND epoch = $3 AND status = 'on_deleting' "
    "RETURNING id, epoch",
    "deleted",
    "$4::text",
)
_RESTARTED = _with_event(
    "UPDATE observers SET restart_count = restart_count + 1, last_error = $4, "
    "modified_at = now() WHERE id = $1 AND epoch = $3 AND status = 'processing' "
    "RETURNING id, epoch",
    "restarted",
    "$4::text",
)
_FAILED = _with_event(
    "UPDATE observers SET status = 'failed', service_id = NULL, last_error = $4, "
    "modified_at = now() WHERE id = $1 AND epoch = $3 AND status = 'processing' "
    "RETURNING id, epoch",
    "failed",
    "$4::text",
)


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
        """Decide on a start message from the observer's row; on TAKE, bump the epoch.

        Read, decide, then write only if the row is still as read; if it changed in between,
        decide again on the new row.
        """
        while True:
            row = await self.pool.fetchrow(_FACTS, observer_id)
            if row is None:
                return TakeResult(Decision.DROP_MISSING)
            facts = Facts(
                exists=True,
                status=ObserverStatus(row["status"]),
                dispatch_current=row["dispatch_id"] == dispatch_id,
                holder=row["service_id"],
                holder_live=bool(row["holder_live"]),
                holder_gone=bool(row["holder_gone"]),
            )
            decision = decide(
                facts,
                me=self.me,
                redelivered=redelivered,
                running_here_on_open_channel=running_here_on_open_channel,
            )
            seen = (
                observer_id,
                self.me,
                row["epoch"],
                row["dispatch_id"],
                row["status"],
                row["service_id"],
            )
            unrun = decision is Decision.DROP_DELETED and row["status"] != ObserverStatus.DELETED
            if unrun and await self.pool.fetchrow(_DELETE_UNRUN, *seen) is None:
                continue  # changed meanwhile: decide again
            if decision is not Decision.TAKE:
                return TakeResult(decision, holder_remaining=float(row["holder_remaining"] or 0))
            detail = f"from {row['service_id']}" if row["service_id"] else None
            taken = await self.pool.fetchrow(_TAKE, *seen, detail)
            if taken is None:
                continue
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
                    epoch=taken["epoch"],
                    dispatch_id=dispatch_id,
                ),
            )

    async def release(self, held: list[tuple[uuid.UUID, int]], reason: str) -> set[uuid.UUID]:
        """Let go of observers (still processing) so that others take them without a wait."""
        if not held:
            return set()
        rows = await self.pool.fetch(
            _RELEASE, [h[0] for h in held], self.me, [h[1] for h in held], reason
        )
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

    async def _fenced(self, sql: str, observer_id: uuid.UUID, epoch: int, text: str) -> bool:
        return await self.pool.fetchrow(sql, observer_id, self.me, epoch, text) is not None

    async def mark_deleted(self, observer_id: uuid.UUID, epoch: int) -> bool:
        return await self._fenced(_MARK_DELETED, observer_id, epoch, "stopped by holder")

    async def record_restart(self, observer_id: uuid.UUID, epoch: int, error: str) -> bool:
        return await self._fenced(_RESTARTED, observer_id, epoch, error)

    async def mark_failed(self, observer_id: uuid.UUID, epoch: int, error: str) -> bool:
        return await self._fenced(_FAILED, observer_id, epoch, error)
