"""The process's own resources: file descriptors and memory are the service's, not a kind's.

A kind that meets ``EMFILE`` (too many open files), ``ENFILE``, ``ENOMEM`` or ``ENOBUFS``, or a
``MemoryError``, has met the limits of the process that runs it, not a fault of its own: the
copy is stopped and its observer goes to another service (``runner.ResourceShort``). That move
spends one restart of its budget: a kind that exhausts every process it runs in (one that leaks
descriptors) fails in the end instead of moving for ever, evicting its neighbours. Meanwhile
this service takes no new start: not for ``COOLDOWN`` seconds after such an error, nor while
its open descriptors come within a reserve of its limit (``RLIMIT_NOFILE``). Counted slots
alone kept taking up to ``worker_count`` on a service capped at 128 descriptors, whose other
observers then failed for it.
"""

from __future__ import annotations

import errno
import os
import resource
from collections.abc import Callable

#: The errors of a process out of its own resources.
ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: Seconds after a resource error during which no new start is taken here.
COOLDOWN = 10.0
#: Seconds between two counts of the open descriptors.
SAMPLE_EVERY = 0.5
_FDS = "/proc/self/fd"


def resource_error(exc: BaseException) -> bool:
    """Whether ``exc``, or what caused it (a client library wraps the ``OSError``), is the
    process's own resources running out."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen or len(seen) > 32:
            continue
        seen.add(id(e))
        if isinstance(e, MemoryError):
            return True
        if isinstance(e, OSError) and e.errno in ERRNOS:
            return True
        todo += [e.__cause__, e.__context__]
    return False


def open_descriptors() -> int | None:
    """How many file descriptors this process has open (None where it cannot tell)."""
    try:
        return len(os.listdir(_FDS))
    except OSError:
        return None


def descriptor_limit() -> int:
    """The soft limit on open descriptors (``RLIMIT_NOFILE``); large when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 30


class Headroom:
    """Whether this process has room for one more copy. ``now`` is a monotonic clock."""

    def __init__(
        self,
        now: Callable[[], float],
        *,
        count: Callable[[], int | None] = open_descriptors,
        limit: Callable[[], int] = descriptor_limit,
    ) -> None:
        self._now = now
        self._count = count
        self._limit = limit
        self._short_until = float("-inf")
        self._sampled_at = float("-inf")
        self._fds_ok = True
        self._told_at = float("-inf")

    def exhausted(self) -> None:
        """A copy met a resource error: take nothing new for a while."""
        self._short_until = self._now() + COOLDOWN

    def ok(self) -> bool:
        now = self._now()
        if now < self._short_until:
            return False
        if now - self._sampled_at >= SAMPLE_EVERY:
            self._sampled_at = now
            used, limit = self._count(), self._limit()
            # Room for the service itself: its pool may grow, its broker session reconnect.
            self._fds_ok = used is None or used < limit - max(32, limit // 20)
        return self._fds_ok

    def why(self) -> str:
        if self._now() < self._short_until:
            return "a copy ran out of this process's resources lately"
        return "its open file descriptors are near its limit (RLIMIT_NOFILE)"

    def tell(self) -> bool:
        """Whether to log that starts are turned away now (once every ``COOLDOWN`` at most)."""
        now = self._now()
        if now - self._told_at < COOLDOWN:
            return False
        self._told_at = now
        return True


class Usage:
    """This process's resident memory and its share of one core between two readings: what
    each lease renewal reports (``GET /services``, the console)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._at = clock()
        self._cpu = _cpu_seconds()

    def read(self) -> tuple[int | None, float]:
        """Resident bytes (None where ``/proc`` is absent) and the share of one core since the
        last reading."""
        now, cpu = self._clock(), _cpu_seconds()
        share = (cpu - self._cpu) / (now - self._at) if now > self._at else 0.0
        self._at, self._cpu = now, cpu
        return _resident(), round(share, 3)


def _cpu_seconds() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def _resident() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None
