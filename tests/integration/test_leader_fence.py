"""The leader's lease fences its loops' writes: a manager that missed its lease's end (a stall
its own clock did not see) writes nothing once its successor's term has begun; and one frozen
inside a transaction holds its successor off for a bounded time only."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from orch.cluster import quiet, wait_for
from orch_contracts.clock import Clock
from orch_contracts.deadline import LeaseTimings
from orch_contracts.errors import NotLeading
from orch_manager import repository as repo
from orch_manager.leader import LEADER_NAME, Leadership
from orch_manager.settings import ManagerSettings
from orch_manager.store import ManagerStore
from tests.conftest import Servers

TIMINGS = LeaseTimings(ttl=1.0, renew_interval=0.3, margin=0.2)
Loop = Callable[[], Coroutine[Any, Any, None]]


@pytest.fixture
async def store(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[ManagerStore]:
    settings = ManagerSettings(
        database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix, auth="disabled"
    )
    s = ManagerStore(settings)
    await s.open()
    try:
        async with s.autocommit() as tx:
            await tx.execute(
                "CREATE TABLE leader_writes (holder text NOT NULL, "
                "at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )
        yield s
    finally:
        await s.close()


def _writer(store: ManagerStore, holder: str, *, freeze: asyncio.Event | None = None) -> Loop:
    """A leader loop writing a row per transaction; once ``freeze`` is set, it stops inside its
    next transaction for ever (a process frozen between two statements)."""
    fenced = store.fenced(
        functools.partial(repo.leader_fence, name=LEADER_NAME, holder=holder, idle=TIMINGS.ttl / 2)
    )

    async def loop() -> None:
        while True:
            try:
                async with fenced.transaction() as tx:
                    await tx.rows("INSERT INTO leader_writes (holder) VALUES (:h)", h=holder)
                    await asyncio.sleep(0.05)  # a transaction that lasts a while
                    if freeze is not None and freeze.is_set():
                        await asyncio.Event().wait()
            except NotLeading:
                pass
            await asyncio.sleep(0.01)

    return loop


def _stall(leader: Leadership) -> None:
    """It renews no more, and its clock does not tell it its lease has ended."""

    async def never(*, renew: bool) -> bool:
        await asyncio.Event().wait()
        return False

    leader._claim = never  # type: ignore[method-assign]
    leader.deadline.valid = lambda: True  # type: ignore[method-assign]
    leader.deadline.remaining = lambda: 3600.0  # type: ignore[method-assign]


async def _count(store: ManagerStore, holder: str) -> int:
    async with store.autocommit() as tx:
        sql = "SELECT count(*) FROM leader_writes WHERE holder = :h"
        return int(await tx.value(sql, h=holder))


async def _leading(store: ManagerStore, holder: str, loop: Loop) -> tuple[Leadership, Any]:
    leader = Leadership(store, loops={"w": loop}, timings=TIMINGS, clock=Clock(), holder=holder)
    task = asyncio.create_task(leader.run())

    async def writes() -> bool:
        return await _count(store, holder) > 0

    await wait_for(writes, timeout=15, what=f"{holder}'s writes")
    return leader, task


async def test_an_old_leader_that_missed_its_lease_end_writes_nothing_in_its_successors_term(
    store: ManagerStore,
) -> None:
    tasks = []
    try:
        old, task = await _leading(store, "old", _writer(store, "old"))
        tasks.append(task)
        _stall(old)
        new = Leadership(
            store, loops={"w": _writer(store, "new")}, timings=TIMINGS, clock=Clock(), holder="new"
        )
        tasks.append(asyncio.create_task(new.run()))

        async def new_writes() -> bool:
            return await _count(store, "new") >= 20

        await wait_for(new_writes, timeout=15, what="the new leader's writes")
        assert old.is_leader, "the old leader's loops still run, as a stalled process's would"
        async with store.autocommit() as tx:
            last_old = await tx.value("SELECT max(at) FROM leader_writes WHERE holder = 'old'")
            first_new = await tx.value("SELECT min(at) FROM leader_writes WHERE holder = 'new'")
            late = await tx.value(
                "SELECT count(*) FROM leader_writes WHERE holder = 'old' AND at > :t", t=first_new
            )
        assert last_old < first_new, f"{late} writes of the old leader in its successor's term"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_leader_frozen_inside_a_transaction_holds_its_successor_off_briefly(
    store: ManagerStore,
) -> None:
    """Its transaction holds the lease row: the takeover waits for it, but the server ends a
    session idle in a transaction for half a lease, so the successor leads within a lease and
    a half of the freeze (before, it waited until TCP keepalive noticed: hours)."""
    tasks = []
    freeze = asyncio.Event()
    try:
        old, task = await _leading(store, "old", _writer(store, "old", freeze=freeze))
        tasks.append(task)
        _stall(old)
        freeze.set()
        frozen = time.monotonic()
        new = Leadership(
            store, loops={"w": _writer(store, "new")}, timings=TIMINGS, clock=Clock(), holder="new"
        )
        tasks.append(asyncio.create_task(new.run()))

        async def new_writes() -> bool:
            return await _count(store, "new") > 0

        await wait_for(new_writes, timeout=15, what="the new leader's writes")
        took = time.monotonic() - frozen
        bound = TIMINGS.ttl * 1.5 + 1.0  # a lease, the idle timeout, a claim's period and slack
        assert took < bound, f"the successor led {took:.1f} s after the freeze"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_takeover_waits_for_the_old_holders_open_transaction(store: ManagerStore) -> None:
    """A transaction of the old leader begun before its lease's end still writes; the
    successor's claim lands only after it has ended (a renewal never waits for one)."""
    old = Leadership(store, loops={}, timings=TIMINGS, clock=Clock(), holder="old")
    assert await old._claim(renew=False)
    fenced = store.fenced(
        functools.partial(repo.leader_fence, name=LEADER_NAME, holder="old", idle=30.0)
    )
    new = Leadership(store, loops={}, timings=TIMINGS, clock=Clock(), holder="new")
    async with fenced.transaction() as tx:
        assert await old._claim(renew=True), "a renewal does not wait for its own fences"
        await asyncio.sleep(TIMINGS.ttl + 0.1)  # the lease ends with this transaction open
        claim = asyncio.create_task(new._claim(renew=False))
        await quiet(0.5, "a claim that does not wait for the open transaction lands")
        assert not claim.done(), "the successor's term began under an open write of the old"
        await tx.rows("INSERT INTO leader_writes (holder) VALUES ('old')")
    assert await asyncio.wait_for(claim, 10), "the claim lands once the transaction ended"
