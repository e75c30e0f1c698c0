"""Which running copies hold a live work-queue delivery, as the database must know it.

When a service is proven gone, the leader leaves the observers whose copies came by the work
queue to the broker, which requeued their deliveries as the connection closed
(``observers.queued_epoch``). A copy loses its delivery with its broker session, though: the
broker requeues it and another service may drop it as a duplicate, or it is gone for good with
a deleted work queue. Then nothing is left to requeue, and the leader must not wait for it. So
the holder writes what it knows: a session's end unmarks its copies, an adopted redelivery marks
its copy again. Marks are written in order, the newest for a copy winning, by one task.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping

from observer_service.ports import Copy
from orch_contracts.backoff import Backoff
from orch_contracts.errors import Transient

log = logging.getLogger(__name__)

#: Writes marks; returns the observers whose row was locked then (written again).
Write = Callable[[Mapping[Copy, bool]], Awaitable[set[uuid.UUID]]]


class QueuedMarks:
    def __init__(self, write: Write) -> None:
        self._write = write
        self._pending: dict[Copy, bool] = {}
        self._ready = asyncio.Event()

    def lost(self, copies: Iterable[Copy]) -> None:
        """These copies' deliveries ended with their broker session."""
        for copy in copies:
            self._mark(copy, False)

    def adopted(self, copy: Copy) -> None:
        """This copy holds a redelivery of its start again."""
        self._mark(copy, True)

    def _mark(self, copy: Copy, queued: bool) -> None:
        self._pending[copy] = queued
        self._ready.set()

    async def run(self) -> None:
        """Write the marks as they come (a supervised side task). A mark that cannot be written
        now is kept, unless a newer one for the same copy came meanwhile."""
        backoff = Backoff(0.05, 2.0)
        while True:
            await self._ready.wait()
            self._ready.clear()
            marks, self._pending = self._pending, {}
            try:
                locked = await self._write(marks)
            except Transient as exc:
                log.info("could not write which copies hold a delivery (%s); again soon", exc)
                locked = {c.observer_id for c in marks}
            if not locked:
                backoff.reset()
                continue
            # Not written (its row locked by a checkpoint at that instant): again, unless a
            # newer mark for the copy came meanwhile.
            self._pending = {
                **{c: m for c, m in marks.items() if c.observer_id in locked},
                **self._pending,
            }
            self._ready.set()
            await asyncio.sleep(backoff.next())
