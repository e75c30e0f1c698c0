"""The observer service: takes start messages, runs observers, stops them when it must.

It is given its store, broker, lease and clock (``main`` builds the real ones; the tests'
``tests/support/fakes.py`` has in-memory ones). Its side tasks (lease, batch writers, broker
session, renewals, recovery) are named and supervised: if one dies, the service stops every
observer and exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import tracemalloc
import uuid
from collections.abc import Callable, Collection, Coroutine
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from observer_service.admission import Admission
from observer_service.control import ControlChecks, cancel_confirmed, handoff_confirmed
from observer_service.deliveries import QueuedMarks
from observer_service.intake import Intake
from observer_service.lease import LeaseKeeper
from observer_service.metrics import ServiceMetrics
from observer_service.origin import DIRECTED, Queued
from observer_service.outputs import DEFAULT_BUFFER_BYTES, OutputBudget, OutputPublisher
from observer_service.ports import (
    Broker,
    BrokerSession,
    Copy,
    LeaseDatabase,
    Locked,
    SessionSpec,
    Store,
)
from observer_service.retry import landed, until_done
from observer_service.runner import ASKED, Launcher, ResourceShort, Runner, StopReason
from observer_service.settle import Settler
from observer_service.stalls import StallWatch, ThreadWrites
from observer_service.witnessing import MemoryWitness
from orch_contracts import tracing
from orch_contracts.backoff import Backoff
from orch_contracts.batching import Batcher
from orch_contracts.clock import Clock
from orch_contracts.deadline import LeaseTimings
from orch_contracts.errors import BrokerUnavailable, Transient
from orch_contracts.kinds import KindSpec
from orch_contracts.messages import (
    CONTROL_MESSAGE,
    CancelMessage,
    DirectedStart,
    DrainMessage,
    HandoffMessage,
    StartMessage,
    UndrainMessage,
)
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.statuses import ObserverStatus
from orch_contracts.topology import consumer_timeout_advice
from orch_contracts.tracing import Carrier
from orch_contracts.witness import Witness

log = logging.getLogger(__name__)

#: At most this many observers whose take is in flight go with a renewal (the rest may be sent
#: anew by the leader's audit, as before the report existed).
TAKING_REPORTED = 1000


@dataclass(frozen=True)
class ServiceConfig:
    name: str
    worker_count: int
    #: How long a graceful stop waits for starts in flight, and then for copies to stop.
    shutdown_timeout: float = 10.0
    #: How often the rows this service holds are compared with what it runs, seconds.
    check_every: float = 30.0
    #: A step of kind code longer than this, seconds, is a stall (``stalls.py``).
    loop_stall: float = 2.0
    #: Bytes of records the service holds across its copies (``outputs.OutputBudget``).
    output_buffer_bytes: int = DEFAULT_BUFFER_BYTES
    #: Warn at the first broker session when the broker is too old for the per-queue consumer
    #: timeout (off where someone else already said so: ``orch up``).
    broker_advice: bool = True
    #: The pool it joined: it takes only observers of that pool.
    pool: str = DEFAULT_POOL
    #: When its process started (``time.monotonic()``; None: unknown), for the log's "up in".
    process_started: float | None = None


class ObserverService:
    def __init__(
        self,
        *,
        service_id: uuid.UUID,
        config: ServiceConfig,
        kinds: dict[str, KindSpec],
        store: Store,
        broker: Broker,
        lease_database: LeaseDatabase,
        timings: LeaseTimings,
        clock: Clock,
        metrics: ServiceMetrics | None = None,
        thread_writes: ThreadWrites | None = None,
        witness: Witness | None = None,
    ) -> None:
        self.id = service_id
        self.witness = witness
        self.metrics = metrics or ServiceMetrics()
        self.metrics.running_is(lambda: len(self.runners))
        self.config = config
        self.store = store
        self._broker = broker
        self.lease = LeaseKeeper(lease_database, timings=timings, clock=clock, listener=self)
        self.clock = clock
        self.runners: dict[uuid.UUID, Runner] = {}
        self.admission = Admission(config.worker_count)
        self.session: BrokerSession | None = None
        self.stopping = False
        #: Draining: takes no new work, hands every observer over (POST /services/{id}/drain).
        self.draining = False
        #: When the last undrain arrived (clock time): a renewal that still reads the old
        #: ``draining`` flag (its query ran before the undrain committed) must not drain again.
        self._undrained_at: float | None = None
        #: When this service last began to drain: a renewal that still reads the flag unset (its
        #: query ran before the drain committed) must not undrain it.
        self._drained_at: float | None = None
        #: False when a graceful stop left copies running: the process must exit at once.
        self.clean = True
        self.outputs = OutputPublisher(
            store, lambda: self.session, self.metrics, OutputBudget(config.output_buffer_bytes)
        )
        self.checks = ControlChecks(store)
        self.marks = QueuedMarks(store.mark_queued)
        #: Directed starts read from the database: (observer, dispatch) -> when (newest kept).
        self._directed_seen: dict[tuple[uuid.UUID, uuid.UUID], float] = {}
        self._release = Batcher(self._release_batch)
        self.stalls = StallWatch(
            config.loop_stall,
            lease_valid=self.lease.deadline.valid,
            outlives_lease=timings.ttl - timings.margin - timings.renew_interval,
            writes=thread_writes,
        )
        self.settler = Settler(
            release=self.release_copy,
            blame=store.blame,
            session=self.broker,
            metrics=self.metrics,
            went_back=self._went_back,
        )
        self.launcher = Launcher(
            self,
            me=service_id,
            name=config.name,
            kinds=kinds,
            store=store,
            lease=self.lease,
            metrics=self.metrics,
            stalls=self.stalls,
            witness=witness,
        )
        self.intake = Intake(
            self,
            name=config.name,
            kinds=kinds,
            pool=config.pool,
            store=store,
            lease=self.lease,
            admission=self.admission,
            settler=self.settler,
            launcher=self.launcher,
            metrics=self.metrics,
            clock=clock,
        )
        self._stop = asyncio.Event()
        self._lease_lost = asyncio.Event()
        #: Short tasks of this service (settling a copy, failing an unrunnable start, pausing
        #: consumption): named, watched, awaited at shutdown.
        self._background: set[asyncio.Task[Any]] = set()
        #: Set when one of them died of a bug: the service stops loudly, as for a side task.
        self._spawned_died = asyncio.Event()

    # ----------------------------------------------------------------- lifecycle
    def request_stop(self) -> None:
        """Begin a graceful stop (SIGTERM, SIGINT)."""
        self._stop.set()

    async def run(self, *, join_until: float = 0.0) -> int:
        """Serve until a stop is asked or a side task dies (1). ``join_until``: how long a
        database that refuses the first lease is tried again (``LeaseKeeper.start``)."""
        await self.lease.start(join_until)
        self.stalls.start()
        log.info(
            "service %s (%s) up%s: worker_count=%d",
            self.id,
            self.config.name,
            self._since_start(),
            self.config.worker_count,
        )
        side: list[asyncio.Task[Any]] = [
            asyncio.create_task(coro, name=name)
            for name, coro in (
                ("lease", self.lease.run()),
                ("take-writer", self.intake.takes.run()),
                ("checkpoint-writer", self.outputs.commits.run()),
                ("output-publisher", self.outputs.run()),
                ("release-writer", self._release.run()),
                ("control-checks", self.checks.reads.run()),
                ("delivery-marks", self.marks.run()),
                ("broker", self._broker_loop()),
                ("renewals", self._renewals()),
                ("recovery", self._recovery()),
            )
        ]
        if self.witness is not None and tracemalloc.is_tracing():
            memory = MemoryWitness(self.witness, self.intake.kinds, self.runners.values)
            side.append(asyncio.create_task(memory.run(), name="memory-witness"))
        side.append(asyncio.create_task(self._spawned_died.wait(), name="spawned-tasks"))
        stop = asyncio.create_task(self._stop.wait(), name="stop-signal")
        done, _ = await asyncio.wait([*side, stop], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        for task in done:
            if task is not stop:
                code = 1
                exc = None if task.cancelled() else task.exception()
                log.critical(
                    "side task %r died (%r): stopping the service",
                    task.get_name(),
                    exc,
                    exc_info=exc,  # with its traceback: the repr alone told too little once
                )
        await self._shutdown(side)
        self.stalls.stop()
        return code

    async def _shutdown(self, side: list[asyncio.Task[Any]]) -> None:
        """Stop taking work, stop every observer, release what stopped, requeue its message.

        A copy that has not stopped within the timeout is never released: the service leaves
        ``clean`` False and the process exits at once, so its database session and broker
        connection end with it and others take the rest over (the lock is free and the control
        queue gone: the process is provably gone)."""
        self.stopping = True
        timeout = self.config.shutdown_timeout
        if self.session is not None:
            await self.session.stop_consuming()
        await self.admission.idle(timeout)
        runners = list(self.runners.values())
        self._stop_where(lambda r: True, StopReason.SHUTDOWN)
        if runners:
            waits = [asyncio.create_task(r.finished.wait()) for r in runners]
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for w in pending:
                w.cancel()
        hung = [r for r in runners if not r.finished.is_set()]
        if hung:
            self.clean = False
            # Those whose code ended (their end recorded) hang in their release, not their code.
            running = [r for r in hung if r.task is None or not r.task.done()]
            if self.witness is not None:
                for r in running:
                    # In its commit now: the orchestrator's wait, not the kind's.
                    waited = r.outputs.stop_waiting_now() if r.outputs is not None else 0.0
                    self.witness.hung(r.observer_id, r.epoch, waited)
            log.error(
                "%d observers not settled within %.1fs (%d still running, %d stopped with their "
                "release or start message unsettled); leaving: the process exit frees the rest",
                len(hung),
                timeout,
                len(running),
                len(hung) - len(running),
            )
            return
        log.info("released %d observers; leaving", len(runners))
        if self._background:  # settles and the like still under way: bounded, then cancelled
            _, late = await asyncio.wait(set(self._background), timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        # What the copies committed goes out before the broker connection does (bounded: what
        # is left, the leader relays once this service is gone).
        await self.outputs.flushed(timeout)
        for task in side:
            task.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        await self.lease.close(deleted=True)
        if self.session is not None:
            await self.session.close()

    def _since_start(self) -> str:
        """`` in 1.23s`` since the process started, where that is known."""
        started = self.config.process_started
        return "" if started is None else f" in {time.monotonic() - started:.2f}s"

    # ----------------------------------------------------------------- broker
    async def _broker_loop(self) -> None:
        """One broker session after another. A closed session stops nothing: the copies
        delivered on it go on under the lease (their starts are adopted again when redelivered
        here, and dropped as duplicates elsewhere). A broker that is away is tried again at
        least every 1.5 s: a refused connection costs it nothing, and observers that lost their
        start with it (a lost lease meanwhile) wait for this service's return (waits that
        doubled to 5 s left them unrun 4.7 s after a broker restart)."""
        backoff = Backoff(0.05, 1.0, jitter=0.5)
        opened = 0
        while not self.stopping:
            try:
                session = await self._broker.open(
                    SessionSpec(
                        service_id=self.id,
                        prefetch=self.config.worker_count,
                        consume_work=not self.draining,
                        on_start=self.intake.on_start,
                        on_control=self._on_control,
                    )
                )
            except BrokerUnavailable as exc:
                delay = backoff.next()
                log.warning("broker unreachable (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                continue
            backoff.reset()
            opened += 1
            if opened == 1:
                log.info("on the broker%s", self._since_start())
            advise = opened == 1 and self.config.broker_advice
            if advise and (advice := consumer_timeout_advice(session.version)):
                log.warning("%s", advice)
            if opened > 1:
                self.metrics.reconnects.inc()
            self.session = session
            await session.closed.wait()
            self._deliveries_lost()
            self.metrics.channel_closes.labels(session.close_reason).inc()
            if self.runners:
                log.warning(
                    "broker session closed: %d observers go on under the lease", len(self.runners)
                )
            await session.close()

    def _deliveries_lost(self) -> None:
        """The copies whose delivery ended with the session run on as directed (their start is
        published anew when they stop), and the database learns they hold no delivery: the
        broker requeued it (another service may drop it as a duplicate) or it is gone with a
        deleted queue, and the leader must not wait for a requeue to move them after a crash."""
        lost = [
            r for r in self.runners.values() if isinstance(r.origin, Queued) and not r.origin.live
        ]
        for runner in lost:
            runner.origin = DIRECTED
        self.marks.lost(r.copy for r in lost)

    def adopted(self, runner: Runner) -> None:
        """A redelivery of the copy's start is its delivery again."""
        self.marks.adopted(runner.copy)

    def broker(self) -> BrokerSession | None:
        s = self.session
        return s if s is not None and s.is_open else None

    def accepting(self) -> bool:
        return not (self.stopping or self.draining)

    # ----------------------------------------------------------------- runners
    def add_runner(self, runner: Runner) -> None:
        self.runners[runner.observer_id] = runner
        if isinstance(runner.origin, Queued) and not runner.origin.live:
            # Its session closed while the take was in flight: as one that ran through it.
            runner.origin = DIRECTED
            self.marks.lost([runner.copy])
        task = runner.task
        assert task is not None
        # Settled once its task has ended; no second task per observer waits for that end (a
        # waiting task was about 1.8 KiB of the 11.5 KiB an idle observer took).
        task.add_done_callback(
            lambda _: self.spawn(self._settle_stopped(runner), f"settle-{runner.observer_id}")
        )

    async def _settle_stopped(self, runner: Runner) -> None:
        task = runner.task
        if (
            task is not None
            and not task.cancelled()
            and isinstance(task.exception(), ResourceShort)
        ):
            self.admission.headroom.exhausted()  # no new start here for a while
        try:
            await self.settler.settle_stopped(runner)
        except Exception:  # a bug: the periodic check reconciles the row
            runner.ctx.logger.exception("settling failed")
        finally:
            if self.runners.get(runner.observer_id) is runner:
                del self.runners[runner.observer_id]
            if runner.outputs is not None:
                self.outputs.unregister(runner.outputs)
            self.admission.slots.release()
            runner.finished.set()
            runner.forget()

    async def release_copy(self, copy: Copy, detail: str) -> ObserverStatus | None:
        """Release a stopped copy (or complete its delete); None where it was fenced, RowLocked
        where its row is locked by another transaction (the settle retries it)."""
        return landed(await self._release.submit((copy, detail)))

    async def _release_batch(
        self, items: list[tuple[Copy, str]]
    ) -> list[ObserverStatus | Locked | None]:
        out: list[ObserverStatus | Locked | None] = [None] * len(items)
        for detail in {d for _, d in items}:
            idx = [i for i, (_, d) in enumerate(items) if d == detail]
            done = await self.store.release_many([items[i][0] for i in idx], detail)
            for i, status in zip(idx, done, strict=True):
                out[i] = status
        return out

    def drain(self) -> None:
        """Take no more work and hand every observer to the other services."""
        if self.draining:
            return
        self.draining = True
        self._drained_at = self.clock.now()
        log.warning("draining: handing over %d observers", len(self.runners))
        if self.session is not None:
            self.spawn(self._consuming(self.session, on=False), "stop-consuming")
        self._stop_where(lambda r: True, StopReason.DRAIN)

    def undrain(self) -> None:
        """A drain undone: take work again (the database no longer says draining)."""
        self._undrained_at = self.clock.now()
        if not self.draining:
            return
        self.draining = False
        log.warning("undrained: taking work again")
        if self.session is not None:
            self.spawn(self._consuming(self.session, on=True), "start-consuming")

    def _stop_where(self, pred: Callable[[Runner], bool], reason: StopReason) -> None:
        stopped = [r for r in self.runners.values() if pred(r)]
        for r in stopped:
            r.stop(reason)
        if stopped:
            # Asked for (a stop, a drain, a delete) it is the ordinary course; forced, a warning.
            level = logging.INFO if reason in ASKED else logging.WARNING
            log.log(level, "stopping %d observers: %s", len(stopped), reason.value)

    # ----------------------------------------------------------------- control
    async def _on_control(self, body: bytes, trace: Carrier | None) -> None:
        """A control message. Anyone on the broker can send one, so a drain, undrain, cancel or
        handoff is acted on only once the database confirms it (``control.py``), in a task of
        its own: a check waits for the database, the control queue does not. A directed start
        goes to the take, which is its check."""
        try:
            control = CONTROL_MESSAGE.validate_json(body)
        except ValidationError as exc:
            log.error("malformed control message ignored: %s", exc)
            return
        if isinstance(control, DirectedStart):
            await self.intake.admit(control.start(), DIRECTED, trace=trace)
        elif isinstance(control, HandoffMessage):
            if control.observer_id in self.runners:
                self.spawn(self._handoff_checked(control), f"check-handoff-{control.observer_id}")
        elif isinstance(control, DrainMessage | UndrainMessage):
            if control.service_id == self.id:
                self.spawn(self._drain_checked(control), f"check-{control.type}")
        elif isinstance(control, CancelMessage):
            oid = control.observer_id
            if oid in self.runners or self.admission.admits(oid):
                self.spawn(self._cancel_checked(oid, trace), f"check-cancel-{oid}")

    def _refused(self, kind: str, what: str) -> None:
        self.metrics.control_refused.labels(kind).inc()
        log.warning("%s ignored: the database does not confirm it", what)

    async def _drain_checked(self, control: DrainMessage | UndrainMessage) -> None:
        drain = isinstance(control, DrainMessage)
        facts = await self.checks.facts([], moot=lambda: self.stopping)
        if facts is None:
            return
        if facts.draining != drain:
            self._refused(control.type, f"{control.type} message")
        elif drain:
            self.drain()
        else:
            self.undrain()

    async def _cancel_checked(self, observer_id: uuid.UUID, trace: Carrier | None) -> None:
        """A cancel, in a span from its arrival until the copy stopped and was settled."""
        with tracing.span(
            "cancel",
            parent=trace,
            kind="consumer",
            attributes=lambda: {
                "orch.observer_id": str(observer_id),
                "orch.service": self.config.name,
            },
        ):
            stopped = await self._cancel_if_confirmed(observer_id)
            if stopped is not None and tracing.enabled():
                await stopped.finished.wait()

    async def _cancel_if_confirmed(self, observer_id: uuid.UUID) -> Runner | None:
        """Stop the copy if the database confirms the cancel: that copy, if there was one."""
        runner = self.runners.get(observer_id)
        copy = None if runner is None else runner.copy

        def moot() -> bool:
            if runner is not None:
                return self.runners.get(observer_id) is not runner
            return observer_id not in self.runners and not self.admission.admits(observer_id)

        facts = await self.checks.facts([observer_id], moot=moot)
        if facts is None or moot():
            return None
        if not cancel_confirmed(facts.observers.get(observer_id), self.id, copy):
            self._refused("cancel", f"cancel of {observer_id}")
            return None
        self.cancel(observer_id)
        return runner

    async def _handoff_checked(self, control: HandoffMessage) -> None:
        oid = control.observer_id
        runner = self.runners.get(oid)
        if runner is None:
            return
        facts = await self.checks.facts([oid], moot=lambda: self.runners.get(oid) is not runner)
        if facts is None or self.runners.get(oid) is not runner:
            return
        if not handoff_confirmed(facts.observers.get(oid), self.id, runner.copy, control.to):
            self._refused("handoff", f"handoff of {oid} to {control.to}")
            return
        runner.ctx.logger.info("handing over to %s", control.to)
        runner.stop(StopReason.HANDOFF, to=control.to)

    def cancel(self, observer_id: uuid.UUID) -> None:
        """Stop this observer's copy (or the start being admitted): the database says so."""
        runner = self.runners.get(observer_id)
        if runner is not None:
            runner.stop(StopReason.DELETED_OR_PAUSED)
        else:
            self.admission.cancel(observer_id)

    # ----------------------------------------------------------------- lease (its listener)
    def lease_lost(self, reason: str) -> None:
        self.metrics.lease_lost.labels(reason).inc()
        self._stop_where(lambda r: True, StopReason.LEASE_LOST)
        self._lease_lost.set()

    def renewal_took(self, seconds: float) -> None:
        self.metrics.renewal.observe(seconds)

    def copies(self) -> Collection[Copy]:
        return [r.copy for r in self.runners.values()]

    def stalled_lately(self) -> bool:
        return self.stalls.stalled_lately()

    def taking(self) -> Collection[uuid.UUID]:
        return self.admission.taking_ids(TAKING_REPORTED)

    async def _went_back(self, copy: Copy) -> int | None:
        """The epoch of ours this copy's row names, where it is earlier than the copy's (a
        failover lost the copy's take); None otherwise, or when the database cannot say."""
        try:
            facts = await self.store.control_facts([copy.observer_id])
        except Transient:
            return None
        row = facts.observers.get(copy.observer_id)
        if row is None or row.holder != self.id or row.epoch >= copy.epoch:
            return None
        return row.epoch

    def superseded(self, copies: Collection[Copy], held: Collection[Copy] = ()) -> None:
        gone = set(copies)
        ours = {c.observer_id: c.epoch for c in held}
        back = [
            r
            for r in self.runners.values()
            if r.copy in gone and ours.get(r.observer_id, r.epoch) < r.epoch
        ]
        for r in back:
            r.row_epoch = ours[r.observer_id]
        if back:
            log.error(
                "%d rows went back to an earlier epoch of ours (the database failed over and "
                "lost their takes): their copies stop, and they are taken again",
                len(back),
            )
            self._stop_where(lambda r: r in back, StopReason.ROLLED_BACK)
        self._stop_where(lambda r: r.copy in gone and r not in back, StopReason.SUPERSEDED)

    async def _renewals(self) -> None:
        """What renewals learn: own observers being deleted (a missed broadcast), a drain or an
        undrain; and now and then, whether the rows we hold are the copies we run: at once,
        copy by copy, when the database's timeline changed (a failover, which may have lost
        its last writes: rows gone back to an earlier epoch, or to no holder)."""
        checked = self.clock.now()
        timeline: int | None = None
        while True:
            renewal = await self.lease.renewals.get()
            for oid in renewal.deleting:
                self.cancel(oid)
            self._directed_by_database(renewal.directed)
            if renewal.draining and not self._lately(self._undrained_at):
                self.drain()
            elif not renewal.draining and self.draining and not self._lately(self._drained_at):
                self.undrain()  # its broadcast was missed: the row says so all the same
            failed_over = timeline is not None and renewal.timeline not in (None, timeline)
            if renewal.timeline is not None:
                timeline = renewal.timeline
            if failed_over:
                log.warning(
                    "the database failed over (timeline %s): checking every copy against its row",
                    timeline,
                )
            if failed_over or self.clock.now() - checked >= self.config.check_every:
                checked = self.clock.now()
                await self._check_held(every=failed_over)

    def _directed_by_database(self, starts: list[StartMessage]) -> None:
        """Starts directed to this service that nobody took (the directed start lost with a
        control queue, or not published in a broker alarm): taken from the database, at most
        once a lease's length each (one whose admission ended without a take, its requeue
        unpublished with the broker cut off, is asked again). A delivery that comes later is
        a duplicate for the take rule."""
        now = self.clock.now()
        for start in starts:
            key = (start.observer_id, start.dispatch_id)
            asked = self._directed_seen.get(key)
            if asked is not None and now - asked < self.lease.timings.ttl:
                continue
            if not self.accepting():
                continue
            if self.admission.admits(start.observer_id) or start.observer_id in self.runners:
                continue
            self._directed_seen.pop(key, None)
            self._directed_seen[key] = now
            if len(self._directed_seen) > 10_000:
                del self._directed_seen[next(iter(self._directed_seen))]
            log.info("observer %s: its directed start read from the database", start.observer_id)
            self.spawn(self.intake.admit(start, DIRECTED), f"directed-{start.observer_id}")

    def _lately(self, since: float | None) -> bool:
        """Within a lease's length of ``since`` (an undrain, a drain): a renewal's ``draining``
        may predate it. (The renewal only backs up the broadcasts, which are acted on whenever
        the database confirms them.)"""
        return since is not None and self.clock.now() - since < self.lease.timings.ttl

    async def _check_held(self, *, every: bool = False) -> None:
        """Whether the rows this service holds are the copies it runs, both ways: rows held
        but not run are released; copies run whose row no longer names them (a stop answered
        while the take that made them was committing, say) are stopped as taken by another,
        even if they never write (a write of theirs would be fenced). The rows are read one
        by one when fewer are held than run, or ``every`` time (after a failover, a row may
        name us at an earlier epoch than our copy's)."""
        held = await until_done(self.store.held_count, "counting held observers")
        running = [
            r
            for r in self.runners.values()
            if r.stop_reason is None and r.task is not None and not r.task.done()
        ]
        if every or held < len(running):
            rows = await until_done(self.store.held_copies, "reading held observers")
            stray = {r.copy for r in running if r.copy not in rows}
            if stray:
                log.error("%d copies run here whose rows are not ours: stopped", len(stray))
                self.superseded(stray, rows)
                if every:  # their rows, held at an earlier epoch, are released once they ended
                    ending = [r.finished.wait() for r in running if r.copy in stray]
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.gather(*ending), self.lease.timings.ttl)
        if held <= len(self.runners) + self.admission.in_flight:
            return
        log.warning("the database says we hold %d observers; we run %d", held, len(self.runners))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reconcile(), self.lease.timings.ttl)

    async def _recovery(self) -> None:
        """After a fence: wait until every copy has stopped and settled, release whatever the
        database still says we hold, then let the lease come back (on a new session)."""
        while True:
            await self._lease_lost.wait()
            self._lease_lost.clear()
            while self.runners:
                await asyncio.wait(
                    [asyncio.create_task(r.finished.wait()) for r in list(self.runners.values())]
                )
            await self._reconcile()
            if self._lease_lost.is_set():
                continue
            self.lease.allow_rejoin()

    async def _reconcile(self) -> None:
        async with self.admission.paused():
            released = await until_done(
                lambda: self.store.reconcile(set(self.runners)), "releasing what we hold"
            )
        if released:
            log.info("released %d observers this service no longer runs", released)

    # ----------------------------------------------------------------- helpers
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None:
        """A short task of the service: named, kept, and its death of a bug stops the service."""
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._spawned_done)

    def _spawned_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        log.critical("task %r died (%r): stopping the service", task.get_name(), exc, exc_info=exc)
        self._spawned_died.set()

    async def _consuming(self, session: BrokerSession, *, on: bool) -> None:
        """Start or stop taking work on this session; a session that closed meanwhile needs
        neither (the next one opens with ``consume_work = not draining``)."""
        try:
            await (session.start_consuming() if on else session.stop_consuming())
        except BrokerUnavailable as exc:
            log.info(
                "broker session gone while %s consuming (%s)", "starting" if on else "stopping", exc
            )
