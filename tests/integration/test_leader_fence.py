"""The leader's lease fences its loops' writes: a manager that missed its lease's end (a stall
its own clock did not see) writes nothing once its successor's term has begun."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from contracts.clock import Clock
from contracts.deadline import LeaseTimings
from contracts.errors import NotLeading
from manager import repository as repo
from manager.leader import LEADER_NAME, Leadership
from manager.settings import ManagerSettings
from manager.store import ManagerStore
from orch.cluster import wait_for
from tests.conftest import Servers

TIMINGS = LeaseTimings(ttl=1.0, renew_interval=0.3, margin=0.2)


def _writer(store: ManagerStore, holder: str) -> Callable[[], Coroutine[Any, Any, None]]:
    fenced = store.fenced(functools.partial(repo.leader_fence, name=LEADER_NAME, holder=holder))

    async def loop() -> None:
        while True:
            try:
                async with fenced.transaction() as tx:
                    await tx.rows("INSERT INTO leader_writes (holder) VALUES (:h)", h=holder)
                    await asyncio.sleep(0.05)  # a transaction that lasts a while
            except NotLeading:
                pass
            await asyncio.sleep(0.01)

    return loop


async def test_an_old_leader_that_missed_its_lease_end_writes_nothing_in_its_successors_term(
    servers: Servers, database_url: str, prefix: str
) -> None:
    settings = ManagerSettings(
        database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix, auth="disabled"
    )
    store = ManagerStore(settings)
    await store.open()
    tasks: list[asyncio.Task[None]] = []
    try:
        async with store.autocommit() as tx:
            await tx.execute(
                "CREATE TABLE leader_writes (holder text NOT NULL, "
                "at timestamptz NOT NULL DEFAULT clock_timestamp())"
            )

        async def count(holder: str) -> int:
            async with store.autocommit() as tx:
                sql = "SELECT count(*) FROM leader_writes WHERE holder = :h"
                return int(await tx.value(sql, h=holder))

        async def old_writes() -> bool:
            return await count("old") > 0

        async def new_writes() -> bool:
            return await count("new") >= 20

        old = Leadership(
            store, loops={"w": _writer(store, "old")}, timings=TIMINGS, clock=Clock(), holder="old"
        )
        tasks.append(asyncio.create_task(old.run()))
        await wait_for(old_writes, timeout=15, what="the old leader's writes")

        # It stalls: it renews no more, and its clock does not tell it its lease has ended.
        async def never(*, renew: bool) -> bool:
            await asyncio.Event().wait()
            return False

        old._claim = never  # type: ignore[method-assign]
        old.deadline.valid = lambda: True  # type: ignore[method-assign]
        old.deadline.remaining = lambda: 3600.0  # type: ignore[method-assign]

        new = Leadership(
            store, loops={"w": _writer(store, "new")}, timings=TIMINGS, clock=Clock(), holder="new"
        )
        tasks.append(asyncio.create_task(new.run()))
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
        await store.close()
