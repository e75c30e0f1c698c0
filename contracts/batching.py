"""One statement for many requests: a micro-batcher.

Requests that arrive while a flush is running wait and go together in the next one. An idle
process writes each request at once; a busy one makes one round trip for many: a service's
takes and checkpoints (a burst of redelivered starts after a crash, a thousand observers
checkpointing), the manager's single creates (``orch_manager.intake``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

I = TypeVar("I")  # noqa: E741
R = TypeVar("R")

Flush = Callable[[list[I]], Awaitable[Sequence[R]]]

#: The orchestrator's window for ``linger``: 2 ms, small beside a request's own latency under
#: load, and enough to turn a steady stream into batches of several.
LINGER = 0.002


class Batcher(Generic[I, R]):
    """``in_flight`` flushes may run at once (each on its own connection): a burst is then
    not queued behind one slow round trip.

    With ``linger``, a batch that starts while requests keep coming (the previous one carried
    more than one) waits that many seconds for more before it goes: under a steady stream the
    batches grow, and the cost of a round trip is shared by more requests. A request that
    comes alone never waits."""

    def __init__(
        self,
        flush: Flush[I, R],
        *,
        max_batch: int = 1000,
        in_flight: int = 1,
        linger: float = 0.0,
    ) -> None:
        self._flush = flush
        self._max_batch = max_batch
        self._in_flight = in_flight
        self._linger = linger
        self._busy = False
        self._queue: asyncio.Queue[tuple[I, asyncio.Future[R]]] = asyncio.Queue()

    async def submit(self, item: I) -> R:
        """The result of ``item``'s flush, or the exception the flush raised."""
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((item, fut))
        return await fut

    async def run(self) -> None:
        """Flush for ever (a supervised side task of the service)."""
        slots = asyncio.Semaphore(self._in_flight)
        flushing: set[asyncio.Task[None]] = set()
        try:
            while True:
                await slots.acquire()
                batch = [await self._queue.get()]
                if self._busy and self._linger > 0:
                    await asyncio.sleep(self._linger)
                while len(batch) < self._max_batch and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                self._busy = len(batch) > 1
                task = asyncio.create_task(self._flush_one(batch))
                flushing.add(task)
                task.add_done_callback(flushing.discard)
                task.add_done_callback(lambda _: slots.release())
        finally:
            for task in flushing:
                task.cancel()

    async def _flush_one(self, batch: list[tuple[I, asyncio.Future[R]]]) -> None:
        try:
            results = await self._flush([item for item, _ in batch])
        except Exception as exc:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        except BaseException:
            for _, fut in batch:
                fut.cancel()
            raise
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)
