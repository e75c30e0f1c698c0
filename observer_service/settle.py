"""What happens once a copy of an observer stops: the fenced write that records why, and what
becomes of the start message behind it (ack, requeue, dead-letter, or a start elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aio_pika.abc import AbstractIncomingMessage

from contracts.messages import StartMessage
from observer_service.broker import BrokerSession
from observer_service.errors import Fenced, LeaseLost
from observer_service.runner import Runner, StopReason
from observer_service.store import Store, Taken

log = logging.getLogger(__name__)


def start_of(taken: Taken) -> StartMessage:
    return StartMessage(observer_id=taken.observer_id, dispatch_id=taken.dispatch_id)


class Settler:
    def __init__(self, store: Store, session: Callable[[], BrokerSession | None]) -> None:
        self.store = store
        self._session = session

    async def message(
        self, start: StartMessage | None, delivery: AbstractIncomingMessage | None, how: str
    ) -> None:
        """Ack, requeue ("nack") or dead-letter ("reject") the start behind a copy.

        A directed start has no delivery: requeue and dead-letter publish it anew (if that
        fails, the leader's audit re-dispatches it). A dead channel makes it a no-op.
        """
        if delivery is not None:
            try:
                if how == "ack":
                    await delivery.ack()
                elif how == "nack":
                    await delivery.nack(requeue=True)
                else:
                    await delivery.reject(requeue=False)
            except Exception as exc:
                log.debug("could not %s a message (its channel is gone): %s", how, exc)
            return
        if how == "ack":
            return
        assert start is not None, "a directed start has no delivery to settle"
        try:
            session = self._session()
            assert session is not None
            await session.publish(start, to_errors=how == "reject")
        except Exception as exc:
            log.warning("could not republish %s (the audit will): %s", start.observer_id, exc)

    async def conclude(self, runner: Runner, task: asyncio.Task[str]) -> bool:
        """Record why the copy stopped and settle its message. True when this service may
        still be named holder of observers it no longer runs (lost lease or channel)."""
        oid, epoch, start = runner.observer_id, runner.epoch, start_of(runner.taken)
        exc = None if task.cancelled() else task.exception()
        if isinstance(exc, Fenced):
            runner.ctx.logger.warning("fenced: another service holds epoch > %d; stopped", epoch)
            await self.message(start, runner.message, "ack")
            return False
        reason = runner.stop_reason
        if reason is None and isinstance(exc, LeaseLost):
            reason = StopReason.LEASE_LOST
        if reason is None and exc is not None:
            log.error("observer %s task ended with %r", oid, exc)
            reason = StopReason.LEASE_LOST
        if reason is None:
            error = task.result()
            runner.ctx.logger.error("failed after its last restart: %s", error)
            failed = await self.store.mark_failed(oid, epoch, error)
            await self.message(start, runner.message, "reject" if failed else "ack")
            return False
        runner.ctx.logger.info("stopped: %s", reason.value)
        if reason is StopReason.DELETE:
            await self.store.mark_deleted(oid, epoch)
            await self.message(start, runner.message, "ack")
        elif reason is StopReason.HANDOFF:
            await self.hand_over(runner)
        elif reason in (StopReason.LEASE_LOST, StopReason.CHANNEL_LOST):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.store.release([(oid, epoch)], reason.value), 1.0)
            await self.message(start, runner.message, "nack")
            return True
        # SHUTDOWN: released and requeued in one batch by the service's shutdown.
        return False

    async def hand_over(self, runner: Runner) -> None:
        """Release a stopped observer and start it elsewhere: on the chosen service when there
        is one (directed, so it cannot come straight back here), else through the work queue."""
        taken = runner.taken
        start = start_of(taken)
        released = await self.store.release([(taken.observer_id, taken.epoch)], "handed off")
        if not released:
            await self.message(start, runner.message, "ack")  # fenced: someone else has it
            return
        if runner.handoff_to is None:
            await self.message(start, runner.message, "nack")
            return
        try:
            session = self._session()
            assert session is not None
            await session.publish(start, to_service=runner.handoff_to)
        except Exception as exc:
            log.warning(
                "handoff of %s not sent (the audit re-dispatches it): %s", taken.observer_id, exc
            )
        await self.message(start, runner.message, "ack")

    async def fail_unrunnable(
        self, taken: Taken, delivery: AbstractIncomingMessage | None, error: str
    ) -> None:
        log.error("observer %s cannot run: %s", taken.observer_id, error)
        failed = await self.store.mark_failed(taken.observer_id, taken.epoch, error)
        await self.message(start_of(taken), delivery, "reject" if failed else "ack")
