"""The watchdog thread beside a blocked event loop: it marks the service stalled once a step
passes ``MARK_AFTER``, once per step, and never for a short one, nor for one that was long only
because its thread waited for a CPU."""

from __future__ import annotations

import time
import uuid

import pytest

from observer_service.stalls import MARK_AFTER, WATCH_EVERY, RunQueue, StallWatch, Step


class _Writes:
    def __init__(self) -> None:
        self.marks = 0
        self.blamed: list[uuid.UUID] = []

    def blame(self, observer_id: uuid.UUID, reason: str) -> None:
        self.blamed.append(observer_id)

    def mark_stalled(self) -> None:
        self.marks += 1


def _until(check: object, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_long_step_marks_the_service_stalled_once() -> None:
    writes = _Writes()
    watch = StallWatch(10.0, writes=writes)
    watch.start()
    try:
        watch.step = Step("long", time.monotonic(), uuid.uuid4())  # the loop is blocked now
        _until(lambda: writes.marks == 1)
        time.sleep(4 * WATCH_EVERY)  # the watchdog looks again meanwhile
        assert writes.marks == 1, "one mark per step"
        assert writes.blamed == [], "a stall within the lease is not blamed"
    finally:
        watch.step = None
        watch.stop()


def test_a_short_step_marks_nothing() -> None:
    writes = _Writes()
    watch = StallWatch(10.0, writes=writes)
    watch.start()
    try:
        for _ in range(20):
            watch.step = Step("short", time.monotonic(), uuid.uuid4())
            time.sleep(MARK_AFTER / 10)
            watch.step = None
            time.sleep(WATCH_EVERY / 5)
        assert writes.marks == 0
    finally:
        watch.stop()


class _RunQueue(RunQueue):
    """The loop thread's run-queue wait as the test scripts it (the kernel's figure is a
    counter of seconds spent runnable but not running)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.wait = 0.0

    def waited(self) -> float | None:
        return self.wait


def test_the_time_a_step_waited_for_a_cpu_is_not_the_kinds() -> None:
    run_queue = _RunQueue()
    watch = StallWatch(10.0, run_queue=run_queue)
    step = Step("starved", started=100.0)
    step.waited = 0.0  # first seen at once
    run_queue.wait = 0.45  # of 0.5 s on the wall clock, 0.45 s waiting for a CPU
    assert watch.kind_time(step, 100.5) == pytest.approx(0.05)
    run_queue.wait = 0.0  # never runnable and waiting: all its own (a blocking call, a loop)
    assert watch.kind_time(step, 100.5) == pytest.approx(0.5)


def test_a_wait_that_may_predate_the_step_is_not_taken_off_it() -> None:
    run_queue = _RunQueue()
    watch = StallWatch(10.0, run_queue=run_queue)
    # The watchdog read 1.0 s of wait 0.1 s before the step began, and never saw the step:
    # of the 0.4 s waited since, up to 0.1 s may be from before it.
    step = Step("unseen", started=100.0, before=(99.9, 1.0))
    run_queue.wait = 1.4
    assert watch.kind_time(step, 100.5) == pytest.approx(0.5 - 0.3)
    # Without a reading of the kernel's, the wall clock is all.
    assert StallWatch(10.0).kind_time(step, 100.5) == pytest.approx(0.5)


def test_a_starved_step_marks_nothing_a_blocking_one_does() -> None:
    run_queue = _RunQueue()
    writes = _Writes()
    watch = StallWatch(10.0, writes=writes, run_queue=run_queue)
    watch.start()
    try:
        step = Step("starved", time.monotonic(), uuid.uuid4())
        watch.step = step
        _until(lambda: step.waited is not None)
        began = time.monotonic()
        while time.monotonic() - began < 3 * MARK_AFTER:  # the wait grows with the wall clock
            run_queue.wait = time.monotonic() - began
            time.sleep(0.005)
        assert writes.marks == 0
        # The wait stops growing (the thread is not waiting for a CPU): a blocked loop.
        _until(lambda: writes.marks == 1)
    finally:
        watch.step = None
        watch.stop()
