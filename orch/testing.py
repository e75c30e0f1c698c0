"""A test kit for kind authors: run a kind in-process, without PostgreSQL, RabbitMQ or a
service, on a clock the test moves.

::

    from orch.testing import run_kind

    async def test_my_kind_counts():
        async with run_kind("ticker", {"interval": 5}) as run:
            await run.advance(10)                    # ``ctx.sleep`` waits on the test's clock
            assert run.checkpoints[-1] == {"count": 3}
            run.fence()                              # another copy took it over
            await run.advance(5)
            assert run.stopped and run.writes_after_fence == ["checkpoint"]  # refused

The kind runs exactly as a service runs it: its coroutine driven through the service's guard
(``observer_service.guard``), so a lost lease abandons it without running another line of its
code, and a stop is thrown in as a cancellation. What it checkpoints, emits (committed with each
checkpoint, as a service commits them) and logs is captured; ``fence()`` makes its next write
fail with ``Fenced``, as a newer epoch's would; ``lose_lease()`` makes the service unsure of its
lease; ``stop()`` asks it to stop and says how long it took.

With pytest, ``pytest_plugins = ["orch.testing"]`` gives the ``kind_run`` fixture (a factory:
``async with kind_run("ticker", {...}) as run``) and ``virtual_clock``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from observer_service.context import ObserverContext, checked_delay
from observer_service.guard import guarded
from observer_service.outputs import checkpoint_json
from orch_contracts.errors import Fenced, LeaseLost
from orch_contracts.kinds import KindSpec, get_kind, load_kinds
from orch_contracts.outputs import check_record


class VirtualClock:
    """Time that moves only when the test says: ``sleep`` waits until ``advance`` reaches it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    @property
    def sleeping(self) -> int:
        """How many sleeps wait on it (a kind waiting for its next turn is one)."""
        return sum(1 for *_, future in self._sleepers if not future.done())

    async def sleep(self, seconds: float) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + max(0.0, seconds), next(self._order), future))
        await future

    async def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``, waking each sleeper at its time in turn and letting the
        code it runs go as far as it can before the next one."""
        until = self.now + seconds
        while self._sleepers and self._sleepers[0][0] <= until:
            at, _, future = heapq.heappop(self._sleepers)
            self.now = max(self.now, at)
            if not future.done():
                future.set_result(None)
            await _settle()
        self.now = until
        await _settle()


async def _settle() -> None:
    """Let every ready task run until none is (a few loop turns)."""
    for _ in range(20):
        await asyncio.sleep(0)


def _seen(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class _Context(ObserverContext):
    """The kind's context, its sleep on the test's clock."""

    clock: VirtualClock

    async def sleep(self, seconds: float) -> None:
        await self.clock.sleep(checked_delay(seconds))
        self.ensure_alive()


@dataclass
class KindRun:
    """One copy of a kind, run in this process (``run_kind``)."""

    spec: KindSpec
    params: dict[str, Any]
    clock: VirtualClock
    epoch: int = 1
    observer_id: uuid.UUID = field(default_factory=uuid.uuid4)
    #: Every state checkpointed, in order.
    checkpoints: list[Any] = field(default_factory=list)
    #: Every record emitted and committed (with a checkpoint, or on its own), in order.
    outputs: list[Any] = field(default_factory=list)
    #: Records emitted since the last checkpoint (lost if the copy ends before the next); a
    #: kind with ``commit_every`` commits its records on their own: at once, here.
    staged: list[Any] = field(default_factory=list)
    #: What it tried to write (``checkpoint`` or ``emit``) once fenced: should stay empty.
    writes_after_fence: list[str] = field(default_factory=list)
    fenced: bool = False
    lease: bool = True
    task: asyncio.Task[Any] | None = None
    ctx: _Context | None = None
    _logs: _Captured = field(default_factory=_Captured)

    @property
    def logs(self) -> list[str]:
        """The lines its ``ctx.logger`` wrote."""
        return [r.getMessage() for r in self._logs.records]

    @property
    def stopped(self) -> bool:
        return self.task is not None and self.task.done()

    @property
    def error(self) -> BaseException | None:
        """Why it ended: ``Fenced``, ``LeaseLost``, its own exception; None while it runs or
        when it was stopped."""
        if self.task is None or not self.task.done() or self.task.cancelled():
            return None
        return self.task.exception()

    def start(self, checkpoint: Any = None) -> None:
        model = self.spec.params_model
        params = model.model_validate(self.params) if model is not None else self.params
        logger = logging.getLogger(f"orch.testing.{self.spec.name}.{self.observer_id}")
        logger.addHandler(self._logs)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        ctx = _Context(
            observer_id=self.observer_id,
            name=f"test-{self.spec.name}",
            kind=self.spec.name,
            epoch=self.epoch,
            service_id=uuid.UUID(int=0),
            params=params,
            last_checkpoint=checkpoint,
            save=self._save,
            alive=lambda: self.lease,
            logger=logging.LoggerAdapter(logger, {}),
            emit=self._emit,
        )
        ctx.clock = self.clock
        self.ctx = ctx

        def gate() -> None:
            if not self.lease:
                raise LeaseLost("the test took the lease away")

        # As a service runs it: what it registered with ``ctx.on_abandon`` is released when the
        # guard abandons it.
        self.task = asyncio.create_task(
            self._run(guarded(self.spec.run(ctx), gate, None, ctx.abandoned))
        )
        # How it ended is the test's to read (``error``): asyncio is told it was seen, so a
        # copy fenced or cut off as the test meant is no "Task exception was never retrieved".
        self.task.add_done_callback(_seen)

    async def _run(self, copy: Any) -> None:
        await copy

    async def _save(self, state: Any) -> None:
        if self.fenced:
            self.writes_after_fence.append("checkpoint")
            raise Fenced("checkpoint refused: another copy holds a newer epoch")
        self.checkpoints.append(state)
        self.outputs.extend(self.staged)
        self.staged.clear()

    async def _emit(self, record: Any) -> None:
        if self.fenced:
            self.writes_after_fence.append("emit")
            raise Fenced("emit refused: another copy holds a newer epoch")
        check_record(checkpoint_json(record))  # the service's limit: RecordTooLarge
        if self.spec.commit_every is not None:
            self.outputs.append(record)  # committed on their own (at once here)
        else:
            self.staged.append(record)

    async def advance(self, seconds: float) -> None:
        """Move the clock on (``VirtualClock.advance``)."""
        await self.clock.advance(seconds)

    async def until(self, check: Callable[[], object], timeout: float = 5.0) -> None:
        """Wait, in real time, until ``check()`` is true: for a kind that waits on real I/O (a
        local server the test runs) rather than on the clock. ``TimeoutError`` after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not true within {timeout:g} s")
            await asyncio.sleep(0.005)

    def fence(self) -> None:
        """Another copy took the observer over (a newer epoch): its next write is refused."""
        self.fenced = True

    async def lose_lease(self) -> None:
        """Its service can no longer be sure of its lease: the guard abandons the copy at its
        next resumption (no line of its code runs again), and ``ensure_alive`` raises."""
        self.lease = False
        await _settle()

    async def stop(self, timeout: float = 5.0) -> float:
        """Ask it to stop, as a delete or a drain does (``ctx.stopping`` set, the task
        cancelled), and wait up to ``timeout`` seconds of real time; the seconds it took.
        ``TimeoutError`` when it did not stop: a service would have given up on it."""
        assert self.task is not None
        assert self.ctx is not None
        began = time.monotonic()
        self.ctx.stopping.set()
        self.task.cancel()
        done, _ = await asyncio.wait({self.task}, timeout=timeout)
        if not done:
            raise TimeoutError(f"{self.spec.name} did not stop within {timeout:g} s of asking")
        return time.monotonic() - began


@contextlib.asynccontextmanager
async def run_kind(
    kind: str | KindSpec,
    params: dict[str, Any] | None = None,
    *,
    checkpoint: Any = None,
    epoch: int = 1,
    clock: VirtualClock | None = None,
    modules: tuple[str, ...] = (),
) -> AsyncIterator[KindRun]:
    """Run ``kind`` (a name of the installed kinds, those of ``modules`` too, or a spec) with
    ``params`` (checked as a create checks them), resuming from ``checkpoint``. On exit, a copy
    still running is stopped."""
    spec = kind if isinstance(kind, KindSpec) else get_kind(load_kinds(modules), kind)
    checked = spec.validate_params(dict(params or {}))
    run = KindRun(spec, checked, clock or VirtualClock(), epoch)
    run.start(checkpoint)
    await _settle()
    try:
        yield run
    finally:
        if run.task is not None and not run.task.done():
            run.task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(run.task), 5)


# --------------------------------------------------------------------------- pytest fixtures
try:
    import pytest
except ImportError:  # the kit without pytest: run_kind alone
    pass
else:

    @pytest.fixture
    def virtual_clock() -> VirtualClock:
        """A clock the test moves (``await virtual_clock.advance(5)``)."""
        return VirtualClock()

    @pytest.fixture
    def kind_run(
        virtual_clock: VirtualClock,
    ) -> Callable[..., contextlib.AbstractAsyncContextManager[KindRun]]:
        """``async with kind_run("ticker", {"interval": 1}) as run``: ``run_kind`` on the
        test's ``virtual_clock``."""

        def start(
            kind: str | KindSpec, params: dict[str, Any] | None = None, **kw: Any
        ) -> contextlib.AbstractAsyncContextManager[KindRun]:
            return run_kind(kind, params, clock=virtual_clock, **kw)

        return start
