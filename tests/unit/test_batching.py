"""The micro-batcher's linger (contracts/batching.py): a request that comes alone goes at once;
under a steady stream a batch waits briefly for the requests right behind it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from orch_contracts.batching import Batcher


class Recorder:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def flush(self, items: list[int]) -> list[int]:
        self.batches.append(items)
        await self.gate.wait()
        return items


@pytest.fixture
async def running() -> AsyncIterator[list[asyncio.Task[None]]]:
    tasks: list[asyncio.Task[None]] = []
    yield tasks
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_request_alone_never_lingers(running: list[asyncio.Task[None]]) -> None:
    rec = Recorder()
    batcher: Batcher[int, int] = Batcher(rec.flush, linger=0.5)
    running.append(asyncio.create_task(batcher.run()))
    for i in range(3):
        t = time.monotonic()
        assert await batcher.submit(i) == i
        assert time.monotonic() - t < 0.25, "a lone request waited for company"
    assert rec.batches == [[0], [1], [2]]


async def test_a_steady_stream_lingers_and_batches_grow(running: list[asyncio.Task[None]]) -> None:
    rec = Recorder()
    batcher: Batcher[int, int] = Batcher(rec.flush, linger=0.3)
    running.append(asyncio.create_task(batcher.run()))
    rec.gate.clear()  # the first flush is slow: requests queue behind it
    first = asyncio.create_task(batcher.submit(0))
    await asyncio.sleep(0.01)
    queued = [asyncio.create_task(batcher.submit(i)) for i in (1, 2)]
    await asyncio.sleep(0.01)
    rec.gate.set()
    await asyncio.gather(first, *queued)
    assert rec.batches == [[0], [1, 2]]  # a stream: the next batch may linger
    # Two requests 50 ms apart, well inside the linger: they go in one batch. Without the
    # linger the first would go alone at once.
    a = asyncio.create_task(batcher.submit(3))
    await asyncio.sleep(0.05)
    b = asyncio.create_task(batcher.submit(4))
    assert list(await asyncio.gather(a, b)) == [3, 4]
    assert rec.batches[-1] == [3, 4]
    # That batch carried two, so the stream counts as going on; a request after a lone batch
    # goes at once again.
    await batcher.submit(5)
    t = time.monotonic()
    await batcher.submit(6)
    assert time.monotonic() - t < 0.2
    assert rec.batches[-2:] == [[5], [6]]
