"""The watchdog thread beside a blocked event loop: it marks the service stalled once a step
passes ``MARK_AFTER``, once per step, and never for a short one."""

from __future__ import annotations

import time
import uuid

from observer_service.stalls import MARK_AFTER, WATCH_EVERY, StallWatch, Step


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
