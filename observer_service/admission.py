"""Admission: the state of every start between its arrival and its runner, in one object.

- ``headroom``: the process's own resources (``headroom.py``): no start is taken while its
  descriptors near their limit or after a copy ran out of them.
- ``slots``: ``worker_count`` permits. The broker's prefetch already bounds deliveries from the
  work queue; directed starts and the re-take of a copy that is still stopping count too, so a
  service never runs more than ``worker_count`` copies.
- ``admitting``: one admission per observer at a time (a second start for the same observer
  waits for the first to settle, then sees its outcome). A cancel that arrives while an
  observer is being taken is remembered here and applied when its runner starts.
- taking: the observers whose start is being admitted, but not waiting for room; each lease
  renewal reports them, and the leader's audit sends none of them anew (on a slow database
  link, a start waits seconds behind the takes before it).
- in flight: a graceful stop waits until every admitted start has become a runner or has been
  settled; ``paused()`` makes new starts wait and lets the ones in flight finish, so that a
  reconcile ("release what we hold but do not run") never interleaves with a take.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from observer_service.headroom import Headroom


@dataclass
class _Admitting:
    cancelled: bool = False
    #: Set once this admission has ended: the next start of the same observer may go.
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Slot:
    """One start's claim on a slot: taken when there is room (or when it waits for one), given
    back unless a runner keeps it."""

    slots: asyncio.Semaphore
    held: bool = False

    async def take(self, *, wait: bool) -> bool:
        """Hold a slot: at once if one is free, else only with ``wait``. Whether one is held."""
        if not self.held and (wait or not self.slots.locked()):
            await self.slots.acquire()
            self.held = True
        return self.held

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.slots.release()


class Admission:
    """Every wait here wakes only the starts it concerns: a burst of a thousand starts, each
    waiting behind an earlier start of its own observer, costs a thousand wake-ups, not a
    million (one shared condition woke every waiter on each settle)."""

    def __init__(self, worker_count: int, headroom: Headroom | None = None) -> None:
        self.worker_count = worker_count
        self.slots = asyncio.Semaphore(worker_count)
        #: The process's own resources (descriptors, memory): slots alone are not room.
        self.headroom = headroom or Headroom(time.monotonic)
        self._admitting: dict[uuid.UUID, _Admitting] = {}
        self._room_waits: dict[uuid.UUID, int] = {}
        self._paused = 0
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._admitting)

    def slot(self) -> Slot:
        return Slot(self.slots)

    def ids(self) -> set[uuid.UUID]:
        return set(self._admitting)

    def admits(self, observer_id: uuid.UUID) -> bool:
        """A start of this observer is being admitted."""
        return observer_id in self._admitting

    @contextlib.asynccontextmanager
    async def admitting(self, observer_id: uuid.UUID) -> AsyncIterator[_Admitting]:
        """Hold the admission of one observer; waits while paused or while another start of the
        same observer is being admitted."""
        while True:
            if self._paused:
                await self._resumed.wait()
                continue
            current = self._admitting.get(observer_id)
            if current is None:
                break
            await current.done.wait()
        entry = self._admitting[observer_id] = _Admitting()
        self._idle.clear()
        try:
            yield entry
        finally:
            del self._admitting[observer_id]
            entry.done.set()
            if not self._admitting:
                self._idle.set()

    @contextlib.contextmanager
    def waiting_for_room(self, observer_id: uuid.UUID) -> Iterator[None]:
        """This observer's start waits for a free slot inside: it is not being taken (the
        leader's audit may send it to a service with room)."""
        self._room_waits[observer_id] = self._room_waits.get(observer_id, 0) + 1
        try:
            yield
        finally:
            if (left := self._room_waits.pop(observer_id) - 1) > 0:
                self._room_waits[observer_id] = left

    def taking_ids(self, limit: int) -> list[uuid.UUID]:
        """Up to ``limit`` of the observers whose start is being admitted (from its arrival to
        its runner or its settling), but not waiting for room."""
        taking = (o for o in self._admitting if o not in self._room_waits)
        return list(itertools.islice(taking, limit))

    def cancel(self, observer_id: uuid.UUID) -> bool:
        """Remember a cancel for an observer being admitted; False if it is not."""
        entry = self._admitting.get(observer_id)
        if entry is None:
            return False
        entry.cancelled = True
        return True

    async def idle(self, timeout: float) -> bool:
        """Wait until nothing is being admitted; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No start is admitted inside: new ones wait, the ones in flight have finished."""
        self._paused += 1
        self._resumed.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._paused -= 1
            if not self._paused:
                self._resumed.set()
