"""``orch_contracts.clock.Clock.now()``: the most pessimistic of the local clocks, never going
back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orch_contracts.clock import Clock


class Readings:
    """Boot time, monotonic, wall clock and tick count, set by hand."""

    def __init__(self) -> None:
        self.values = [100.0, 50.0, 1_000_000.0, 90.0]

    def advance(self, boot: float, mono: float, wall: float, ticks: float = 0.0) -> None:
        steps = (boot, mono, wall, ticks)
        self.values = [v + d for v, d in zip(self.values, steps, strict=True)]

    def __call__(self) -> tuple[float, ...]:
        return tuple(self.values)


def test_now_advances_by_the_clock_that_advanced_most_and_never_goes_back() -> None:
    r = Readings()
    clock = Clock(read=r)
    start = clock.now()
    r.advance(1.0, 1.0, 1.0)
    assert clock.now() == pytest.approx(start + 1.0)
    r.advance(0.0, -30.0, 0.0)  # the monotonic clock stepped back: it counts as still
    assert clock.now() == pytest.approx(start + 1.0)
    r.advance(1.0, 1.0, 1.0)  # and goes on from where it stepped to
    assert clock.now() == pytest.approx(start + 2.0)
    r.advance(0.5, 0.5, -3600.0)  # the wall clock stepped back an hour
    assert clock.now() == pytest.approx(start + 2.5)


def test_a_pause_any_one_clock_saw_counts() -> None:
    """A suspend (only boot time counts it) or a stun the hypervisor made up for by stepping
    the wall clock (monotonic and boot time frozen with the guest): the lease is gone."""
    r = Readings()
    clock = Clock(read=r)
    start = clock.now()
    r.advance(8.0, 0.0, 0.0)
    assert clock.now() == pytest.approx(start + 8.0)
    r.advance(0.0, 0.0, 8.0)
    assert clock.now() == pytest.approx(start + 16.0)
    r.advance(0.0, 0.0, 0.0)  # every clock frozen: nothing local can tell (the renewal can)
    assert clock.now() == pytest.approx(start + 16.0)


def test_clocks_all_stepped_back_still_see_time_pass_in_the_tick_count() -> None:
    r = Readings()
    clock = Clock(read=r)
    start = clock.now()
    r.advance(-30.0, -30.0, -30.0, 2.0)
    assert clock.now() == pytest.approx(start + 2.0)


def test_a_process_knows_its_age_from_the_kernels_start_time() -> None:
    """What the service's "up in" line counts from: the interpreter's start and imports too."""
    started = subprocess.run(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(0.3); "
            "from orch_contracts.clock import process_age; print(process_age())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert 0.3 <= float(started.stdout) < 30
