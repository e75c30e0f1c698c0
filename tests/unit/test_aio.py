"""The per-observer asyncio event: asyncio.Event's behaviour at a fraction of its memory."""

from __future__ import annotations

import asyncio
import sys

from orch_contracts import aio


async def test_set_wakes_every_waiter_and_a_set_event_does_not_wait() -> None:
    e = aio.Event()
    waiters = [asyncio.create_task(e.wait()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    e.set()
    assert await asyncio.gather(*waiters) == [True, True, True]
    assert e.is_set()
    assert await e.wait()
    e.clear()
    assert not e.is_set()


async def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    e = aio.Event()
    waiter = asyncio.create_task(e.wait())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert e._waiters is None
    e.set()  # wakes nobody, raises nothing
    assert await asyncio.wait_for(e.wait(), timeout=1)


def test_it_is_small_where_asyncio_event_is_not() -> None:
    ours = sys.getsizeof(aio.Event())
    theirs = asyncio.Event()
    theirs_size = sys.getsizeof(theirs) + sys.getsizeof(theirs.__dict__)
    theirs_size += sys.getsizeof(theirs._waiters)
    assert ours < 100 < theirs_size, (ours, theirs_size)
