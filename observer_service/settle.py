"""What happens once a copy of an observer has stopped: one fenced write that releases it, and
what becomes of the start message behind it.

The row decides the write: an observer whose row is ``on_deleting`` becomes ``deleted`` however
its copy was stopped (a delete wins over a drain, a handoff or a lost broker channel); one still
``processing`` is released. The stop reason decides only where a released observer goes next.
The write is retried until it lands: an observer is never left held by a service that does not
run it. This is the one place where settling is handled.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from enum import Enum, auto

from observer_service.metrics import ServiceMetrics
from observer_service.origin import Origin
from observer_service.ports import BrokerSession, Copy
from observer_service.retry import until_done
from observer_service.runner import ResourceShort, Runner, StopReason
from orch_contracts.errors import BrokerUnavailable, Fenced, LeaseLost, split_error
from orch_contracts.messages import StartMessage
from orch_contracts.statuses import ObserverStatus

log = logging.getLogger(__name__)


class Settlement(Enum):
    """What becomes of a start message: ACK (done with: deleted, paused, failed elsewhere, or
    held by a newer copy), REQUEUE (back to the work queue, for another service), DEAD_LETTER
    (to the error queue: failed for good), HANDOFF (a directed start to one named service)."""

    ACK = auto()
    REQUEUE = auto()
    DEAD_LETTER = auto()
    HANDOFF = auto()


Release = Callable[[Copy, str], Awaitable[ObserverStatus | None]]
Blame = Callable[[uuid.UUID, str], Awaitable[bool]]
#: The epoch a fenced copy's row names, where it names this service at an earlier one.
WentBack = Callable[[Copy], Awaitable[int | None]]


async def _never(copy: Copy) -> int | None:
    return None


class Settler:
    def __init__(
        self,
        *,
        release: Release,
        blame: Blame,
        session: Callable[[], BrokerSession | None],
        metrics: ServiceMetrics,
        went_back: WentBack = _never,
    ) -> None:
        self._release = release
        self._blame = blame
        self._went_back = went_back
        self._session = session
        self.metrics = metrics

    async def release(self, copy: Copy, detail: str) -> ObserverStatus | None:
        """Release a stopped copy (or complete its stop); None where it was fenced."""
        return await self._release(copy, detail)

    async def settle_stopped(self, runner: Runner) -> None:
        """Record why the copy stopped and settle its message."""
        task = runner.task
        assert task is not None
        assert task.done()
        start, origin = runner.taken.start, runner.origin
        exc = None if task.cancelled() else task.exception()
        if runner.blame is not None:
            await self._fail_blamed(runner, runner.blame)
            return
        if isinstance(exc, Fenced):
            # Taken by another, as a rule: its start is theirs. But a row gone back to an
            # earlier take of ours (a database failover lost the later one) is released and
            # its start requeued, or nobody would take it again.
            back = await self._went_back(runner.copy)
            if back is None:
                runner.ctx.logger.warning("fenced (%s): stopped", exc)
                await self.settle(start, origin, Settlement.ACK)
                return
            runner.row_epoch = back
            runner.stop_reason = runner.stop_reason or StopReason.ROLLED_BACK
        if not task.cancelled() and exc is None:  # the restart budget is spent: row failed
            runner.ctx.logger.error("failed after its last restart: %s", task.result())
            await self.settle(start, origin, Settlement.DEAD_LETTER)
            return
        reason = runner.stop_reason
        if reason is None and isinstance(exc, ResourceShort):
            runner.ctx.logger.warning("moves to another service: %s", split_error(str(exc))[0])
            reason = StopReason.RESOURCES
        elif reason is None:
            if not isinstance(exc, LeaseLost):
                runner.ctx.logger.error("copy ended unexpectedly: %r", exc)
            reason = StopReason.LEASE_LOST
        copy = runner.copy
        if reason is StopReason.ROLLED_BACK and runner.row_epoch is not None:
            copy = Copy(runner.observer_id, runner.row_epoch)  # the take the row still has
        status = await until_done(
            lambda: self._release(copy, reason.value),
            f"releasing observer {runner.observer_id}",
        )
        runner.ctx.logger.info("stopped (%s): %s", reason.value, status or "fenced")
        if status is None:
            self.metrics.fenced.labels("release").inc()
        elif status is ObserverStatus.PROCESSING:
            self.metrics.releases.labels(reason.name.lower()).inc()
        if status is not ObserverStatus.PROCESSING:
            await self.settle(start, origin, Settlement.ACK)
        elif reason is StopReason.HANDOFF and runner.handoff_to is not None:
            await self.settle(start, origin, Settlement.HANDOFF, to=runner.handoff_to)
        else:
            await self.settle(start, origin, Settlement.REQUEUE)

    async def _fail_blamed(self, runner: Runner, reason: str) -> None:
        """Failed with no lease needed, before its message goes anywhere; a cancel tells
        whoever took it meanwhile (a takeover during the stall) to stop it too."""
        oid = runner.observer_id
        if await until_done(lambda: self._blame(oid, reason), f"failing observer {oid}"):
            self.metrics.failed.labels(runner.ctx.kind).inc()
            runner.ctx.logger.error("failed: %s, past the lease", reason)
        await self._publish(runner.taken.start, lambda s: s.send_cancel(oid))
        await self.settle(runner.taken.start, runner.origin, Settlement.ACK)

    async def settle(
        self,
        start: StartMessage,
        origin: Origin,
        how: Settlement,
        *,
        to: uuid.UUID | None = None,
    ) -> None:
        """Settle the start behind a copy on its delivery; what the origin cannot settle (no
        delivery, or its session is gone) is published anew, and if that fails too, the
        leader's audit re-dispatches the observer."""
        if how is Settlement.ACK:
            await origin.ack()
        elif how is Settlement.HANDOFF:
            if await self._publish(start, lambda s: s.send_start(start, on=to)):
                await origin.ack()
            elif not await origin.requeue():
                await self._publish(start, lambda s: s.send_start(start))
        elif how is Settlement.REQUEUE:
            if not await origin.requeue():
                await self._publish(start, lambda s: s.send_start(start))
        elif not await origin.reject():
            await self._publish(start, lambda s: s.send_error(start))

    async def _publish(
        self, start: StartMessage, send: Callable[[BrokerSession], Awaitable[None]]
    ) -> bool:
        session = self._session()
        try:
            if session is None or not session.is_open:
                raise BrokerUnavailable("no broker session")
            await send(session)
            return True
        except BrokerUnavailable as exc:
            log.warning("could not publish for %s: %s", start.observer_id, exc)
            return False
