"""The loops the elected leader runs: outbox relay, dead-service sweeper, lost-message audit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from orch_contracts import tracing
from orch_contracts.errors import BrokerUnavailable, Transient
from orch_contracts.messages import DirectedStart, Message
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.routing import Destination
from orch_contracts.statuses import STOPPING, ObserverStatus
from orch_manager import repository as repo
from orch_manager.metrics import ManagerMetrics
from orch_manager.outbox import Outbox, Pending
from orch_manager.publisher import Publisher
from orch_manager.store import ManagerStore, Tx

log = logging.getLogger(__name__)


def every(
    seconds: float, once: Callable[[], Awaitable[object]], what: str
) -> Callable[[], Coroutine[Any, Any, None]]:
    """A loop calling ``once`` every ``seconds``. An unavailable server is logged and retried;
    anything else is a bug and ends the loop (its supervisor stops the leadership loudly)."""

    async def loop() -> None:
        while True:
            try:
                await once()
            except Transient as exc:
                log.warning("%s: %s", what, exc)
            await asyncio.sleep(seconds)

    return loop


async def probe(
    publisher: Publisher, services: Collection[uuid.UUID]
) -> dict[uuid.UUID, bool | None]:
    """Whether each service's control queue exists now (None: the probe failed or timed out),
    one passive declare each, all at once."""

    async def present(sid: uuid.UUID) -> bool | None:
        try:
            return await publisher.service_present(sid)
        except BrokerUnavailable:
            return None

    ids = list(services)
    return dict(zip(ids, await asyncio.gather(*(present(sid) for sid in ids)), strict=True))


async def on_broker(publisher: Publisher, services: Collection[uuid.UUID]) -> set[uuid.UUID]:
    """The services whose control queue exists now. A lease says a process lives, not that a
    message sent to it arrives (one cut off from the broker keeps its lease). A probe that
    fails counts as absent: nothing directed then."""
    return {sid for sid, yes in (await probe(publisher, services)).items() if yes}


def found(probed: dict[uuid.UUID, bool | None]) -> set[uuid.UUID] | None:
    """The services found on the broker; None when no probe got an answer (the broker is
    being restarted, or cannot be reached): then none can be told apart, and a directed start
    may go to any service with a lease, which reads it from the database."""
    if probed and all(yes is None for yes in probed.values()):
        return None
    return {sid for sid, yes in probed.items() if yes}


async def reachable(
    store: ManagerStore, publisher: Publisher, margin: float, also: Collection[uuid.UUID] = ()
) -> dict[uuid.UUID, bool | None]:
    """Probes of the services a directed start may go to (a lease with free slots) and of
    ``also``. Made outside any transaction: a probe may take up to its timeout (a broker
    alarm), and no lock or snapshot may wait for it."""
    async with store.transaction() as tx:
        free = await repo.free_slots(tx, margin)
        spare = await repo.free_slots(tx, margin, probation=True)
    return await probe(publisher, {*free, *spare, *also})


async def reachable_slots(
    tx: Tx, present: Collection[uuid.UUID], margin: float
) -> dict[uuid.UUID, int]:
    """Free slots of the services a directed start reaches: their lease read again here (in the
    writing transaction), their control queue as probed just before it."""
    free = await repo.free_slots(tx, margin)
    return {sid: n for sid, n in free.items() if sid in present}


def place(
    free: dict[uuid.UUID, int],
    needs: Sequence[repo.Needs],
    runs: dict[uuid.UUID, repo.Runs],
    among: Collection[uuid.UUID] | None = None,
) -> list[uuid.UUID | None]:
    """Targets for observers with these ``needs``: of the services in ``free`` (and in
    ``among``, unless None) that can run one (``runs``: its pool, its kinds), the one with
    the most free slots first; None (the pool's work queue) once none of them has room."""
    slots = {sid: n for sid, n in free.items() if among is None or sid in among}
    out: list[uuid.UUID | None] = []
    for need in needs:
        able = [sid for sid in slots if slots[sid] > 0 and runs.get(sid, repo.Runs()).can(need)]
        best = max(able, key=lambda k: slots[k], default=None)
        if best is None:
            out.append(None)
            continue
        slots[best] -= 1
        out.append(best)
    return out


async def redispatch(
    tx: Tx,
    ids: list[uuid.UUID],
    why: str,
    *,
    present: Collection[uuid.UUID] | None,
    margin: float,
    by: str,
    placed_only: bool = False,
) -> list[Pending]:
    """New dispatch ids for these observers (their old messages become stale), each sent to a
    live service of its pool with room that runs its kind, chosen here from the leases, the
    control queues and the kinds advertised, not by the broker (``present``: the services
    found on the broker just before this transaction; None: no probe answered, any service
    with a lease may be chosen); to its pool's work queue when none has room. A service reads
    its directed starts from the database at its next lease renewal when the broker did not
    deliver them (an alarm blocks the publish). ``placed_only``: those that no such service
    has room for are left as they are."""
    if not ids:
        return []
    # A trace of its own (a root): the starts it sends are taken in it.
    with tracing.span(
        f"{by} re-dispatch", attributes=lambda: {"orch.reason": why, "orch.observers": len(ids)}
    ):
        free = await repo.free_slots(tx, margin)
        needs = await repo.needs_of(tx, ids)
        runs = await repo.kinds_run(tx, list(free))
        wanted = [needs.get(i, repo.Needs(DEFAULT_POOL, "")) for i in ids]
        placed = place(free, wanted, runs, among=present)
        if None in placed and (spare := await repo.free_slots(tx, margin, probation=True)):
            # Services back from a lost lease lately, as a last resort before the work queue:
            # a start sent there waits for an alarm's end, or for the audit where a frozen
            # consumer's prefetch took it; a directed one is also read from the database.
            runs |= await repo.kinds_run(tx, list(spare))
            rest = [n for n, target in enumerate(placed) if target is None]
            again = place(spare, [wanted[n] for n in rest], runs, among=present)
            for n, target in zip(rest, again, strict=True):
                placed[n] = target
        targets = dict(zip(ids, placed, strict=True))
        if placed_only:
            ids = [i for i in ids if targets[i] is not None]
        starts = await repo.new_dispatches(tx, ids, why, targets)
        messages: list[tuple[Destination, Message]] = []
        for start in starts:
            target = targets[start.observer_id]
            pool = needs[start.observer_id].pool
            if target is None:
                messages.append((Destination.work(pool), start))
            else:
                messages.append((Destination.service(target, pool), DirectedStart.of(start)))
        return await repo.add_outbox(tx, messages)


@dataclass
class OutputRelay:
    """Publishes the outputs that a gone service committed and nobody confirmed (its
    observer may commit nothing more, so no new holder would), and those a live service
    committed for a copy that no longer holds its observer, in seq order per observer, then
    deletes them. The publish runs between two statements, in no transaction. A holder
    publishes such commits too, before its own records: each publisher goes in seq order, so
    a consumer sees repeats at worst."""

    store: ManagerStore
    publisher: Publisher
    metrics: ManagerMetrics
    limit: int = 2000
    #: Seconds before commits of a live service whose copy no longer holds the observer are
    #: relayed too (that service may still be publishing them: a repeat at worst).
    grace: float = 2.0

    async def once(self) -> int:
        async with self.store.autocommit() as tx:
            left = await repo.outputs_left(tx, self.limit, self.grace)
            self.metrics.oldest_output.set(await repo.oldest_output(tx))
        if not left:
            return 0
        await self.publisher.publish_outputs(left)
        async with self.store.autocommit() as tx:
            await repo.delete_outputs(tx, left)
        count = sum(len(c.records) for c in left)
        self.metrics.outputs_relayed.inc(count)
        log.info("relayed %d outputs that gone services left", count)
        return count


class Laps:
    """The time each step of one pass took, for the log: ``look 0.002s, probes 1.003s``."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.steps: list[tuple[str, float]] = []

    def mark(self, step: str) -> None:
        now = time.monotonic()
        self.steps.append((step, now - self.last))
        self.last = now

    def __str__(self) -> str:
        return ", ".join(f"{step} {secs:.3f}s" for step, secs in self.steps)


@dataclass
class Sweeper:
    """Services whose lease expired are dead; so are those whose process is provably gone (its
    lease session ended and its broker connection closed, seen in two sweeps in a row), which
    lets observers that came by directed start (no broker delivery to be requeued) move fast
    too. Their processing observers are re-dispatched, their on_deleting ones deleted; but of a
    service proven gone, those that came by the work queue (``observers.queued_epoch``) are left to
    the broker, which requeued their deliveries when the connection closed, for
    ``requeue_grace`` seconds, and after that for as long as some of that service's observers
    were taken in the last ``requeue_grace`` seconds (the services are working through its
    requeue), up to ``requeue_patience``: re-dispatching them too made each a stale message to
    drop and a second start to send (at fleet size, half the observers a crash moved; with a
    fixed grace, a quarter of those five crashes moved, which the services took 5 to 26 s to
    work through). A requeue that stopped progressing is stuck (its deliveries went to a
    consumer that does not take them: a frozen service) and waits no longer, whatever else its
    pool takes."""

    store: ManagerStore
    box: Outbox
    publisher: Publisher
    #: Directed starts go only to services whose lease outlives this many seconds.
    margin: float
    metrics: ManagerMetrics
    #: Seconds the observers of a service proven gone that came by the work queue are left to
    #: the broker's requeue before they are re-dispatched too.
    requeue_grace: float = 5.0
    #: The longest they are left to the requeue while their pool takes.
    requeue_patience: float = 60.0
    #: Services seen gone in the last sweep (id -> when, monotonic).
    suspects: dict[uuid.UUID, float] = field(default_factory=dict)
    #: Dead services holding observers: how many, and when that last fell (monotonic).
    requeues: dict[uuid.UUID, tuple[int, float]] = field(default_factory=dict)

    async def once(self) -> int:
        # Three short transactions around the broker probes: a probe may wait for its timeout
        # (a broker alarm) and must not hold a transaction, its locks and snapshot meanwhile.
        laps = Laps()
        async with self.store.transaction() as tx:
            for d in await repo.sweep_expired(tx):
                log.warning("service %s (%s) missed its lease: marked deleted", d.id, d.name)
                self.metrics.swept.labels("lease_expired").inc()
            ended = await repo.sessions_ended(tx)
            # The usual sweep finds nothing: then it reads no more (no service's load, no
            # probe), so an idle fleet costs the same however many observers it runs.
            if not ended and not await repo.any_orphan(tx) and not await repo.any_waiting(tx):
                self.suspects = {}  # "twice in a row": a sweep that suspects none breaks a row
                return 0
        laps.mark("look")
        probed = await reachable(self.store, self.publisher, self.margin, also=ended)
        present = found(probed)
        laps.mark("probes")
        async with self.store.transaction() as tx:
            # declare_gone checks again that the lock is free and the row names that session.
            for d in await repo.declare_gone(tx, self._gone(ended, probed)):
                log.warning(
                    "service %s (%s) is gone (session and connection): marked deleted", d.id, d.name
                )
                self.metrics.swept.labels("process_gone").inc()
            orphans = await repo.orphans(
                tx,
                grace=self.requeue_grace,
                patience=self.requeue_patience,
                progressing=self._progressing(await repo.held_by_dead(tx)),
            )
            await repo.complete_stops(
                tx, [o.id for o in orphans if o.status in STOPPING], "holder gone"
            )
            moving = [o.id for o in orphans if o.status == ObserverStatus.PROCESSING]
            pending = await redispatch(
                tx, moving, "holder gone", present=present, margin=self.margin, by="sweeper"
            )
        laps.mark("re-dispatch")
        if moving:
            log.warning("re-dispatching %d observers of dead services (%s)", len(moving), laps)
            self.metrics.redispatches.labels("holder_gone").inc(len(moving))
        self.box.publish_soon(pending)
        return len(orphans) + await self._place_waiting(present)

    async def _place_waiting(self, present: Collection[uuid.UUID] | None) -> int:
        """Observers passed on by a service that cannot run them (another pool's, or a kind it
        lacks): each is sent to a service of its pool that runs its kind and has room, as soon
        as one has; the others say why they wait. With none waiting (the usual case) one look
        by index, every sweep."""
        async with self.store.transaction() as tx:
            if not await repo.any_waiting(tx):
                return 0
            free = await repo.free_slots(tx, self.margin)
            free |= await repo.free_slots(tx, self.margin, probation=True)
            # Only those a directed start reaches: others' kinds would pick observers that
            # then stay where they are, ahead of the ones that could go.
            able = [sid for sid in free if present is None or sid in present]
            ids = await repo.waiting(tx, (await repo.kinds_run(tx, able)).values())
            pending = await redispatch(
                tx,
                ids,
                "to a service of its pool that runs its kind",
                present=present,
                margin=self.margin,
                by="sweeper",
                placed_only=True,
            )
            await repo.set_waiting(tx, await repo.unexplained(tx))
        if pending:
            log.info("sending %d waiting observers to services that run their kind", len(pending))
            self.metrics.redispatches.labels("kind_found").inc(len(pending))
        self.box.publish_soon(pending)
        return len(pending)

    def _progressing(self, held: dict[uuid.UUID, int]) -> list[uuid.UUID]:
        """The dead services whose observers were taken in the last ``requeue_grace`` seconds
        (one first seen counts from then)."""
        now = time.monotonic()
        before, self.requeues = self.requeues, {}
        for sid, n in held.items():
            count, since = before.get(sid, (n + 1, now))
            self.requeues[sid] = (n, now if n < count else since)
        return [s for s, (_, since) in self.requeues.items() if now - since < self.requeue_grace]

    def _gone(
        self, ended: list[uuid.UUID], probed: dict[uuid.UUID, bool | None]
    ) -> list[uuid.UUID]:
        """Services live by their lease whose process is provably gone, twice in a row. A probe
        that failed or timed out proves nothing: that service is not suspected."""
        now = time.monotonic()
        seen, self.suspects = self.suspects, {}
        gone: list[uuid.UUID] = []
        for sid in ended:
            if probed.get(sid) is not False:
                continue
            if sid in seen:
                gone.append(sid)
            else:
                self.suspects[sid] = now
        return gone


@dataclass
class Audit:
    """Re-dispatch live observers that nobody holds and whose start message is stuck or lost.

    Only when nothing was taken for ``grace`` seconds, and unless every service is full with no
    more unowned observers than starts ready in the work queue: then the message of an unowned
    observer is not waiting for capacity nor in a busy service's backlog; it sits unacked at a
    consumer that does not take it (a frozen service still has free prefetch slots, and the
    broker fills them), in a queue nobody consumes, or it was lost. A new dispatch id makes the
    stuck copy stale.

    An observer it re-dispatched waits twice as long each time before it is re-dispatched again
    (up to ``patience``): a service slower than ``grace`` to take a burst of re-dispatched
    starts would otherwise see each burst made stale by the next, for ever.
    """

    store: ManagerStore
    box: Outbox
    publisher: Publisher
    grace: float
    #: Directed starts go only to services whose lease outlives this many seconds.
    margin: float
    metrics: ManagerMetrics
    #: The longest wait between two re-dispatches of one observer.
    patience: float
    #: Seconds a start directed to a live service is left to it: that service's renewal reads
    #: it from the database after a renewal interval, if the directed message was lost.
    directed: float
    #: Observers re-dispatched lately: id -> (times in a row, not again before; monotonic).
    recent: dict[uuid.UUID, tuple[int, float]] = field(default_factory=dict)

    async def once(self) -> int:
        # A broker that cannot be asked (restarting, unreachable) leaves what its queues hold
        # unknown, and a start sent through it would wait for its return: the observers stuck
        # meanwhile are placed on live services through the database alone (their renewal
        # reads a directed start). Giving up instead left them unrun until the broker and the
        # publisher were back (10.6 s in a chaos run).
        ready: dict[str, int] | None = None
        self.metrics.queue_ready.clear()  # other pools' shown only while read
        with contextlib.suppress(BrokerUnavailable):
            ready = {DEFAULT_POOL: await self.publisher.work_queue_ready()}
            self.metrics.queue_ready.labels(DEFAULT_POOL).set(ready[DEFAULT_POOL])
        now = time.monotonic()
        self._forget(now)
        async with self.store.transaction() as tx:
            # A service working through a large prefetch backlog also leaves nothing ready
            # while observers wait unowned; it takes observers all the while. Act only on the
            # pools where nothing was taken lately: then the waiting ones really are stuck at a
            # silent consumer. Each pool apart: one pool's takes say nothing of another's queue.
            idle = await repo.idle_pools(tx, self.grace)
            if not idle:
                return 0
            stuck = await repo.unheld_stuck(tx, self.grace, idle, self.directed)
            if not stuck:
                return 0
            free = await repo.free_slots(tx, self.margin)
            free |= await repo.free_slots(tx, self.margin, probation=True)
            free_pools = {r.pool for r in (await repo.kinds_run(tx, list(free))).values()}
        if ready is not None:
            try:
                for pool in set(stuck.values()) - set(ready):
                    ready[pool] = await self.publisher.work_queue_ready(pool)
                    self.metrics.queue_ready.labels(pool).set(ready[pool])
            except BrokerUnavailable:
                ready = None
        # Ready starts wait for a slot only while no service of their pool has one; and even
        # then those beyond the queue's count are nowhere. Whatever else the queue holds, the
        # rest is re-dispatched (a start still queued becomes stale and is dropped).
        waits = {
            pool
            for pool in set(stuck.values())
            if ready is not None
            and ready[pool]
            and sum(1 for p in stuck.values() if p == pool) <= ready[pool]
            and pool not in free_pools
        }
        ids = [
            oid
            for oid, pool in stuck.items()
            if pool not in waits and self.recent.get(oid, (0, now))[1] <= now
        ]
        if not ids:
            return 0
        present = found(await probe(self.publisher, free))  # outside any transaction
        async with self.store.transaction() as tx:
            # Still unheld and stuck now (read again, locked): one taken meanwhile stays.
            ids = sorted(
                set(ids) & set(await repo.unheld_stuck(tx, self.grace, idle, self.directed))
            )
            # One whose start is still unpublished (a broker alarm holds the publishers) is
            # sent anew only to a service, which also reads it from the database: another
            # start for the work queue would only wait behind the first.
            unsent = set(ids) if ready is None else await repo.unsent(tx, ids)
            why = "audit: start message stuck or lost"
            pending = await redispatch(
                tx,
                [i for i in ids if i not in unsent],
                why,
                present=present,
                margin=self.margin,
                by="audit",
            )
            pending += await redispatch(
                tx,
                [i for i in ids if i in unsent],
                why,
                present=present,
                margin=self.margin,
                by="audit",
                placed_only=True,
            )
        for oid in ids:
            times = self.recent.get(oid, (0, now))[0] + 1
            self.recent[oid] = (times, now + min(self.patience, self.grace * 2**times))
        if ids:
            log.warning("audit re-dispatched %d observers whose start message was stuck", len(ids))
            self.metrics.redispatches.labels("stuck").inc(len(ids))
        self.box.publish_soon(pending)
        return len(ids)

    def _forget(self, now: float) -> None:
        """Observers whose last re-dispatch is a full ``patience`` past: taken since, or
        stuck again for a new reason; either way they start over at ``grace``."""
        self.recent = {
            oid: entry for oid, entry in self.recent.items() if entry[1] + self.patience > now
        }


@dataclass
class Pruner:
    """Retention: deleted observers (and their history) after ``keep``, dead services after
    ``keep_services``, and no observer keeps more than ``max_events`` history rows. Live
    observers are never touched: only ``deleted`` rows and unreferenced dead services go."""

    store: ManagerStore
    keep: float
    keep_services: float
    max_events: int
    batch: int = 1000
    #: History rows up to this id have been looked at (None: none yet, by this process).
    seen_events: int | None = None
    #: A first pass (a new leader's) looks at this many of the newest history rows, not at
    #: all of them: at 100,000 observers, a new leader read every history row in its first
    #: seconds. An observer whose history outgrew the cap before is trimmed at its next event.
    first_look: int = 10_000

    async def once(self) -> repo.Pruned:
        async with self.store.transaction() as tx:
            pruned = await repo.prune(
                tx,
                keep=self.keep,
                keep_services=self.keep_services,
                max_events=self.max_events,
                batch=self.batch,
                seen_events=self.seen_events,
                first_look=self.first_look,
            )
        self.seen_events = pruned.newest_event
        if pruned.observers or pruned.services or pruned.trimmed:
            log.info(
                "retention: pruned %d deleted observers, %d dead services, trimmed %d histories",
                pruned.observers,
                pruned.services,
                pruned.trimmed,
            )
        return pruned
