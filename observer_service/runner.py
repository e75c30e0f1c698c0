"""The copies a service runs: each started from its take (``Launcher``), its kind's code run under
the restart budget (``run_observer``), its commits written fenced, and why it stopped (``Runner``).

The kind's coroutine is driven through ``guarded``: it never resumes while the lease may be gone.
Its errors are its own; the orchestrator's own database trouble never reaches it as one.
"""

from __future__ import annotations

import asyncio
import functools
import traceback
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from pydantic import ValidationError

from observer_service.context import ObserverContext
from observer_service.guard import Gate, Timing, guarded
from observer_service.headroom import resource_error
from observer_service.lease import LeaseKeeper
from observer_service.metrics import ServiceMetrics
from observer_service.origin import Origin, Queued
from observer_service.outputs import CopyOutputs, OutputPublisher, checkpoint_json
from observer_service.ports import Checkpoint, Copy, ErrorRecord, Store, Taken
from observer_service.retry import landed, while_leased
from observer_service.stalls import StallWatch
from orch_contracts import aio, tracing
from orch_contracts.errors import Fenced, LeaseLost, split_error, stored_error
from orch_contracts.kinds import KindSpec, RestartPolicy, secret_values
from orch_contracts.logs import observer_log
from orch_contracts.masking import mask
from orch_contracts.witness import Witness


class StopReason(Enum):
    """Why the service stopped a copy; it decides where the observer goes next when the row is
    still processing once the copy has stopped (a delete or a pause always wins: the row
    decides)."""

    #: Its observer was deleted or paused (a cancel): the row says which.
    DELETED_OR_PAUSED = "deleted or paused"
    SHUTDOWN = "service stopping"
    DRAIN = "service draining"
    HANDOFF = "handed off"
    LEASE_LOST = "lease lost"
    #: Another service took it while this one's lease session was down (found on the new one).
    SUPERSEDED = "taken by another service"
    #: It met the limits of this process (descriptors, memory): another service runs it.
    RESOURCES = "out of this service's resources"
    #: Its row went back to an earlier epoch of ours (a database failover lost the take): the
    #: row is released at that epoch and the observer taken again under a new token.
    ROLLED_BACK = "its row went back (a database failover)"


#: Stops someone asked for, as against those the service was forced into.
ASKED = frozenset(
    {StopReason.DELETED_OR_PAUSED, StopReason.SHUTDOWN, StopReason.DRAIN, StopReason.HANDOFF}
)


class ObserverReturned(Exception):
    """An observer is meant to run until stopped; returning is treated as an error."""


class ResourceShort(Exception):
    """A copy met the limits of the process that runs it (``headroom.resource_error``): it
    goes to another service, and no restart is spent on it."""


class NoProgress(Exception):
    """A copy committed nothing (no checkpoint, no record) for its ``progress_timeout``."""


@dataclass(eq=False, slots=True)
class Runner:
    taken: Taken
    spec: KindSpec
    ctx: ObserverContext
    #: Where it came from: how its start message is settled when it stops.
    origin: Origin
    task: asyncio.Task[str] | None = None
    stop_reason: StopReason | None = None
    #: For a handoff: the service that should take it next.
    handoff_to: uuid.UUID | None = None
    #: It blocked the event loop past the lease: fail it, whatever else stopped it.
    blame: str | None = None
    finished: aio.Event = field(default_factory=aio.Event)
    #: Verify mode: the stop asked for is recorded.
    witness: Witness | None = None
    #: Another service took it: its code never runs again (``guard``: abandoned).
    superseded: bool = False
    #: What it emits and commits.
    outputs: CopyOutputs | None = None
    #: Rolled back: the epoch its row names now (the one released).
    row_epoch: int | None = None

    @property
    def observer_id(self) -> uuid.UUID:
        return self.taken.observer_id

    @property
    def epoch(self) -> int:
        return self.taken.epoch

    @property
    def copy(self) -> Copy:
        return self.taken.copy

    def runs(self, dispatch_id: uuid.UUID) -> bool:
        """It runs (is not being stopped) for that dispatch of the observer."""
        running = self.task is not None and not self.task.done()
        return running and self.stop_reason is None and self.taken.dispatch_id == dispatch_id

    def adopt(self, origin: Queued) -> bool:
        """Hold a redelivered start of this copy, if it holds no live delivery of its own (its
        session closed and it went on); False for a duplicate."""
        if self.origin.live:
            return False
        self.origin = origin
        return True

    def stop(self, reason: StopReason, *, to: uuid.UUID | None = None) -> None:
        """Ask the copy to stop now. The first reason given decides where it goes next."""
        if self.stop_reason is None:
            self.stop_reason = reason
            self.handoff_to = to
            if self.witness is not None:
                self.witness.stop(self.observer_id, self.epoch, reason.value)
        if reason is StopReason.SUPERSEDED:
            self.superseded = True
        self.ctx.stopping.set()
        if self.task is not None:
            self.task.cancel()

    def forget(self) -> None:
        """Once settled: drop the ended task and the tracebacks of its exception (and
        what caused it). Their frames hold this runner and the exception itself, a cycle that
        only a full collection would free (about 65 objects a copy, 4 KiB for a recorder, kept
        until then, and a full collection is rare in a process that runs many copies:
        ``orch_contracts.heap``)."""
        task, self.task = self.task, None
        if task is None or not task.done():
            return
        try:
            exc = task.exception()
        except asyncio.CancelledError as cancelled:  # the one it ended with, handed over once
            exc = cancelled
        # Dropping the traceback breaks the cycle; its frames are not cleared: a frame still
        # suspended (a kind's reader task that handed its error on) would be closed by that.
        for e in _chain(exc):
            e.__traceback__ = None

    def gate(self, lease: Gate) -> Gate:
        """The lease's gate for this copy, which also abandons it once it was superseded."""

        def gate() -> asyncio.Future[None] | None:
            if self.superseded:
                raise LeaseLost("taken by another service")
            return lease()

        return gate


RecordError = Callable[[str], Awaitable[ErrorRecord]]


async def run_observer(
    spec: KindSpec,
    ctx: ObserverContext,
    policy: RestartPolicy,
    *,
    gate: Gate,
    record_error: RecordError,
    timing: Timing | None = None,
    secrets: Sequence[str] = (),
    outputs: CopyOutputs | None = None,
    progress_timeout: float | None = None,
) -> str:
    """Run the kind; after an error, record it (the database counts restarts in a window that
    heals) and restart in place after a backoff with jitter. Returns the last error once the
    budget is spent (the row is failed by then). ``secrets``, the values of its secret params,
    never reach the error as recorded (row and history) and logged. An error of the process's
    own resources (descriptors, memory) moves the copy instead, ``ResourceShort``, once its
    restart is recorded.

    Cancellation, Fenced and LeaseLost are BaseExceptions: they pass straight through. With
    ``progress_timeout``, a run that commits nothing (``outputs``) for that long is cancelled
    and counts as its error, ``NoProgress``.
    """
    while True:
        try:
            if outputs is not None and progress_timeout is not None:
                await _with_progress(
                    guarded(spec.run(ctx), gate, timing, ctx.abandoned), outputs, progress_timeout
                )
            else:
                await guarded(spec.run(ctx), gate, timing, ctx.abandoned)
            returned = ObserverReturned("run() returned; an observer must run until stopped")
            error = describe(returned, secrets)
        except Exception as exc:
            error = describe(exc, secrets)
            if resource_error(exc):
                # It moves, spending one restart of its budget: a kind that exhausts every
                # process it runs in (a descriptor leak) fails in the end, not moves for ever.
                if (await record_error(error)).failed:
                    return error
                raise ResourceShort(error) from None
        if outputs is not None and outputs.commit_every is None:
            # The next run resumes from the last checkpoint and emits these again (records of a
            # kind that commits on its own are committed as they are).
            outputs.discard_staged()
        record = await record_error(error)
        if record.failed:
            return error
        delay = policy.delay(record.restarts)
        ctx.logger.warning(
            "raised (%s); restart %d of %d in %.2fs",
            split_error(error)[0],  # its traceback is shown with the observer, not logged
            record.restarts,
            policy.max_restarts,
            delay,
        )
        await ctx.sleep(delay)


async def _with_progress(run: Any, outputs: CopyOutputs, seconds: float) -> None:
    """Await ``run``; raise NoProgress once ``outputs`` committed nothing for ``seconds`` (from
    the start of this run at the earliest)."""
    loop = asyncio.get_running_loop()
    outputs.committed_at = loop.time()
    check: asyncio.TimerHandle | None = None
    limit = asyncio.timeout(None)
    try:
        async with limit:

            def follow() -> None:
                nonlocal check
                limit.reschedule(outputs.committed_at + seconds)
                check = loop.call_later(min(1.0, seconds / 2), follow)

            follow()
            try:
                await run
            finally:
                if check is not None:
                    check.cancel()
    except TimeoutError:
        if limit.expired():
            raise NoProgress(f"no progress for {seconds:g} s") from None
        raise


def describe(exc: BaseException | None, secrets: Sequence[str] = ()) -> str:
    """An error as stored: its line, then the traceback when it was raised
    (``orch_contracts.errors.stored_error``). The observer's secret values, URL credentials and
    secret query values are masked first, then the text is cut (a cut first could leave half a
    password that no longer looks like one)."""
    line = mask(f"{type(exc).__name__}: {exc}", secrets=secrets)[:2000]
    if exc is None or exc.__traceback__ is None:
        return line
    # From the kind's first frame: the service's own frames that drove it tell the author
    # nothing (all of them, when the error never reached kind code).
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).parent == _HERE:
        tb = tb.tb_next
    trace = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    return stored_error(line, mask(trace, secrets=secrets))


_HERE = Path(__file__).parent


def refused(what: str) -> Fenced:
    return Fenced(f"{what} refused: another copy holds a newer epoch")


def _chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, each once."""
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 32:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


class LaunchHost(Protocol):
    """What starting copies needs of the service around them."""

    outputs: OutputPublisher

    def add_runner(self, runner: Runner) -> None: ...

    def cancel(self, observer_id: uuid.UUID) -> None: ...


class Launcher:
    """Start, run and commit of the copies a service took: a taken observer becomes a
    ``Runner`` whose task runs its kind's code under its restart budget (``run_observer``),
    its commits written fenced (``_save``), until the service stops it."""

    def __init__(
        self,
        host: LaunchHost,
        *,
        me: uuid.UUID,
        name: str,
        kinds: dict[str, KindSpec],
        store: Store,
        lease: LeaseKeeper,
        metrics: ServiceMetrics,
        stalls: StallWatch,
        witness: Witness | None = None,
    ) -> None:
        self.host = host
        self.me = me
        self.name = name
        self.kinds = kinds
        self.store = store
        self.lease = lease
        self.metrics = metrics
        self.stalls = stalls
        self.witness = witness

    def start(self, taken: Taken, origin: Origin, *, cancelled: bool = False) -> Runner | str:
        """Run a taken observer here: its copy's task is started and the host holds it. Or
        why it cannot run here (its kind is not installed, its params or restart policy are
        invalid): the caller fails the observer."""
        spec = self.kinds.get(taken.kind)
        params: Any = taken.params
        error: str | None = None
        policy: RestartPolicy | None = None
        # What no error or log line about it may show (the manager's read views mask so too).
        secrets = secret_values(taken.params, spec)
        if spec is None:
            error = f"kind {taken.kind!r} is not installed on service {self.name}"
        else:
            try:
                policy = spec.policy(taken.restart_policy)
                if spec.params_model is not None:
                    params = spec.params_model.model_validate(taken.params)
                    # The copy keeps its params as the model alone, not also as the row's
                    # JSON (a dict and its keys, 450 bytes a running observer).
                    taken = replace(taken, params={})
            except ValidationError as exc:
                error = mask(f"invalid params or restart policy: {exc}", secrets=secrets)
        if spec is None or policy is None or error is not None:
            return error or "unrunnable"
        copy = taken.copy
        # From the take to the first checkpoint written (a child of the take's span).
        first = tracing.begin(
            "start",
            attributes=lambda: {
                "orch.observer_id": str(taken.observer_id),
                "orch.kind": taken.kind,
                "orch.epoch": taken.epoch,
            },
        )
        outputs = CopyOutputs(
            observer_id=taken.observer_id,
            epoch=taken.epoch,
            kind=taken.kind,
            name=taken.name,
            last_seq=taken.output_seq,
            write=lambda item: self._save(item, first),
            commit_every=spec.commit_every,
            to_json=checkpoint_json,
            budget=self.host.outputs.budget,
        )
        ctx = ObserverContext(
            observer_id=taken.observer_id,
            name=taken.name,
            kind=taken.kind,
            epoch=taken.epoch,
            service_id=self.me,
            params=params,
            last_checkpoint=taken.checkpoint,
            save=lambda state: outputs.commit(checkpoint_json(state)),
            emit=outputs.emit,
            alive=self.lease.valid,
            logger=observer_log(
                f"observer.{taken.kind}",
                observer_id=taken.observer_id,
                name=taken.name,
                kind=taken.kind,
                epoch=taken.epoch,
                secrets=secrets,
            ),
            witness=self._effects(taken),
        )
        runner = Runner(
            taken=taken, spec=spec, ctx=ctx, origin=origin, witness=self.witness, outputs=outputs
        )

        async def record_error(error: str) -> ErrorRecord:
            return await self._record_error(copy, taken.kind, error, policy)

        timing = Timing(
            self.stalls,
            f"observer {taken.observer_id} ({taken.kind}, epoch {taken.epoch})",
            lambda seconds: self._stalled(runner, seconds),
            taken.observer_id,
            taken.epoch,
            self.witness,
        )
        runner.task = asyncio.create_task(
            self._run(
                runner,
                first,
                # Made in the task: a task cancelled before its first step (a drain just
                # after a take) would otherwise drop a coroutine never awaited.
                functools.partial(
                    run_observer,
                    spec,
                    ctx,
                    policy,
                    gate=runner.gate(self.lease.gate),
                    record_error=record_error,
                    timing=timing,
                    secrets=secrets,
                    outputs=outputs,
                    progress_timeout=policy.progress_timeout,
                ),
            ),
            name=f"observer-{taken.observer_id}",
        )
        if (witness := self.witness) is not None:
            runner.task.add_done_callback(
                lambda _: witness.end(taken.observer_id, taken.epoch, outputs.stop_waited)
            )
        self.host.outputs.register(outputs)
        self.host.add_runner(runner)
        self.metrics.takes.inc()
        if cancelled:
            self.host.cancel(taken.observer_id)
        ctx.logger.info("running (epoch %d)", taken.epoch)
        return runner

    async def _run(
        self, runner: Runner, first: tracing.Open, run: Callable[[], Coroutine[Any, Any, str]]
    ) -> str:
        """The copy's task: its kind's code and, for a kind with ``commit_every``, the commits
        of what it emits, made on their own; the last of them before the task ends, so that
        the copy's release comes after it."""
        try:
            return await self._run_code(runner, run)
        finally:
            first.end(
                attributes={"orch.checkpointed": False}
            )  # stopped before its first checkpoint

    async def _run_code(self, runner: Runner, run: Callable[[], Coroutine[Any, Any, str]]) -> str:
        outputs = runner.outputs
        if outputs is None or outputs.commit_every is None:
            return await run()
        committer = asyncio.create_task(
            self._commit_on_its_own(runner, outputs), name=f"commits-{runner.observer_id}"
        )
        try:
            return await run()
        finally:
            committer.cancel()
            await asyncio.wait([committer])
            if not committer.cancelled() and (exc := committer.exception()) is not None:
                raise exc

    async def _commit_on_its_own(self, runner: Runner, outputs: CopyOutputs) -> None:
        try:
            await outputs.commit_on_its_own(self.lease.valid)
        except Fenced:  # another copy holds a newer epoch: this one's code never runs again
            runner.stop(StopReason.SUPERSEDED)
        except LeaseLost:  # the lease keeper stops every copy
            pass

    def _effects(self, taken: Taken) -> Callable[[str], None] | None:
        """What ``ctx.witness`` does: record the side effect (verify mode only)."""
        witness = self.witness
        if witness is None:
            return None
        return lambda event: witness.effect(taken.observer_id, taken.epoch, event)

    def _stalled(self, runner: Runner, seconds: float) -> None:
        """A step of this copy blocked the loop: it ends as its own error (counted against its
        budget). One that cost this service its lease is blamed: settling fails it at once,
        needing no lease, before anything could release it to another service."""
        ctx = runner.ctx
        self.metrics.stalls.labels(ctx.kind).inc()
        reason = f"blocked the event loop for {seconds:.1f}s"
        ctx.logger.error("%s", reason)
        if self.stalls.blamed(seconds, lease_valid=self.lease.valid()):
            runner.blame = reason

    async def _save(self, item: Checkpoint, first: tracing.Open) -> None:
        """A commit (a checkpoint, records): fenced, batched, retried while the lease holds
        (also alone, when the batch skipped its row as locked: that is no fence). The first
        one ends the copy's ``start`` span."""
        commits = self.host.outputs.commits

        async def write() -> bool:
            return landed(await commits.submit(item))

        if not await while_leased(write, self.lease.valid):
            self.metrics.fenced.labels("checkpoint").inc()
            raise refused("checkpoint")
        first.end(attributes={"orch.checkpointed": True})

    async def _record_error(
        self, copy: Copy, kind: str, error: str, policy: RestartPolicy
    ) -> ErrorRecord:
        record = await while_leased(
            lambda: self.store.record_error(copy, error, policy), self.lease.valid
        )
        if record is None:
            self.metrics.fenced.labels("restart_record").inc()
            raise refused("restart record")
        (self.metrics.failed if record.failed else self.metrics.restarts).labels(kind).inc()
        if error.startswith(f"{NoProgress.__name__}:"):
            self.metrics.no_progress.labels(kind).inc()
        return record
