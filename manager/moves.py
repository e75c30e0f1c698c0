"""The leader's mover: observers moved to another pool or version (``POST /observers/move``)
that still run where they cannot run any more are handed over, each gracefully (its holder
stops it and sends its start to the target, which resumes it from its checkpoint), at most
``in_flight`` at once.

``observers.moved_at`` marks the observers to look at; the mark goes once an observer runs
where it may, or nothing runs it (a move re-dispatched those nobody held; paused and failed
ones start where they belong when resumed or restarted). A handoff whose observer is not on its
target after ``landing`` seconds is forgotten (its record on the row cleared) and asked again.
The target is chosen as every directed start's is (``background.place``): a live service of the
observer's new pool that runs its kind in its version and has room; with none, the observer
runs on where it is until one has. One whose holder died is the sweeper's.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from orch_contracts.statuses import ObserverStatus
from orch_manager import repository as repo
from orch_manager.background import place, reachable, reachable_slots
from orch_manager.metrics import ManagerMetrics
from orch_manager.outbox import Outbox
from orch_manager.publisher import Publisher
from orch_manager.store import ManagerStore, Row

log = logging.getLogger(__name__)

#: Observers read in one pass, oldest ask first.
BATCH = 1000


def misplaced(row: Row) -> bool:
    """Whether ``row`` (``queries.MOVING``) runs on a live holder that cannot run it now."""
    if row.status != ObserverStatus.PROCESSING or row.service_id is None or not row.holder_live:
        return False
    needs = repo.Needs(row.pool, row.kind, row.kind_version)
    return not repo.Runs.of(row.holder_pool, row.holder_kinds).can(needs)


@dataclass
class Mover:
    store: ManagerStore
    box: Outbox
    publisher: Publisher
    #: Handoffs go only to services whose lease outlives this many seconds.
    margin: float
    metrics: ManagerMetrics
    #: Handoffs in motion at once, at most.
    in_flight: int
    #: A handoff whose observer is not on its target after this many seconds is asked again.
    landing: float
    #: Handoffs asked for: observer -> when (monotonic).
    sent: dict[uuid.UUID, float] = field(default_factory=dict)

    async def once(self) -> int:
        now = time.monotonic()
        forgotten = [o for o, at in self.sent.items() if now - at >= self.landing]
        for o in forgotten:
            del self.sent[o]
        async with self.store.transaction() as tx:
            if forgotten:
                await repo.clear_handoffs(tx, forgotten)
            rows = await repo.moving(tx, BATCH)
            # Where it may run, or nothing runs it: the mover is done with it. One whose holder
            # died keeps its mark (the sweeper re-dispatches it, then it is seen again).
            done = [
                r.id for r in rows if not misplaced(r) and (r.holder_live or r.service_id is None)
            ]
            await repo.moved(tx, done)
            for o in done:
                self.sent.pop(o, None)
        todo = [r for r in rows if misplaced(r) and r.id not in self.sent]
        room = self.in_flight - len(self.sent)
        if not todo or room <= 0:
            return 0
        todo = todo[:room]
        probed = await reachable(self.store, self.publisher, self.margin)  # outside any tx
        present = {sid for sid, yes in probed.items() if yes}
        async with self.store.transaction() as tx:
            free = await reachable_slots(tx, present, self.margin)
            runs = await repo.kinds_run(tx, list(free))
            needs = [repo.Needs(r.pool, r.kind, r.kind_version) for r in todo]
            targets = place(free, needs, runs)
            handoffs, pending = await repo.request_handoffs(
                tx,
                [
                    (r.id, r.service_id, t)
                    for r, t in zip(todo, targets, strict=True)
                    if t is not None
                ],
                "moved: ",
            )
        self.sent.update({o: now for o, _, _ in handoffs})
        if pending:
            log.info("moving %d observers to where they now belong", len(pending))
            self.metrics.moves.labels("move").inc(len(pending))
        self.box.publish_soon(pending)
        return len(pending)
