"""A kind that blocks the event loop is contained.

Every step of a kind's coroutine runs through the guard (``guard.py``), which times it: a step
longer than ``ORCH_LOOP_STALL`` blocked every other copy of the service, its lease renewal and
its broker heartbeats for that long. The copy is ended with ``LoopBlocked``, an error of the
kind's own, so it counts against its restart budget; a few stalls and it is failed with the
reason. A stall longer than the lease costs the whole service its lease (every neighbour is
moved), so the copy is failed at once, with a write that needs no lease: by the watchdog thread
*during* the stall, the moment the lease's local deadline passes (before the lease expires in
the database, so the leader never hands the observer to another service to stall it too); and
again when it settles, in case that write could not be made (a cancel is then broadcast to
whoever took it meanwhile).

The watchdog thread also tells, while the loop is still blocked, which copy is running; and it
marks the service stalled in the database (``services.stalled_since``, cleared by the next
renewal) once a step passes ``MARK_AFTER``: a process whose loop is blocked cannot notice that
its lease session ended, so no taker may treat it as gone before its lease expires.

A step is timed by what the kind did with it, not by the wall clock alone. On a busy host the
loop's thread waits for a CPU in the middle of a step, and that wait is the scheduler's doing
(every process of the host waits alike), not the kind's: counted, it marks a healthy service
stalled, which turns off fast crash takeover and keeps the leader from placing work on it, and
ends healthy copies with ``LoopBlocked``. Where the kernel keeps scheduler statistics (Linux's
``/proc/self/task/<tid>/schedstat``), the time the loop's thread spent waiting on a run queue
while the watchdog watched a step is taken off that step; elsewhere the wall clock is all.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


#: How often the watchdog looks, seconds: well within the lease's margin.
WATCH_EVERY = 0.05
#: A step this long marks the service stalled, seconds: past any step of a healthy kind, and
#: short next to the sweeps a fast takeover needs (two, 0.25 s apart).
MARK_AFTER = 0.1
#: Seconds a service stays marked stalled after a long step ended (its renewals keep the mark):
#: a kind that blocked the loop once is likely to again, and the next block may begin just as
#: the service is cut off, before the watchdog's own mark could land.
REMEMBER = 60.0
#: A watchdog wake-up this late means the whole process was stopped (SIGSTOP, a paused VM),
#: not the loop blocked by kind code: the thread runs beside a blocked loop, not a stopped one.
PROCESS_PAUSE = 0.5


class LoopBlocked(Exception):
    """A copy blocked the event loop past the service's threshold."""


@dataclass
class Step:
    """The copy whose step runs now, as the guard marks it."""

    label: str
    started: float
    observer_id: uuid.UUID | None = None
    #: The loop thread's run-queue wait (seconds, ``RunQueue``) when the watchdog first saw
    #: this step; None until then, or where the kernel does not tell.
    waited: float | None = None
    #: The watchdog's last reading before the step began: (monotonic, run-queue wait).
    before: tuple[float, float] | None = None


class RunQueue:
    """How long one thread of this process has waited for a CPU while runnable, in seconds,
    from the kernel's scheduler statistics: None where they are not kept (not Linux, or a
    kernel without schedstats)."""

    def __init__(self, native_id: int) -> None:
        self._path = f"/proc/self/task/{native_id}/schedstat"

    def waited(self) -> float | None:
        try:
            fd = os.open(self._path, os.O_RDONLY)
        except OSError:
            return None
        try:
            # "<ns on a cpu> <ns waiting on a run queue> <timeslices>"
            return int(os.read(fd, 128).split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return None
        finally:
            os.close(fd)


class ThreadWrites(Protocol):
    """What the watchdog thread writes, never through the blocked loop."""

    def blame(self, observer_id: uuid.UUID, reason: str) -> object:
        """Fail the observer now."""

    def mark_stalled(self) -> object:
        """Mark this service stalled until its next renewal."""


class StallWatch:
    """``threshold``: seconds of one step that count as a stall. ``lease_valid``: whether the
    lease's local deadline is still ahead (safe to ask from the thread). ``writes`` fails a copy
    whose stall outlived the lease (``blamed``) and marks the service stalled."""

    def __init__(
        self,
        threshold: float,
        *,
        lease_valid: Callable[[], bool] = lambda: True,
        outlives_lease: float = 0.0,
        writes: ThreadWrites | None = None,
        run_queue: RunQueue | None = None,
    ) -> None:
        self.threshold = threshold
        #: The loop thread's run-queue wait; set by ``start`` (from the loop's thread).
        self.run_queue = run_queue
        #: The shortest step that can cost a healthy service its lease (renewals are due every
        #: renew_interval): a lease lost during a shorter step was lost for another reason.
        self.outlives_lease = outlives_lease
        self._lease_valid = lease_valid
        self._writes = writes
        #: Set by the guard around each step of kind code; read by the watchdog thread.
        self.step: Step | None = None
        #: When the last step longer than MARK_AFTER ended (monotonic).
        self.last_long = -math.inf
        #: The watchdog's last reading of the loop thread's run-queue wait: (monotonic, wait).
        self._reading: tuple[float, float] | None = None
        #: The watchdog's last wake-up, and when the last whole-process pause it saw ended.
        self._beat = 0.0
        self._paused_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def process_paused(self, since: float) -> bool:
        """Whether the whole process was stopped at some point since ``since`` (monotonic), so
        a long step then was not the kind's doing. False while no watchdog runs."""
        if self._thread is None:
            return False
        now = time.monotonic()
        return self._paused_until > since or now - self._beat > PROCESS_PAUSE

    def kind_time(self, step: Step, ended: float) -> float:
        """Seconds of ``step`` up to ``ended`` that were the kind's: its length less what the
        loop's thread surely spent waiting for a CPU within it. Two readings bound that wait
        from below: the wait since the watchdog first saw the step (all of it within the
        step), and the wait since the watchdog's last reading before the step began, less the
        time from that reading to the step's start (the most it can hold from before). The
        larger is taken off; a kind is never credited with a wait it may not have had."""
        took = ended - step.started
        if self.run_queue is None:
            return took
        now = self.run_queue.waited()
        if now is None:
            return took
        waited = 0.0
        if step.waited is not None:
            waited = now - step.waited
        before = step.before or self._reading
        if before is not None and before[0] <= step.started:
            waited = max(waited, now - before[1] - (step.started - before[0]))
        return took - max(0.0, waited)

    def long_step(self, ended: float) -> None:
        """The guard saw a step longer than MARK_AFTER end."""
        self.last_long = ended

    def stalled_lately(self) -> bool:
        """A step blocks the loop now, or one did within REMEMBER seconds."""
        now = time.monotonic()
        step = self.step
        return now - self.last_long < REMEMBER or (
            step is not None
            and now - step.started > MARK_AFTER
            and self.kind_time(step, now) > MARK_AFTER
        )

    def blamed(self, seconds: float, *, lease_valid: bool) -> bool:
        """A step of ``seconds`` after which the lease is gone cost the lease."""
        return not lease_valid and seconds >= max(self.threshold, self.outlives_lease)

    def start(self) -> None:
        """Watch from a thread of its own (the loop cannot watch itself while it is blocked)."""
        if self._thread is None:
            if self.run_queue is None:
                self.run_queue = RunQueue(threading.get_native_id())
            self._beat = time.monotonic()
            self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        seen: Step | None = None
        #: The lease was valid when the step was first seen: only a stall that outlived a
        #: valid lease is blamed (a lease lost for another reason is not its doing).
        valid_then = False
        told = blamed = marked = False
        self._beat = time.monotonic()
        while not self._stop.wait(WATCH_EVERY):
            now = time.monotonic()
            if now - self._beat > PROCESS_PAUSE:
                self._paused_until = now
            self._beat = now
            step = self.step
            last = self._reading
            if self.run_queue is not None:
                taken_at, wait = time.monotonic(), self.run_queue.waited()
                self._reading = None if wait is None else (taken_at, wait)
            if step is None:
                continue
            if step is not seen:
                seen, valid_then, told, blamed = step, self._lease_valid(), False, False
                marked = False
                if self._reading is not None:
                    step.waited = self._reading[1]
                if last is not None and last[0] <= step.started:
                    step.before = last
            blocked = self.kind_time(step, time.monotonic())
            if not marked and blocked > MARK_AFTER and self._writes is not None:
                marked = True
                try:
                    self._writes.mark_stalled()
                except Exception as exc:  # a write from a thread: it must not end the watch
                    log.warning("could not mark the service stalled: %r", exc)
            if not told and blocked > self.threshold:
                told = True
                log.warning("the event loop has been blocked for %.1fs by %s", blocked, step.label)
            if (
                not blamed
                and valid_then
                and self._paused_until <= step.started
                and blocked >= self.outlives_lease
                and step.observer_id is not None
                and self._writes is not None
                and not self._lease_valid()
            ):
                # One step outlived the lease, whatever the threshold: fail it before the lease
                # expires in the database, where the leader would hand it to another service.
                blamed = True
                reason = f"blocked the event loop for more than {blocked:.1f}s"
                log.error("%s, past the lease: failing %s", reason, step.label)
                try:
                    self._writes.blame(step.observer_id, reason)
                except Exception:
                    log.exception("could not fail %s from the watchdog", step.label)
