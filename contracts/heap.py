"""The garbage collector of a long-running orchestrator process.

A service holds every observer it runs as long-lived objects (a task, its coroutine frames, its
context): tens of thousands of them. With CPython's default thresholds (a young collection
every 700 allocations) the collector keeps walking the young objects of a busy process, and the
full collections walk the whole heap: at bulk intake that was about 40 % of a service's CPU per
observer taken. ``settle`` runs once a process is set up:

- what exists by then (modules, settings, kinds) is moved out of the collector's sight for good
  (``gc.freeze``);
- young collections come every 50,000 allocations, so that a burst of requests allocates and
  frees most of its objects between two of them; the older generations follow at the default
  ratios of the new pace.

Only objects in reference cycles wait for the collector; the rest are freed at once, as ever.
"""

from __future__ import annotations

import gc

#: Allocations between two young collections (CPython's default: 700).
YOUNG = 50_000
#: Young collections per middle one, middle per full one (CPython: 10, 10).
MIDDLE, FULL = 20, 20


def settle() -> None:
    """Freeze what the process has built so far and collect at the orchestrator's pace."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG, MIDDLE, FULL)
