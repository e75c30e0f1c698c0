"""The clocks that lease deadlines are measured on.

``Clock.now()`` counts time while the machine is suspended (``CLOCK_BOOTTIME`` on Linux): a VM
or laptop that sleeps past its lease must find the lease gone when it wakes. The plain monotonic
clock stops during a suspend, so a deadline measured on it would still look valid.

A suspend cannot be produced in a test, so a clock can be given a *hook*: a file holding one
float, the seconds that ``monotonic()`` did not count (as if the machine had been suspended that
long). A test freezes a process, writes the lag, and resumes it: the monotonic clock then reads
as though no time passed, while ``now()`` is the true one.
"""

from __future__ import annotations

import mmap
import struct
import time
from pathlib import Path

_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)


class Clock:
    def __init__(self, hook: Path | None = None) -> None:
        self._hook: mmap.mmap | None = None
        if hook is not None:
            if not hook.exists() or hook.stat().st_size < 8:
                hook.write_bytes(struct.pack("d", 0.0))
            with hook.open("r+b") as f:
                self._hook = mmap.mmap(f.fileno(), 8)

    def now(self) -> float:
        """Seconds on a clock that also counts suspended time; for deadlines."""
        if _BOOTTIME is None:  # not Linux: the best there is
            return time.monotonic()
        return time.clock_gettime(_BOOTTIME)

    def monotonic(self) -> float:
        """Seconds on the monotonic clock, which stops while the machine is suspended."""
        lag = 0.0 if self._hook is None else struct.unpack_from("d", self._hook)[0]
        return time.monotonic() - lag


def set_suspend_lag(hook: Path, seconds: float) -> None:
    """Make the hooked clocks' monotonic time lag by ``seconds`` (tests)."""
    hook.write_bytes(struct.pack("d", seconds))
