"""The clocks that lease deadlines are measured on.

``Clock.now()`` trusts no single local clock. It advances by the most any of four clocks
advanced since it was last read: ``CLOCK_BOOTTIME`` (counts time while the machine is
suspended: a VM or laptop that sleeps past its lease must find the lease gone when it wakes),
the monotonic clock (which stops during a suspend), the wall clock (which a hypervisor steps
forward after it stunned a guest) and the kernel's tick count since boot (``times(2)``, read by
another path than ``clock_gettime``: a process whose clocks were stepped back, by a faulty
hypervisor or by ``libfaketime``, still sees its time pass). A clock stepped back counts as not
advancing; one stepped forward ends the lease early (a move, never a second copy). A pause
that stops every local clock (a live migration, a stun with the clocks frozen) is seen by none
of them: the lease renewal compares the database's clock with ours
(``observer_service/lease.py``).

A suspend cannot be produced in a test, so a clock can be given a *hook*: a file holding one
float, the seconds that ``monotonic()`` did not count (as if the machine had been suspended that
long). A test freezes a process, writes the lag, and resumes it: the monotonic clock then reads
as though no time passed, while ``now()`` is the true one.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


def _readings() -> tuple[float, ...]:
    boot = time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()
    return (boot, time.monotonic(), time.time(), os.times().elapsed)


class Clock:
    def __init__(
        self, hook: Path | None = None, *, read: Callable[[], tuple[float, ...]] = _readings
    ) -> None:
        self._hook: mmap.mmap | None = None
        if hook is not None:
            if not hook.exists() or hook.stat().st_size < 8:
                hook.write_bytes(struct.pack("d", 0.0))
            with hook.open("r+b") as f:
                self._hook = mmap.mmap(f.fileno(), 8)
        self._read = read
        self._lock = threading.Lock()  # read from the stall watch's thread too
        self._last = read()
        self._now = self._last[0]

    def now(self) -> float:
        """Seconds on the most pessimistic of the local clocks (see the module's docstring);
        never goes back. For deadlines."""
        with self._lock:
            readings = self._read()
            step = max(b - a for a, b in zip(self._last, readings, strict=True))
            self._last = readings
            self._now += max(0.0, step)
            return self._now

    def monotonic(self) -> float:
        """Seconds on the monotonic clock, which stops while the machine is suspended."""
        lag = 0.0 if self._hook is None else struct.unpack_from("d", self._hook)[0]
        return time.monotonic() - lag


def set_suspend_lag(hook: Path, seconds: float) -> None:
    """Make the hooked clocks' monotonic time lag by ``seconds`` (tests)."""
    hook.write_bytes(struct.pack("d", seconds))


def process_age() -> float | None:
    """Seconds since this process started (its start time as the kernel recorded it, so the
    interpreter's own start and the imports count); None where that cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
