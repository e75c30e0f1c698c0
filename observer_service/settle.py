"""What happens once a copy of an observer has stopped: one fenced write that lets go of it, and
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

from contracts.errors import BrokerUnavailable, Fenced, LeaseLost
from contracts.messages import StartMessage
from contracts.statuses import ObserverStatus
from observer_service.metrics import ServiceMetrics
from observer_service.ports import BrokerSession, Copy, Delivery
from observer_service.retry import until_done
from observer_service.runner import Runner, StopReason

log = logging.getLogger(__name__)


class Disposition(Enum):
    """What becomes of a start message: ACK (done with: deleted, paused, failed elsewhere, or
    held by a newer copy), REQUEUE (back to the work queue, for another service), DEAD_LETTER
    (to the error queue: failed for good), HANDOFF (a directed start to one named service)."""

    ACK = auto()
    REQUEUE = auto()
    DEAD_LETTER = auto()
    HANDOFF = auto()


LetGo = Callable[[Copy, str], Awaitable[ObserverStatus | None]]


class Settler:
    def __init__(
        self,
        *,
        let_go: LetGo,
        session: Callable[[], BrokerSession | None],
        metrics: ServiceMetrics,
    ) -> None:
        self._let_go = let_go
        self._session = session
        self.metrics = metrics

    async def conclude(self, runner: Runner) -> None:
        """Record why the copy stopped and settle its message."""
        task = runner.task
        assert task is not None
        assert task.done()
        start, delivery = runner.taken.start, runner.delivery
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, Fenced):
            runner.ctx.logger.warning("fenced (%s): stopped", exc)
            await self.dispose(start, delivery, Disposition.ACK)
            return
        if not task.cancelled() and exc is None:  # the restart budget is spent: row failed
            runner.ctx.logger.error("failed after its last restart: %s", task.result())
            await self.dispose(start, delivery, Disposition.DEAD_LETTER)
            return
        reason = runner.stop_reason
        if reason is None:
            if not isinstance(exc, LeaseLost):
                runner.ctx.logger.error("copy ended unexpectedly: %r", exc)
            reason = StopReason.LEASE_LOST
        status = await until_done(
            lambda: self._let_go(runner.copy, reason.value),
            f"letting go of observer {runner.observer_id}",
        )
        runner.ctx.logger.info("stopped (%s): %s", reason.value, status or "fenced")
        if status is None:
            self.metrics.fenced.labels("release").inc()
        elif status is ObserverStatus.PROCESSING:
            self.metrics.releases.labels(reason.name.lower()).inc()
        if status is not ObserverStatus.PROCESSING:
            await self.dispose(start, delivery, Disposition.ACK)
        elif reason is StopReason.HANDOFF and runner.handoff_to is not None:
            await self.dispose(start, delivery, Disposition.HANDOFF, to=runner.handoff_to)
        else:
            await self.dispose(start, delivery, Disposition.REQUEUE)

    async def dispose(
        self,
        start: StartMessage,
        delivery: Delivery | None,
        how: Disposition,
        *,
        to: uuid.UUID | None = None,
    ) -> None:
        """Settle the start behind a copy. A directed start has no delivery: requeueing or
        dead-lettering it publishes it anew; if that fails, the leader's audit re-dispatches it.
        A delivery whose session is gone needs nothing: the broker has requeued it."""
        if how is Disposition.ACK:
            if delivery is not None:
                await delivery.ack()
        elif how is Disposition.HANDOFF:
            if await self._publish(start, lambda s: s.send_start(start, on=to)):
                if delivery is not None:
                    await delivery.ack()
            elif delivery is not None:
                await delivery.requeue()
        elif how is Disposition.REQUEUE:
            if delivery is not None:
                await delivery.requeue()
            else:
                await self._publish(start, lambda s: s.send_start(start))
        elif delivery is None or not await delivery.reject():
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
            log.warning(
                "could not publish the start of %s (the audit will): %s", start.observer_id, exc
            )
            return False
