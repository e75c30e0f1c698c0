"""Until when a lease is surely ours: the one deadline the service lease and the manager leader
both keep.

A renewal *sent* at ``sent`` makes the lease valid locally until ``sent + ttl - margin``. The
database sets the expiry others see from its own clock at commit, which is later than ``sent``,
so the local deadline always falls at least ``margin`` before it. The deadline is measured on
``Clock.now()``, which counts suspended time: a machine that slept past its lease wakes up with
the lease gone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orch_contracts.clock import Clock


@dataclass(frozen=True)
class LeaseTimings:
    """Seconds. ``renew_interval + margin < ttl``, checked by the settings."""

    ttl: float
    renew_interval: float
    margin: float

    @property
    def stale_after(self) -> float:
        """A lease not confirmed for this long may have been lost during a pause of this
        process: work waits for the next renewal before it goes on."""
        return self.renew_interval + self.margin


class LeaseDeadline:
    def __init__(self, clock: Clock, timings: LeaseTimings) -> None:
        self.clock = clock
        self.timings = timings
        self.until = -math.inf
        #: When the last successful renewal was sent.
        self.confirmed = -math.inf

    def renewed(self, sent: float) -> None:
        self.until = sent + self.timings.ttl - self.timings.margin
        self.confirmed = sent

    def expire(self) -> None:
        self.until = self.confirmed = -math.inf

    def valid(self) -> bool:
        return self.clock.now() < self.until

    def remaining(self) -> float:
        return self.until - self.clock.now()

    def stale(self) -> bool:
        return self.clock.now() - self.confirmed > self.timings.stale_after
