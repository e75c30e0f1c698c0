"""Admission: the state of every start between its arrival and its runner, in one object.

- ``slots``: ``worker_count`` permits. The broker's prefetch already bounds deliveries from the
  work queue; directed starts and the re-take of a copy that is still stopping count too, so a
  service never runs more than ``worker_count`` copies.
- ``admitting``: one admission per observer at a time (a second start for the same observer
  waits for the first to settle, then sees its outcome). A cancel that arrives while an
  observer is being taken is remembered here and applied when its runner starts.
- in flight: a graceful stop waits until every admitted start has become a runner or has been
  settled; ``paused()`` makes new starts wait and lets the ones in flight finish, so that a
  reconcile ("let go of what we hold but do not run") never interleaves with a take.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class _Admitting:
    cancelled: bool = False


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
    def __init__(self, worker_count: int) -> None:
        self.worker_count = worker_count
        self.slots = asyncio.Semaphore(worker_count)
        self._admitting: dict[uuid.UUID, _Admitting] = {}
        self._in_flight = 0
        self._paused = 0
        self._changed = asyncio.Condition()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def slot(self) -> Slot:
        return Slot(self.slots)

    def ids(self) -> set[uuid.UUID]:
        return set(self._admitting)

    @contextlib.asynccontextmanager
    async def admitting(self, observer_id: uuid.UUID) -> AsyncIterator[_Admitting]:
        """Hold the admission of one observer; waits while paused or while another start of the
        same observer is being admitted."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: not self._paused and observer_id not in self._admitting
            )
            entry = self._admitting[observer_id] = _Admitting()
            self._in_flight += 1
        try:
            yield entry
        finally:
            async with self._changed:
                del self._admitting[observer_id]
                self._in_flight -= 1
                self._changed.notify_all()

    def cancel(self, observer_id: uuid.UUID) -> bool:
        """Remember a cancel for an observer being admitted; False if it is not."""
        entry = self._admitting.get(observer_id)
        if entry is None:
            return False
        entry.cancelled = True
        return True

    async def idle(self, timeout: float) -> bool:
        """Wait until nothing is being admitted; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: not self._in_flight), timeout)
            except TimeoutError:
                return False
        return True

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No start is admitted inside: new ones wait, the ones in flight have finished."""
        async with self._changed:
            self._paused += 1
        try:
            async with self._changed:
                await self._changed.wait_for(lambda: not self._in_flight)
            yield
        finally:
            async with self._changed:
                self._paused -= 1
                self._changed.notify_all()
