"""Start messages, from their arrival to a taken observer (run by ``runner.Launcher``) or a
settled message.

The starts that arrive together (a burst of redeliveries after a crash, directed starts from
the leader) are decided with one read and taken with one compare-and-set (``takes``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

from pydantic import ValidationError

from observer_service.admission import Admission, Slot
from observer_service.lease import LeaseKeeper
from observer_service.metrics import ServiceMetrics
from observer_service.origin import Origin, Queued
from observer_service.ports import (
    BrokerSession,
    Copy,
    Delivery,
    Locked,
    StartRequest,
    Store,
    Taken,
    TakeResult,
)
from observer_service.retry import landed, until_done, while_leased
from observer_service.runner import Launcher, Runner
from observer_service.settle import Settlement, Settler
from observer_service.take import Decision, Departed
from observer_service.taking import take_many
from orch_contracts import tracing
from orch_contracts.backoff import Backoff
from orch_contracts.batching import LINGER, Batcher
from orch_contracts.clock import Clock
from orch_contracts.errors import BrokerUnavailable, LeaseLost, Transient
from orch_contracts.kinds import KindSpec
from orch_contracts.logs import observer_log
from orch_contracts.messages import StartMessage
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.tracing import Carrier

log = logging.getLogger(__name__)


class Host(Protocol):
    """What intake needs of the service around it."""

    runners: dict[uuid.UUID, Runner]

    def accepting(self) -> bool:
        """Neither stopping nor draining: new copies may start here."""
        ...

    def broker(self) -> BrokerSession | None: ...

    def adopted(self, runner: Runner) -> None:
        """A redelivery of a running copy's start was adopted as its delivery."""
        ...

    def superseded(self, copies: Collection[Copy]) -> None:
        """Stop these copies: their rows name another."""
        ...

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> None: ...


class Intake:
    def __init__(
        self,
        host: Host,
        *,
        name: str,
        kinds: dict[str, KindSpec],
        pool: str = DEFAULT_POOL,
        store: Store,
        lease: LeaseKeeper,
        admission: Admission,
        settler: Settler,
        launcher: Launcher,
        metrics: ServiceMetrics,
        clock: Clock,
    ) -> None:
        self.host = host
        self.name = name
        self.kinds = kinds
        #: Each kind installed here, with its version (what the take rule checks).
        self.versions = {name: spec.version for name, spec in kinds.items()}
        self.pool = pool
        self.store = store
        self.lease = lease
        self.admission = admission
        self.settler = settler
        self.launcher = launcher
        self.metrics = metrics
        self.clock = clock
        self.takes: Batcher[StartRequest, TakeResult | Locked] = Batcher(
            self._take_batch, in_flight=2, linger=LINGER
        )
        self.departed = Departed()
        self._probes: dict[int, asyncio.Future[bool]] = {}

    async def on_start(self, delivery: Delivery) -> None:
        try:
            start = StartMessage.model_validate_json(delivery.body)
        except ValidationError as exc:
            log.error("malformed start message sent to the error queue: %s", exc)
            await delivery.reject()
            return
        await self.admit(start, Queued(delivery), trace=delivery.trace)

    async def admit(
        self, start: StartMessage, origin: Origin, *, trace: Carrier | None = None
    ) -> None:
        """Take the observer if the rule allows and a slot is free, then run it; whatever
        happens, the start is settled (run, acked, requeued or dead-lettered).

        ``origin``: the work-queue delivery to hold while it runs, or ``DIRECTED`` for a start
        with no delivery behind it (handed to the work queue whenever it cannot run here)."""
        oid = start.observer_id
        with tracing.span(
            "take",
            parent=trace,
            kind="consumer",
            attributes=lambda: {"orch.observer_id": str(oid), "orch.service": self.name},
        ):
            async with self.admission.admitting(oid) as entry:
                try:
                    await self._admit(start, origin, cancelled=lambda: entry.cancelled)
                except Exception:  # a bug: the start must still be settled
                    log.exception("admitting the start of %s failed: requeued", oid)
                    await self.settler.settle(start, origin, Settlement.REQUEUE)

    async def _admit(
        self, start: StartMessage, origin: Origin, *, cancelled: Callable[[], bool]
    ) -> None:
        existing = self.host.runners.get(start.observer_id)
        if existing is not None and existing.stop_reason is not None:
            await existing.finished.wait()  # being stopped: never run two here
            existing = None
        if (
            existing is not None
            and existing.runs(start.dispatch_id)
            and isinstance(origin, Queued)
            and existing.adopt(origin)
        ):
            # Its session closed while the copy went on: this redelivery is its start now.
            existing.ctx.logger.info("adopted its redelivered start message")
            self.host.adopted(existing)
            return
        if not self.host.accepting():
            await self.settler.settle(start, origin, Settlement.REQUEUE)
            return
        if not self.lease.valid():
            # Fenced: let others have it, but not in a tight loop back to us.
            await asyncio.sleep(self.lease.timings.renew_interval)
            await self.settler.settle(start, origin, Settlement.REQUEUE)
            return
        headroom = self.admission.headroom
        if not headroom.ok():
            # Out of descriptors or memory here: another service runs it.
            if headroom.tell():
                log.warning("taking no start for now: %s", headroom.why())
            await asyncio.sleep(self.lease.timings.renew_interval)
            await self.settler.settle(start, origin, Settlement.REQUEUE)
            return
        slot = self.admission.slot()
        started = False
        try:
            request = StartRequest(
                start,
                redelivered=isinstance(origin, Queued) and origin.delivery.redelivered,
                running_here=existing is not None,
                room=await slot.take(wait=False),
                queued=isinstance(origin, Queued) and origin.live,
            )
            taken = await self._take(request, origin, slot)
            if taken is not None:
                if existing is not None and existing.copy != taken.copy:
                    # A copy of ours its row no longer named (a stop raced its take, then a
                    # resume): never two here. It stops before the new one starts.
                    self.host.superseded({existing.copy})
                    await existing.finished.wait()
                started = self._start_runner(taken, origin, cancelled=cancelled())
        finally:
            if not started:
                slot.give_back()

    async def _take(self, request: StartRequest, origin: Origin, slot: Slot) -> Taken | None:
        """The taken observer (a slot held for it), or None once the start message is settled
        otherwise. A database error is retried while the lease is surely ours; then the start
        is requeued (whatever the database holds for us is released before the lease comes
        back). A take whose reply was lost is found by the retry: the row names us, and it is
        taken again with a new epoch."""
        start = request.start
        timings = self.lease.timings
        # A redelivered start whose holder lives is a duplicate: the holder goes on through a
        # lost broker session. It waits only for the moment a crashed holder's database
        # session takes to be seen ended after its broker connection.
        give_up = self.clock.now() + timings.stale_after
        backoff = Backoff(0.005, 0.25)

        def alive() -> bool:
            return self.host.accepting() and self.lease.valid()

        while True:
            ended = self.lease.sessions_ended
            try:
                result = await while_leased(partial(self._submit_take, request), alive)
            except LeaseLost:
                await self.settler.settle(start, origin, Settlement.REQUEUE)
                return None
            if result.decision is Decision.NO_ROOM:
                if not isinstance(origin, Queued):
                    await self.settler.settle(start, origin, Settlement.REQUEUE)
                    return None
                # Free, it may be taken: wait for room (the prefetch bounds how many wait
                # here), but not for ever: copies that lost their deliveries hold slots the
                # prefetch does not count. Then let another service have it.
                try:
                    with self.admission.waiting_for_room(start.observer_id):
                        room = await asyncio.wait_for(slot.take(wait=True), timings.stale_after)
                except TimeoutError:
                    await asyncio.sleep(timings.renew_interval)
                    await self.settler.settle(start, origin, Settlement.REQUEUE)
                    return None
                request = replace(request, room=room)
                continue
            if result.decision is Decision.PROBE:
                if await self._holder_gone(result):
                    continue  # proven gone: decide again at once
            elif result.decision is not Decision.WAIT:
                break
            if not alive() or (isinstance(origin, Queued) and not origin.live):
                await self.settler.settle(start, origin, Settlement.REQUEUE)
                return None
            if self.clock.now() > give_up:
                result = TakeResult(Decision.DROP_DUPLICATE)
                break
            await asyncio.sleep(min(backoff.next(), max(0.005, result.holder_remaining)))
        if result.decision is Decision.NOT_HERE and not await self._pass_on(start, result):
            await self.settler.settle(start, origin, Settlement.REQUEUE)
            return None
        if result.decision is not Decision.TAKE:
            observer_log(log, observer_id=start.observer_id).info(
                "start message: %s", result.decision.value
            )
            await self.settler.settle(start, origin, Settlement.ACK)
            return None
        taken = result.taken
        assert taken is not None
        if not alive() or self.lease.bridging or self.lease.sessions_ended != ended:
            # Too late to run it here: release it at once so that another service takes it. A take
            # that crossed the end of our lease session is not covered by the new session's
            # look at our rows (someone may have taken it since), so it is released too.
            await until_done(
                lambda: self.settler.release(taken.copy, "taken while stopping"),
                "releasing a late take",
            )
            await self.settler.settle(start, origin, Settlement.REQUEUE)
            return None
        return taken

    async def _pass_on(self, start: StartMessage, result: TakeResult) -> bool:
        """Leave an observer of another pool, or whose kind is not installed here, to the
        leader, which sends it to a service of its pool that runs the kind: False when that
        could not be written (the start is then requeued, after a pause, for whoever takes it
        next)."""
        here = self.versions.get(result.kind or "")
        if result.pool not in (None, self.pool):
            why = f"it runs in pool {result.pool!r}; service {self.name} is in pool {self.pool!r}"
        elif here is not None and result.kind_version not in (None, here):
            why = (
                f"it is pinned to version {result.kind_version!r} of kind {result.kind!r}; "
                f"service {self.name} has version {here!r}"
            )
        else:
            why = f"kind {result.kind!r} is not installed on service {self.name}"
        try:
            await self.store.pass_on(start.observer_id, start.dispatch_id, why)
        except Transient as exc:
            observer_log(log, observer_id=start.observer_id).warning(
                "could not pass on a start for kind %r: %s", result.kind, exc
            )
            await asyncio.sleep(self.lease.timings.renew_interval)
            return False
        return True

    async def _submit_take(self, request: StartRequest) -> TakeResult:
        """A take in the next batch; RowLocked where its row was locked (retried alone).

        The client library cancels a consumer's callbacks when its session closes (the broker
        requeues their deliveries): a take committing in that instant would hold its row with
        nothing running it until the periodic check. Its answer is awaited shielded, and a
        take nobody waits for any more is released at once."""
        answer = asyncio.ensure_future(self.takes.submit(request))
        try:
            return landed(await asyncio.shield(answer))
        except asyncio.CancelledError:
            answer.add_done_callback(self._release_unawaited)
            raise

    def _release_unawaited(self, answer: asyncio.Future[TakeResult | Locked]) -> None:
        if answer.cancelled() or answer.exception() is not None:
            return
        result = answer.result()
        if isinstance(result, TakeResult) and result.taken is not None:
            taken = result.taken
            self.host.spawn(
                until_done(
                    lambda: self.settler.release(taken.copy, "taken as its admission ended"),
                    "releasing a take nobody waited for",
                ),
                f"release-{taken.observer_id}",
            )

    async def _take_batch(self, requests: list[StartRequest]) -> Sequence[TakeResult | Locked]:
        """The flush of ``takes``: one read and one compare-and-set for the whole batch."""
        self.metrics.take_batch.observe(len(requests))
        return await take_many(
            self.store, requests, self.departed, kinds=self.versions, pool=self.pool
        )

    async def _holder_gone(self, result: TakeResult) -> bool:
        """Whether the holder, whose database session has ended, is off the broker too. One
        question per holder session at a time, shared by every start it held; ``departed``
        remembers a yes for good."""
        key, holder = result.holder_key, result.holder
        if key is None or holder is None:
            return False
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = asyncio.ensure_future(self._ask_broker(holder, key))
            probe.add_done_callback(lambda _: self._probes.pop(key, None))
        return await asyncio.shield(probe)

    async def _ask_broker(self, holder: uuid.UUID, key: int) -> bool:
        session = self.host.broker()
        if session is None:
            return False
        try:
            present = await session.service_present(holder)
        except BrokerUnavailable:
            return False
        if not present:
            self.departed.off_broker(key)
        return not present

    def _start_runner(self, taken: Taken, origin: Origin, *, cancelled: bool) -> bool:
        started = self.launcher.start(taken, origin, cancelled=cancelled)
        if isinstance(started, str):
            self.host.spawn(
                self._fail_unrunnable(taken, origin, started), f"fail-{taken.observer_id}"
            )
            return False
        return True

    async def _fail_unrunnable(self, taken: Taken, origin: Origin, error: str) -> None:
        observer_log(
            log, observer_id=taken.observer_id, name=taken.name, kind=taken.kind, epoch=taken.epoch
        ).error("cannot run: %s", error)
        failed = await until_done(lambda: self.store.fail(taken.copy, error), "failing an observer")
        if failed:
            self.metrics.failed.labels(taken.kind).inc()
        how = Settlement.DEAD_LETTER if failed else Settlement.ACK
        await self.settler.settle(taken.start, origin, how)
