"""Kind code never resumes on a lease that may be gone.

A copy frozen between ``ctx.ensure_alive()`` and its side effect, while it awaits something (a
pool, a connect, a DNS lookup), would otherwise wake up and perform that side effect although
others took the observer meanwhile. ``guarded`` drives the kind's coroutine itself and checks the
lease before every resumption:

- lease not confirmed for a while (this process may have been paused, its lease session may
  have ended): the kind waits until a renewal proves nothing was taken, then goes on;
- lease lost, or this copy taken by another service: the copy is *abandoned*. From that moment
  another copy may run, so this one's code never runs again, not even its ``except`` and
  ``finally`` blocks: nothing is thrown into it, and its coroutine is kept, never closed (a
  close would run them), until the process exits without collecting it. ``LeaseLost`` ends its
  task. What the kind registered with ``ctx.on_abandon`` (a socket to abort) is released
  then. A stop asked while the lease holds (a delete, a drain, a graceful stop) is thrown in
  as a cancellation, and the kind's cleanup runs, each of its steps gated in turn.

Each step of kind code is timed too: one that blocked the event loop past the threshold ends
the copy with ``LoopBlocked`` (``stalls.py``).

What this cannot cover: synchronous code between the last check and the side effect, and tasks
or threads that a kind starts itself (they are not driven through here).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from observer_service.stalls import MARK_AFTER, LoopBlocked, StallWatch, Step
from orch_contracts.errors import LeaseLost
from orch_contracts.witness import STALL, Witness

T = TypeVar("T")

#: Before kind code resumes: None to go on, a future to wait for first (then ask again), or
#: raise LeaseLost (the copy is abandoned).
Gate = Callable[[], "asyncio.Future[None] | None"]

#: Coroutines of abandoned copies: referenced so that the garbage collector never closes them
#: (closing runs their ``finally`` blocks). The process exits without collecting them.
_abandoned: set[Coroutine[Any, Any, Any]] = set()


def abandoned() -> int:
    """How many copies of this process were abandoned (their coroutines are still held)."""
    return len(_abandoned)


@dataclass(frozen=True)
class Timing:
    """How the guard times one copy's steps: ``watch`` marks them for the watchdog,
    ``stalled(seconds)`` is told of a step past its threshold before the copy ends."""

    watch: StallWatch
    label: str
    stalled: Callable[[float], None]
    observer_id: uuid.UUID | None = None
    epoch: int = 0
    #: Verify mode: each resumption and each long step is recorded.
    witness: Witness | None = None


class _Guarded:
    def __init__(
        self,
        coro: Coroutine[Any, Any, Any],
        gate: Gate,
        timing: Timing | None,
        on_abandon: Callable[[], None] | None,
    ) -> None:
        self._coro = coro
        self._gate = gate
        self._timing = timing
        self._on_abandon = on_abandon

    def _step(self, value: Any, error: BaseException | None) -> Any:
        """One step of kind code: timed and marked when a watch is set. A step past the
        threshold ends the copy with LoopBlocked, unless it ended otherwise already (it
        returned, or was stopped: a stop is never turned into an error)."""
        coro, timing = self._coro, self._timing
        if timing is None:
            return coro.send(value) if error is None else coro.throw(error)
        if timing.witness is not None and timing.observer_id is not None:
            # Every step passed the gate: a cancellation thrown in runs the kind's cleanup.
            timing.witness.ran(timing.observer_id, timing.epoch)
        step = timing.watch.step = Step(timing.label, time.monotonic(), timing.observer_id)
        try:
            result = coro.send(value) if error is None else coro.throw(error)
        except Exception as exc:
            took = self._took(step)
            if took and not isinstance(exc, StopIteration):
                raise LoopBlocked(f"blocked the event loop for {took:.1f}s") from exc
            raise
        except BaseException:
            self._took(step)
            raise
        if took := self._took(step):
            if self._may_resume():
                with contextlib.suppress(BaseException):
                    coro.close()  # its finally blocks run now; it never resumes
            else:
                self._abandon()
            raise LoopBlocked(f"blocked the event loop for {took:.1f}s")
        return result

    def _may_resume(self) -> bool:
        """The lease is surely ours right now (no wait, no loss)."""
        try:
            return self._gate() is None
        except LeaseLost:
            return False

    def _abandon(self) -> None:
        _abandoned.add(self._coro)
        if self._on_abandon is not None:
            self._on_abandon()

    def _took(self, step: Step) -> float:
        """The step's length if it was a stall (told to ``stalled``), else 0."""
        timing = self._timing
        assert timing is not None
        watch = timing.watch
        ended = time.monotonic()
        took = ended - step.started
        watch.step = None
        if took > MARK_AFTER:  # rare: only then is the scheduler asked how long it made it wait
            took = watch.kind_time(step, ended)
        if took > MARK_AFTER and not watch.process_paused(step.started):
            watch.long_step(ended)
        witness = timing.witness
        if took <= watch.threshold and (witness is None or took < STALL):
            return 0.0
        if watch.process_paused(step.started):
            return 0.0  # the whole process was stopped meanwhile: not the kind's doing
        if witness is not None and took >= STALL and timing.observer_id is not None:
            witness.stall(timing.observer_id, timing.epoch, took)
        if took <= watch.threshold:
            return 0.0
        timing.stalled(took)
        return took

    def __await__(self) -> Generator[Any, Any, Any]:
        gate = self._gate
        value: Any = None
        #: What goes in at the next resumption instead of a value (a cancellation).
        error: BaseException | None = None
        while True:
            try:  # before kind code resumes, with a value or an error: the lease first
                while (parked := gate()) is not None:
                    try:
                        yield from parked.__await__()
                    except LeaseLost:
                        raise
                    except BaseException as exc:  # cancelled while parked: in once it may go on
                        error = exc
            except LeaseLost:
                self._abandon()
                raise
            try:
                yielded = self._step(value, error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                value = yield yielded
            except BaseException as exc:  # thrown in by the task (a cancellation)
                error = exc


def guarded(
    coro: Coroutine[Any, Any, T],
    gate: Gate,
    timing: Timing | None = None,
    on_abandon: Callable[[], None] | None = None,
) -> Any:
    """Await ``coro`` with ``gate`` consulted before each of its resumptions (and each step
    timed, with ``timing``); ``on_abandon`` is told when the copy is abandoned, in its place
    (``ObserverContext.on_abandon``)."""
    return _Guarded(coro, gate, timing, on_abandon)
