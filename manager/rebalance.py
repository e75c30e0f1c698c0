"""Rebalance: move running observers until every live service runs its fair share of its pool,
weighted by worker_count. Run by the leader; each move is one graceful handoff to a named
service of the same pool.

Stability rules: targets are whole numbers that add up to what runs (no service is asked for a
fraction), ties keep observers where they are, a fleet where every service is within
``tolerance`` of its share is left alone (a rebalance begins once one is outside, and then goes
on to the exact shares), a round waits while the previous round's moves
are between holders (at most ``landing`` seconds) and while a dead service's observers are (a
recovery), an observer that reached its target is not
moved again within the cooldown, and a service must have lived ``min_age`` seconds before it
receives work (a flapping service receives none). Only services whose control queue exists take
part: a lease does not say that a handoff reaches its holder, nor a directed start its target.
A service seen without its control queue is as new as a flapping one: ``min_age`` counts again
from then. A move that did not reach its target is forgotten: a handoff that never arrived, or
bounced to the work queue, neither holds its observer back nor stops the next rounds.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from orch_contracts.pools import DEFAULT_POOL
from orch_manager import repository as repo
from orch_manager.background import on_broker
from orch_manager.metrics import ManagerMetrics
from orch_manager.outbox import Outbox
from orch_manager.publisher import Publisher
from orch_manager.store import ManagerStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Load:
    service_id: uuid.UUID
    worker_count: int
    running: int
    pool: str = DEFAULT_POOL


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


def _by_pool(loads: list[Load]) -> list[list[Load]]:
    """The loads of each pool, pools in name order."""
    return [[x for x in loads if x.pool == pool] for pool in sorted({x.pool for x in loads})]


def plan_pools(loads: list[Load], *, pace: float) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """(from, to) moves within each pool (a service runs only its pool's observers), at most
    ``pace`` of what runs in the pool at once (one at least)."""
    moves: list[tuple[uuid.UUID, uuid.UUID]] = []
    for group in _by_pool(loads):
        budget = max(1, math.ceil(sum(x.running for x in group) * pace))
        moves += plan_moves(group, max_moves=budget)
    return moves


def balanced(loads: list[Load], tolerance: float) -> bool:
    """Whether every service of every pool runs its share give or take ``tolerance`` of it
    (rounded down: a share under ``1 / tolerance`` is met exactly)."""
    for group in _by_pool(loads):
        goal = targets(group)
        if any(abs(x.running - goal[x.service_id]) > goal[x.service_id] * tolerance for x in group):
            return False
    return True


def plan_round(
    loads: list[Load], *, pace: float, tolerance: float, evening: bool
) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """A round's moves. A fleet where every service runs within ``tolerance`` of its share is
    left as it is (each move costs its observer a gap), unless a rebalance is under way
    (``evening``: the last round planned moves): one that began, because a service was outside
    that band, goes on to the exact shares."""
    if not evening and balanced(loads, tolerance):
        return []
    return plan_pools(loads, pace=pace)


@dataclass(frozen=True)
class Move:
    at: float  # monotonic
    to: uuid.UUID


@dataclass(frozen=True)
class Seen:
    """Where a moved observer is now."""

    observer_id: uuid.UUID
    holder: uuid.UUID | None
    #: Released by the holder that was asked to hand it over, taken by nobody yet.
    in_motion: bool


@dataclass
class Ledger:
    """The moves asked for. One counts once its observer runs on the target: it is not moved
    again within ``cooldown``. One whose observer is not there after ``landing`` seconds is
    forgotten: its handoff was dropped (the holder had no control queue), its start bounced to
    the work queue (the target had none) or was lost with a control queue that went away."""

    cooldown: float
    landing: float
    sent: dict[uuid.UUID, Move] = field(default_factory=dict)  # observer -> move
    landed: dict[uuid.UUID, float] = field(default_factory=dict)  # observer -> when moved
    #: The observers whose moves the last ``update`` forgot: their rows' record of the move
    #: (``observers.handoff_to``) is cleared, so a handoff sent later by anyone finds none.
    forgotten: list[uuid.UUID] = field(default_factory=list)

    def record(self, moves: Iterable[tuple[uuid.UUID, uuid.UUID]], now: float) -> None:
        """(observer, target) handoffs just asked for."""
        self.sent.update({o: Move(now, to) for o, to in moves})

    def update(self, seen: Iterable[Seen], now: float) -> int:
        """Settle the moves from where their observers are; returns how many are in motion and
        not yet given up on (a round waits for them)."""
        where = {s.observer_id: s for s in seen}
        in_motion = 0
        self.forgotten = []
        for o, move in list(self.sent.items()):
            s = where.get(o)
            if s is not None and s.holder == move.to:
                self.landed[o] = move.at
                del self.sent[o]
            elif s is None or now - move.at >= self.landing:
                del self.sent[o]
                self.forgotten.append(o)
            elif s.in_motion:
                in_motion += 1
        self.landed = {o: t for o, t in self.landed.items() if now - t < self.cooldown}
        if self.forgotten:
            log.info(
                "rebalance: %d moves did not reach their target; forgotten", len(self.forgotten)
            )
        return in_motion

    def recent(self) -> list[uuid.UUID]:
        """Observers not to pick: moving, or moved within the cooldown."""
        return [*self.sent, *self.landed]


@dataclass
class Sightings:
    """When this leader last saw each service without its control queue. A service takes part
    in a round only while its queue exists and once it has not been seen without it for
    ``min_age`` seconds: one back from a partition is old by its row, not by its connection."""

    min_age: float
    off: dict[uuid.UUID, float] = field(default_factory=dict)  # service -> when (monotonic)

    def steady(self, loads: list[Load], present: set[uuid.UUID], now: float) -> list[Load]:
        for s in loads:
            if s.service_id not in present:
                self.off[s.service_id] = now
        self.off = {sid: t for sid, t in self.off.items() if now - t < self.min_age}
        return [s for s in loads if s.service_id in present and s.service_id not in self.off]


#: Seconds rounds are planned without a target that could take nothing of its donors'.
FRUITLESS_FOR = 30.0


@dataclass
class Rebalancer:
    store: ManagerStore
    box: Outbox
    publisher: Publisher
    #: Fraction of the running observers that may be in motion at once.
    pace: float
    min_age: float
    cooldown: float
    #: A move whose observer is not on its target after this many seconds is forgotten.
    landing: float
    metrics: ManagerMetrics
    #: Nothing moves while every service runs within this fraction of its share (a
    #: rebalance under way goes on to the exact shares).
    tolerance: float = 0.0
    ledger: Ledger = field(init=False)
    sightings: Sightings = field(init=False)
    #: Targets that could take none of what their donors run (they lack its kinds), and until
    #: when (monotonic) rounds are planned without them: a round all for such a target would
    #: move nothing, and the others would never be evened out.
    fruitless: dict[uuid.UUID, float] = field(default_factory=dict)
    #: The last round planned moves: a rebalance is under way.
    evening: bool = False

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.cooldown, self.landing)
        self.sightings = Sightings(self.min_age)

    async def once(self) -> int:
        now = time.monotonic()
        async with self.store.transaction() as tx:
            seen: list[Seen] = []
            if self.ledger.sent:
                where = await repo.where_moved(tx, list(self.ledger.sent))
                seen = [Seen(r.id, r.service_id, r.in_motion) for r in where]
            in_motion = self.ledger.update(seen, now)
            if self.ledger.forgotten:
                await repo.clear_handoffs(tx, self.ledger.forgotten)
            if in_motion:
                return 0  # the previous round is still landing
            if await repo.any_orphan(tx):
                # A dead service's observers are still moving (the broker's requeue, the
                # sweeper's re-dispatch): loads are half-way, and the observers moved first are
                # the ones a round would pick. Five services killed at once: 864 of 25,000
                # moved observers were moved again by rounds during the recovery.
                return 0
            loads = [
                Load(r.id, r.worker_count, r.running, r.pool)
                for r in await repo.loads(tx, self.min_age)
            ]
            present = await on_broker(self.publisher, [s.service_id for s in loads])
            loads = self.sightings.steady(loads, present, now)
            self.fruitless = {sid: t for sid, t in self.fruitless.items() if t > now}
            loads = [x for x in loads if x.service_id not in self.fruitless]
            moves = plan_round(
                loads, pace=self.pace, tolerance=self.tolerance, evening=self.evening
            )
            self.evening = bool(moves)
            recent = self.ledger.recent()
            runs = await repo.kinds_run(tx, [x.service_id for x in loads])
            handoffs: list[repo.Handoff] = []
            for (donor, target), n in Counter(moves).items():
                # Only observers the target runs: its pool's, of its kinds (it would pass the
                # others on); and none that has just started (moved off a dead service, say):
                # an observer pays for a move with a gap, and is not made to pay twice in a row.
                picked = await repo.pick_to_move(
                    tx,
                    donor,
                    recent=recent,
                    n=n,
                    runs=runs.get(target, repo.Runs()),
                    settled=self.min_age,
                )
                recent = [*recent, *picked]
                handoffs += [(o, donor, target) for o in picked]
            for target in {t for _, t in moves} - {t for _, _, t in handoffs}:
                self.fruitless[target] = now + FRUITLESS_FOR
            handoffs, pending = await repo.request_handoffs(tx, handoffs)
            self.ledger.record([(o, t) for o, _, t in handoffs], now)
        if pending:
            log.info("rebalance: moving %d observers", len(pending))
            self.metrics.moves.labels("rebalance").inc(len(pending))
        if len(handoffs) < len(moves):
            log.info(
                "rebalance: %d of %d planned moves found nothing to move (moved recently, or "
                "of kinds the target does not run)",
                len(moves) - len(handoffs),
                len(moves),
            )
        self.box.publish_soon(pending)
        return len(pending)
