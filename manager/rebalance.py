"""Rebalance: move running observers until every live service runs its fair share, weighted by
worker_count. Run by the leader; each move is one graceful handoff to a named service.

Stability rules: targets are whole numbers that add up to what runs (no service is asked for a
fraction), ties keep observers where they are, a round waits until the previous round's moves
have landed, an observer moved once is not moved again within the cooldown, and a service must
have lived ``min_age`` seconds before it receives work (a flapping service receives none).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from contracts.messages import HandoffMessage
from contracts.routing import Destination
from contracts.statuses import Event
from manager import outbox
from manager import queries as q
from manager.db import transaction
from manager.metrics import ManagerMetrics
from manager.outbox import Outbox
from manager.repository import record_events

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    service_id: uuid.UUID
    worker_count: int
    running: int


def targets(loads: list[Load]) -> dict[uuid.UUID, int]:
    """Each service's whole-number share of what runs, by weight; the remainders go to the
    largest fractions, ties to whoever already runs more (so nothing moves for a tie)."""
    total = sum(s.running for s in loads)
    weight = sum(s.worker_count for s in loads)
    if not loads or weight == 0:
        return {}
    exact = {s.service_id: total * s.worker_count / weight for s in loads}
    result = {sid: math.floor(x) for sid, x in exact.items()}
    left = total - sum(result.values())
    order = sorted(
        loads, key=lambda s: (exact[s.service_id] - result[s.service_id], s.running), reverse=True
    )
    for s in order[:left]:
        result[s.service_id] += 1
    return result


def plan_moves(loads: list[Load], *, max_moves: int) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """(from, to) moves, at most ``max_moves``, that bring services toward their targets."""
    goal = targets(loads)
    surplus = {s.service_id: s.running - goal[s.service_id] for s in loads}
    donors = sorted((sid for sid, x in surplus.items() if x > 0), key=lambda k: -surplus[k])
    takers = sorted((sid for sid, x in surplus.items() if x < 0), key=lambda k: surplus[k])
    moves: list[tuple[uuid.UUID, uuid.UUID]] = []
    while donors and takers and len(moves) < max_moves:
        d, t = donors[0], takers[0]
        moves.append((d, t))
        surplus[d] -= 1
        surplus[t] += 1
        if surplus[d] == 0:
            donors.pop(0)
        if surplus[t] == 0:
            takers.pop(0)
    return moves


@dataclass
class Rebalancer:
    engine: AsyncEngine
    box: Outbox
    #: Fraction of the running observers that may be in motion at once.
    pace: float
    min_age: float
    cooldown: float
    metrics: ManagerMetrics
    moved: dict[uuid.UUID, float] = field(default_factory=dict)  # observer -> when (monotonic)

    async def once(self) -> int:
        now = time.monotonic()
        self.moved = {o: t for o, t in self.moved.items() if now - t < self.cooldown}
        async with transaction(self.engine) as conn:
            if self.moved:
                landing = (
                    await conn.execute(text(q.IN_MOTION), {"ids": list(self.moved)})
                ).scalar_one()
                if landing:
                    return 0  # the previous round is still landing
            rows = (await conn.execute(text(q.LOADS), {"age": self.min_age})).all()
            loads = [Load(r.id, r.worker_count, r.running) for r in rows]
            total = sum(x.running for x in loads)
            moves = plan_moves(loads, max_moves=max(1, math.ceil(total * self.pace)))
            handoffs: list[tuple[uuid.UUID, uuid.UUID, uuid.UUID]] = []  # observer, from, to
            for donor in {d for d, _ in moves}:
                to = [t for d, t in moves if d == donor]
                picked = (
                    (
                        await conn.execute(
                            text(q.PICK_TO_MOVE),
                            {"s": donor, "recent": list(self.moved), "n": len(to)},
                        )
                    )
                    .scalars()
                    .all()
                )
                handoffs += [(o, donor, t) for o, t in zip(picked, to, strict=False)]
            pending = await outbox.add_many(
                conn,
                [
                    (Destination.service(d), HandoffMessage(observer_id=o, to=t))
                    for o, d, t in handoffs
                ],
            )
            await record_events(
                conn,
                [o for o, _, _ in handoffs],
                Event.HANDOFF_REQUESTED,
                [f"from {d} to {t}" for _, d, t in handoffs],
            )
            self.moved.update({o: now for o, _, _ in handoffs})
        if pending:
            log.info("rebalance: moving %d observers", len(pending))
            self.metrics.moves.labels("rebalance").inc(len(pending))
        await self.box.publish_now(pending)
        return len(pending)
