"""Start messages, from their arrival to a running copy or a settled message.

The starts that arrive together (a burst of redeliveries after a crash, directed starts from
the leader) are decided with one read and taken with one compare-and-set (``takes``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from contracts.errors import BrokerUnavailable
from contracts.kinds import KindSpec, RestartPolicy
from contracts.logs import observer_log
from contracts.messages import StartMessage
from observer_service.batching import Batcher
from observer_service.context import ObserverContext
from observer_service.ports import (
    Checkpoint,
    Copy,
    Delivery,
    ErrorRecord,
    StartRequest,
    Taken,
    TakeResult,
)
from observer_service.retry import until_done, while_leased
from observer_service.runner import Runner, StopReason, refused, run_observer
from observer_service.settle import Disposition
from observer_service.take import Decision, Departed

if TYPE_CHECKING:
    from observer_service.service import ObserverService

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, service: ObserverService, kinds: dict[str, KindSpec]) -> None:
        self.service = service
        self.kinds = kinds
        self.takes: Batcher[StartRequest, TakeResult] = Batcher(self._take_batch, in_flight=2)
        self.departed = Departed()
        self._probes: dict[int, asyncio.Future[bool]] = {}

    async def on_start(self, delivery: Delivery) -> None:
        try:
            start = StartMessage.model_validate_json(delivery.body)
        except ValidationError as exc:
            log.error("malformed start message sent to the error queue: %s", exc)
            await delivery.reject()
            return
        await self.admit(start, delivery)

    async def admit(self, start: StartMessage, delivery: Delivery | None) -> None:
        """Take the observer if the rule allows and a slot is free, then run it.

        ``delivery`` is the work-queue delivery to hold while it runs; None for a directed
        start, which is handed to the work queue whenever it cannot run here."""
        s = self.service
        oid = start.observer_id
        async with s.admission.admitting(oid) as entry:
            if s.stopping or s.draining:
                await s.settler.dispose(start, delivery, Disposition.REQUEUE)
                return
            existing = s.runners.get(oid)
            if existing is not None and not s.session_open(existing.generation):
                # A copy delivered on a dead session: it is being stopped; never run two here.
                existing.stop(StopReason.CHANNEL_LOST)
                await existing.finished.wait()
                existing = None
            if not s.lease.check_or_fence():
                # Fenced: let others have it, but not in a tight loop back to us.
                await asyncio.sleep(s.lease.timings.renew_interval)
                await s.settler.dispose(start, delivery, Disposition.REQUEUE)
                return
            if delivery is None and s.admission.slots.locked():
                await s.settler.dispose(start, None, Disposition.REQUEUE)  # no room any more
                return
            await s.admission.slots.acquire()
            started = False
            try:
                taken = await self._take(start, delivery, running_here=existing is not None)
                if taken is not None:
                    started = self._start_runner(taken, delivery, cancelled=entry.cancelled)
            finally:
                if not started:
                    s.admission.slots.release()

    async def _take(
        self, start: StartMessage, delivery: Delivery | None, *, running_here: bool
    ) -> Taken | None:
        """The taken observer, or None once the start message is settled otherwise."""
        s = self.service
        request = StartRequest(
            start,
            redelivered=delivery is not None and delivery.redelivered,
            running_here=running_here,
        )
        # A holder that lost its channel releases its copy (or its lease runs out) within a
        # lease; a redelivery still waiting after that is a duplicate of a copy that runs.
        give_up = s.clock.now() + s.lease.timings.ttl + s.lease.timings.renew_interval
        backoff = 0.005
        while True:
            result = await self.takes.submit(request)
            if result.decision is Decision.PROBE:
                if await self._holder_gone(result):
                    continue  # proven gone: decide again at once
            elif result.decision is not Decision.WAIT:
                break
            if s.stopping or _dead(s, delivery) or not s.lease.check_or_fence():
                await s.settler.dispose(start, delivery, Disposition.REQUEUE)
                return None
            if s.clock.now() > give_up:
                result = TakeResult(Decision.DROP_DUPLICATE)
                break
            await asyncio.sleep(min(backoff, max(0.005, result.holder_remaining)))
            backoff = min(backoff * 2, 0.25)
        if result.decision is not Decision.TAKE:
            observer_log(log, observer_id=start.observer_id).info(
                "start message: %s", result.decision.value
            )
            await s.settler.dispose(start, delivery, Disposition.ACK)
            return None
        taken = result.taken
        assert taken is not None
        if s.stopping or s.draining or _dead(s, delivery) or not s.lease.check_or_fence():
            # Too late to run it here: let go at once so that another service takes it.
            await until_done(
                lambda: s.let_go(taken.copy, "taken while stopping"), "letting go of a late take"
            )
            await s.settler.dispose(start, delivery, Disposition.REQUEUE)
            return None
        return taken

    async def _take_batch(self, requests: list[StartRequest]) -> Sequence[TakeResult]:
        """The flush of ``takes``: one read and one compare-and-set for the whole batch."""
        self.service.metrics.take_batch.observe(len(requests))
        return await self.service.store.take_many(requests, self.departed)

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
        session = self.service.session
        if session is None:
            return False
        try:
            present = await session.service_present(holder)
        except BrokerUnavailable:
            return False
        if not present:
            self.departed.off_broker(key)
        return not present

    def _start_runner(self, taken: Taken, delivery: Delivery | None, *, cancelled: bool) -> bool:
        s = self.service
        spec = self.kinds.get(taken.kind)
        params: Any = taken.params
        error: str | None = None
        policy: RestartPolicy | None = None
        if spec is None:
            error = f"kind {taken.kind!r} is not installed on service {s.config.name}"
        else:
            try:
                policy = spec.policy(taken.restart_policy)
                if spec.params_model is not None:
                    params = spec.params_model.model_validate(taken.params)
            except ValidationError as exc:
                error = f"invalid params or restart policy: {exc}"
        if spec is None or policy is None or error is not None:
            s.spawn(self._fail_unrunnable(taken, delivery, error or "unrunnable"))
            return False
        copy = taken.copy
        ctx = ObserverContext(
            observer_id=taken.observer_id,
            name=taken.name,
            kind=taken.kind,
            epoch=taken.epoch,
            service_id=s.id,
            params=params,
            last_checkpoint=taken.checkpoint,
            save=lambda state: self._save(copy, state),
            alive=s.lease.check_or_fence,
        )
        runner = Runner(taken=taken, spec=spec, ctx=ctx, delivery=delivery)

        async def record_error(error: str) -> ErrorRecord:
            return await self._record_error(copy, taken.kind, error, policy)

        runner.task = asyncio.create_task(
            run_observer(spec, ctx, policy, gate=s.lease.gate, record_error=record_error),
            name=f"observer-{taken.observer_id}",
        )
        s.add_runner(runner)
        s.metrics.takes.inc()
        if cancelled:
            s.cancel(taken.observer_id)
        ctx.logger.info("running (epoch %d)", taken.epoch)
        return True

    async def _save(self, copy: Copy, state: Any) -> None:
        """A checkpoint: fenced, batched, retried while the lease holds."""
        item = Checkpoint(copy[0], copy[1], json.dumps(state))
        s = self.service
        if not await while_leased(lambda: s.checkpoints.submit(item), s.lease.check_or_fence):
            s.metrics.fenced.labels("checkpoint").inc()
            raise refused("checkpoint")

    async def _record_error(
        self, copy: Copy, kind: str, error: str, policy: RestartPolicy
    ) -> ErrorRecord:
        s = self.service
        record = await while_leased(
            lambda: s.store.record_error(copy, error, policy), s.lease.check_or_fence
        )
        if record is None:
            s.metrics.fenced.labels("restart_record").inc()
            raise refused("restart record")
        (s.metrics.failed if record.failed else s.metrics.restarts).labels(kind).inc()
        return record

    async def _fail_unrunnable(self, taken: Taken, delivery: Delivery | None, error: str) -> None:
        s = self.service
        observer_log(
            log, observer_id=taken.observer_id, name=taken.name, kind=taken.kind, epoch=taken.epoch
        ).error("cannot run: %s", error)
        failed = await until_done(lambda: s.store.fail(taken.copy, error), "failing an observer")
        if failed:
            s.metrics.failed.labels(taken.kind).inc()
        how = Disposition.DEAD_LETTER if failed else Disposition.ACK
        await s.settler.dispose(taken.start, delivery, how)


def _dead(service: ObserverService, delivery: Delivery | None) -> bool:
    return delivery is not None and not service.session_open(delivery.generation)
