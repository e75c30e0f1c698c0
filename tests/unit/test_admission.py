"""Admission: one start per observer at a time, pauses, and what a burst of starts costs."""

from __future__ import annotations

import asyncio
import time
import uuid

from observer_service.admission import Admission


async def test_a_second_start_of_an_observer_waits_for_the_first() -> None:
    admission = Admission(4)
    oid = uuid.uuid4()
    order: list[str] = []
    release = asyncio.Event()

    async def first() -> None:
        async with admission.admitting(oid):
            order.append("first in")
            await release.wait()
            order.append("first out")

    async def second() -> None:
        async with admission.admitting(oid):
            order.append("second in")

    tasks = [asyncio.create_task(first()), asyncio.create_task(second())]
    await asyncio.sleep(0.01)
    assert order == ["first in"]
    assert admission.in_flight == 1
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["first in", "first out", "second in"]
    assert await admission.idle(1.0)


async def test_paused_waits_for_starts_in_flight_and_holds_new_ones() -> None:
    admission = Admission(4)
    release = asyncio.Event()
    events: list[str] = []

    async def held(name: str, gate: asyncio.Event | None) -> None:
        async with admission.admitting(uuid.uuid4()):
            events.append(f"{name} in")
            if gate is not None:
                await gate.wait()

    async def pause() -> None:
        async with admission.paused():
            events.append("paused")
            await asyncio.sleep(0.01)
            events.append("resumed")

    in_flight = asyncio.create_task(held("a", release))
    await asyncio.sleep(0)
    pausing = asyncio.create_task(pause())
    await asyncio.sleep(0)
    newcomer = asyncio.create_task(held("b", None))
    await asyncio.sleep(0.01)
    assert events == ["a in"]  # the pause waits for a; b waits for the pause
    release.set()
    await asyncio.gather(in_flight, pausing, newcomer)
    assert events == ["a in", "paused", "resumed", "b in"]
    assert await admission.idle(1.0)


async def test_a_burst_of_waiting_starts_costs_one_wake_up_each() -> None:
    """A thousand redelivered starts settle one at a time while a directed start of each
    observer waits behind it (a failover). One shared condition woke every waiter at every
    settle: 1.5 s of event loop for 1,000 and 6.4 s for 2,000 on the development machine,
    while the service's heartbeats and takes waited. Per-observer waits take milliseconds."""
    n = 2000
    admission = Admission(n)
    ids = [uuid.uuid4() for _ in range(n)]
    gates = [asyncio.Event() for _ in ids]

    async def start(oid: uuid.UUID, gate: asyncio.Event | None) -> None:
        async with admission.admitting(oid):
            if gate is not None:
                await gate.wait()

    began = time.perf_counter()
    tasks = [asyncio.create_task(start(o, g)) for o, g in zip(ids, gates, strict=True)]
    tasks += [asyncio.create_task(start(o, None)) for o in ids]
    await asyncio.sleep(0)
    for gate in gates:
        gate.set()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert time.perf_counter() - began < 2.0  # generous: about 0.08 s here
    assert admission.in_flight == 0
