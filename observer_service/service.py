"""The observer service: takes start messages, runs observers, stops them when it must.

Side tasks (lease, broker session, checkpoint writer) are named and supervised: if one dies,
the service stops every observer and exits non-zero rather than limp on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Iterator
from typing import Any

import asyncpg
from aio_pika.abc import AbstractIncomingMessage
from pydantic import ValidationError
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential_jitter

from contracts import __version__
from contracts.kinds import KindSpec
from contracts.messages import (
    CONTROL_MESSAGE,
    DirectedStart,
    DrainMessage,
    HandoffMessage,
    StartMessage,
)
from contracts.settings import default_host
from observer_service.broker import BrokerSession
from observer_service.checkpoints import CheckpointWriter
from observer_service.context import ObserverContext
from observer_service.errors import Fenced
from observer_service.lease import LeaseKeeper
from observer_service.runner import (
    Runner,
    StopReason,
    effective_policy,
    run_with_restarts,
)
from observer_service.settings import ServiceSettings
from observer_service.settle import Settler, start_of
from observer_service.store import Store, Taken
from observer_service.take import Decision

log = logging.getLogger(__name__)


class ObserverService:
    def __init__(self, settings: ServiceSettings, kinds: dict[str, KindSpec]) -> None:
        self.settings = settings
        self.kinds = kinds
        self.id = uuid.uuid4()
        self.runners: dict[uuid.UUID, Runner] = {}
        self.taking: set[uuid.UUID] = set()
        self._cancel_while_taking: set[uuid.UUID] = set()
        self.capacity = asyncio.Semaphore(settings.worker_count)
        self.session: BrokerSession | None = None
        self.stopping = False
        #: Draining: takes no new work, hands every observer over (POST /services/{id}/drain).
        self.draining = False
        self._stop = asyncio.Event()
        self._needs_reconcile = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task[Any]] = set()

    # ----------------------------------------------------------------- lifecycle
    def request_stop(self) -> None:
        """Begin a graceful stop (SIGTERM, SIGINT)."""
        self._stop.set()

    async def run(self) -> int:
        s = self.settings
        # A query slower than a lease is useless: whatever it guarded has been fenced by then.
        self.pool = await asyncpg.create_pool(
            s.asyncpg_dsn,
            min_size=1,
            max_size=min(20, 2 + s.worker_count),
            timeout=max(2.0, s.lease_ttl),
            command_timeout=max(5.0, 2 * s.lease_ttl),
        )
        self.store = Store(self.pool, self.id)
        self.settler = Settler(self.store, lambda: self.session)
        self.checkpoints = CheckpointWriter(self.pool)
        self.lease = LeaseKeeper(
            dsn=s.asyncpg_dsn,
            service_id=self.id,
            name=s.name,
            worker_count=s.worker_count,
            host=default_host(),
            version=__version__,
            ttl=s.lease_ttl,
            renew_interval=s.renew_every,
            margin=s.margin,
            on_lost=self._on_lease_lost,
            on_renewed=self._on_renewed,
        )
        await self.lease.register()
        log.info(
            "service %s (%s) up: worker_count=%d prefix=%s",
            self.id,
            s.name,
            s.worker_count,
            s.prefix,
        )
        side = [
            asyncio.create_task(self.lease.run(), name="lease"),
            asyncio.create_task(self.checkpoints.run(), name="checkpoint-writer"),
            asyncio.create_task(self._broker_loop(), name="broker"),
        ]
        stop = asyncio.create_task(self._stop.wait(), name="stop-signal")
        done, _ = await asyncio.wait([*side, stop], return_when=asyncio.FIRST_COMPLETED)
        code = 0
        for task in done:
            if task is not stop:
                code = 1
                exc = None if task.cancelled() else task.exception()
                log.critical("side task %r died (%r): stopping the service", task.get_name(), exc)
        await self._shutdown(side)
        return code

    async def _shutdown(self, side: list[asyncio.Task[Any]]) -> None:
        """Stop taking work, stop every observer, release them, requeue their messages."""
        self.stopping = True
        session = self.session
        if session is not None:
            await session.stop_consuming()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self.settings.shutdown_timeout)
        runners = list(self.runners.values())
        for r in runners:
            r.stop(StopReason.SHUTDOWN)
        tasks = [r.task for r in runners if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.shutdown_timeout)
        held = [(r.observer_id, r.epoch) for r in runners if r.stop_reason is StopReason.SHUTDOWN]
        try:
            await self.store.release(held, StopReason.SHUTDOWN.value)
        except Exception as exc:
            log.warning("could not release observers: %s", exc)
        for r in runners:
            if r.stop_reason is StopReason.SHUTDOWN:
                await self.settler.message(start_of(r.taken), r.message, "nack")
        finished = [asyncio.create_task(r.finished.wait()) for r in runners]
        if finished:
            await asyncio.wait(finished, timeout=5)
        log.info("released %d observers; leaving", len(held))
        for task in side:
            task.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        await self.lease.close(deleted=True)
        if session is not None:
            await session.close()
        await self.pool.close()

    # ----------------------------------------------------------------- broker
    async def _broker_loop(self) -> None:
        while not self.stopping:
            session = await self._open_session()
            self.session = session
            await session.closed.wait()
            gen = session.generation
            self._stop_where(lambda r, gen=gen: r.generation == gen, StopReason.CHANNEL_LOST)
            await session.close()

    async def _open_session(self) -> BrokerSession:
        async for attempt in AsyncRetrying(
            wait=wait_exponential_jitter(initial=0.1, max=5.0),
            retry=retry_if_exception_type(Exception),
            before_sleep=lambda st: log.warning(
                "broker unreachable (%s); retrying", st.outcome and st.outcome.exception()
            ),
        ):
            with attempt:
                session = BrokerSession()
                try:
                    await session.open(
                        self.settings,
                        service_id=self.id,
                        prefetch=self.settings.worker_count,
                        on_start=self._on_start,
                        on_control=self._on_control,
                        consume_work=not self.draining,
                    )
                except BaseException:
                    await session.close()
                    raise
                return session
        raise AssertionError("unreachable")  # pragma: no cover

    def _session_open(self, generation: int) -> bool:
        s = self.session
        return s is not None and s.generation == generation and s.is_open

    # ----------------------------------------------------------------- start messages
    @contextlib.contextmanager
    def _in_flight_start(self) -> Iterator[None]:
        """Count a start being admitted, so that a graceful stop waits for it to settle."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def _on_start(self, message: AbstractIncomingMessage, generation: int) -> None:
        with self._in_flight_start():
            try:
                await self._handle_start(message, generation)
            except Exception:
                log.exception("start message handling failed; requeueing it")
                await asyncio.sleep(0.5)
                if self._session_open(generation):
                    await self.settler.message(None, message, "nack")

    async def _handle_start(self, message: AbstractIncomingMessage, generation: int) -> None:
        try:
            start = StartMessage.model_validate_json(message.body)
        except ValidationError as exc:
            log.error("malformed start message sent to the error queue: %s", exc)
            await message.reject(requeue=False)
            return
        await self._admit(start, message, generation)

    async def _admit(
        self,
        start: StartMessage,
        message: AbstractIncomingMessage | None,
        generation: int | None,
    ) -> None:
        """Take the observer if the rule allows and a slot is free, then run it.

        ``message`` is the work-queue delivery to hold while it runs; None for a directed start,
        which is handed back to the work queue whenever it cannot run here.
        """
        oid = start.observer_id
        if self.stopping or self.draining:
            await self.settler.message(start, message, "nack")
            return
        existing = self.runners.get(oid)
        if existing is not None and existing.generation not in (None, generation):
            # A copy delivered on a dead session: it is being stopped; never run two here.
            existing.stop(StopReason.CHANNEL_LOST)
            await existing.finished.wait()
            existing = None
        if not self.lease.valid():
            await asyncio.sleep(min(1.0, self.settings.lease_ttl / 5))
            await self.settler.message(start, message, "nack")
            return
        if message is None and self.capacity.locked():
            await self.settler.message(start, None, "nack")  # directed here, but no room any more
            return
        await self.capacity.acquire()
        started = False
        self.taking.add(oid)
        try:
            started = await self._take_and_start(start, message, generation, existing is not None)
        finally:
            self.taking.discard(oid)
            self._cancel_while_taking.discard(oid)
            if not started:
                self.capacity.release()

    async def _take_and_start(
        self,
        start: StartMessage,
        message: AbstractIncomingMessage | None,
        generation: int | None,
        running_here: bool,
    ) -> bool:
        oid = start.observer_id
        backoff = 0.05
        while True:
            result = await self.store.take(
                oid,
                start.dispatch_id,
                redelivered=bool(message is not None and message.redelivered),
                running_here_on_open_channel=running_here,
            )
            if result.decision is not Decision.WAIT:
                break
            assert message is not None
            assert generation is not None
            if self.stopping or not self._session_open(generation):
                if self._session_open(generation):
                    await message.nack(requeue=True)
                return False
            # The holder lost its channel but not (yet) its lease: it is stopping its copy.
            await asyncio.sleep(min(backoff, max(0.01, result.holder_remaining + 0.01)))
            backoff = min(backoff * 2, 0.5)
        if result.decision is not Decision.TAKE:
            log.info("start message for %s: %s", oid, result.decision.value)
            if message is not None:
                await message.ack()
            return False
        taken = result.taken
        assert taken is not None
        delivery_dead = generation is not None and not self._session_open(generation)
        if self.stopping or self.draining or delivery_dead or not self.lease.valid():
            # Too late to run it here: let go at once so that another service takes it.
            await self.store.release([(oid, taken.epoch)], "taken while stopping")
            if not delivery_dead:
                await self.settler.message(start, message, "nack")
            return False
        return self._start_runner(taken, message, generation)

    def _start_runner(
        self, taken: Taken, message: AbstractIncomingMessage | None, generation: int | None
    ) -> bool:
        spec = self.kinds.get(taken.kind)
        error: str | None = None
        params: Any = taken.params
        if spec is None:
            error = f"kind {taken.kind!r} is not installed on service {self.settings.name}"
        elif spec.params_model is not None:
            try:
                params = spec.params_model.model_validate(taken.params)
            except ValidationError as exc:
                error = f"invalid params: {exc}"
        if spec is None or error is not None:
            self._spawn(self.settler.fail_unrunnable(taken, message, error or "unrunnable"))
            return False
        ctx = ObserverContext(
            observer_id=taken.observer_id,
            name=taken.name,
            kind=taken.kind,
            epoch=taken.epoch,
            service_id=self.id,
            params=params,
            last_checkpoint=taken.checkpoint,
            write_checkpoint=self.checkpoints.write,
            lease_valid=self.lease.valid,
        )
        runner = Runner(taken=taken, spec=spec, ctx=ctx, message=message, generation=generation)
        policy = effective_policy(spec, taken.restart_policy)

        async def on_restart(err: str, delay: float) -> None:
            ctx.logger.warning("observer raised (%s); restarting in %.2fs", err, delay)
            if not await self.store.record_restart(taken.observer_id, taken.epoch, err):
                raise Fenced("restart record refused")

        runner.task = asyncio.create_task(
            run_with_restarts(spec, ctx, policy, on_restart), name=f"observer-{taken.observer_id}"
        )
        self.runners[taken.observer_id] = runner
        self._spawn(self._supervise(runner))
        if taken.observer_id in self._cancel_while_taking:
            runner.stop(StopReason.DELETE)
        ctx.logger.info("running (epoch %d)", taken.epoch)
        return True

    # ----------------------------------------------------------------- settling
    async def _supervise(self, runner: Runner) -> None:
        task = runner.task
        assert task is not None
        try:
            await asyncio.wait([task])
            if await self.settler.conclude(runner, task):
                self._needs_reconcile = True
        except Exception:
            log.exception("settling observer %s failed", runner.observer_id)
        finally:
            if self.runners.get(runner.observer_id) is runner:
                del self.runners[runner.observer_id]
            self.capacity.release()
            runner.finished.set()

    def drain(self) -> None:
        """Take no more work and hand every observer to the other services."""
        if self.draining:
            return
        self.draining = True
        log.warning("draining: handing over %d observers", len(self.runners))
        if self.session is not None:
            self._spawn(self.session.stop_consuming())
        self._stop_where(lambda r: True, StopReason.HANDOFF)

    # ----------------------------------------------------------------- control and lease
    async def _on_control(self, message: AbstractIncomingMessage, generation: int) -> None:
        try:
            control = CONTROL_MESSAGE.validate_json(message.body)
        except ValidationError as exc:
            log.error("malformed control message ignored: %s", exc)
            return
        if isinstance(control, DirectedStart):
            start = StartMessage(observer_id=control.observer_id, dispatch_id=control.dispatch_id)
            with self._in_flight_start():
                try:
                    await self._admit(start, None, None)
                except Exception:
                    log.exception("directed start failed; handing it to the work queue")
                    await self.settler.message(start, None, "nack")
        elif isinstance(control, HandoffMessage):
            runner = self.runners.get(control.observer_id)
            if runner is not None and runner.stop_reason is None:
                runner.handoff_to = control.to
                runner.stop(StopReason.HANDOFF)
        elif isinstance(control, DrainMessage):
            if control.service_id == self.id:
                self.drain()
        else:
            self._cancel(control.observer_id)

    def _cancel(self, observer_id: uuid.UUID) -> None:
        runner = self.runners.get(observer_id)
        if runner is not None:
            runner.stop(StopReason.DELETE)
        elif observer_id in self.taking:
            self._cancel_while_taking.add(observer_id)

    def _on_lease_lost(self, reason: str) -> None:
        self._needs_reconcile = True
        self._stop_where(lambda r: True, StopReason.LEASE_LOST)

    async def _on_renewed(
        self, deleting: list[uuid.UUID], was_fenced: bool, draining: bool
    ) -> None:
        for oid in deleting:
            self._cancel(oid)
        if draining:
            self.drain()  # in case the broadcast was missed
        if not (was_fenced or self._needs_reconcile):
            return
        if any(r.stop_reason is not None for r in self.runners.values()):
            return  # wait until the stopping copies have settled
        released = await self.store.release_orphans(set(self.runners) | self.taking)
        self._needs_reconcile = False
        if released:
            log.info("released %d observers this service no longer runs", released)

    def _stop_where(self, pred: Any, reason: StopReason) -> None:
        stopped = [r for r in self.runners.values() if pred(r)]
        for r in stopped:
            r.stop(reason)
        if stopped:
            log.warning("stopping %d observers: %s", len(stopped), reason.value)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
