"""A rolling upgrade from the previous release to this one and back, on a running cluster.

The cluster starts as the previous release alone (``tests.support.releases``: its git tag
checked out, its own code and test kinds): its own ``orch migrate``, one manager, two services,
observers of the ``recorder`` kind. Then it rolls the way ``docs/upgrading.md`` (*Order*) says:
this release's ``orch migrate`` under the running cluster; a new manager in place of the old
one; then each service in turn drained, stopped and replaced by one of this release. Then the
services are rolled back to the previous release the same way, and forward again. The leader
rebalances meanwhile, so observers also move by handoff between releases in both directions.

Judged after every step, and over the whole roll, from the observers' own tick logs: every
observer runs, no two copies of one ever ran at the same time, and none stopped for longer than
``GAP_BOUND``.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orch.cluster import Proc
from orch_bench.ticklog import largest_gaps, read_ticks
from tests.conftest import Servers
from tests.support.cluster import quiet, wait_for
from tests.support.faults import assert_no_overlap
from tests.support.releases import (
    HEAD,
    MixedCluster,
    Release,
    empty_database,
    mixed_cluster,
    previous_release,
)

#: Observers started on the old cluster; more are created through each manager while mixed.
OBSERVERS, LATER = 12, 3
#: Their tick interval, seconds (a low rate: 10 ticks a second each).
INTERVAL = 0.1
#: The longest an observer may go without a tick during the roll. Every move in it is graceful:
#: a drain hands each observer to another service, a rebalance move is a handoff sent straight
#: to its target; neither waits for a lease to expire (the cluster's TTL is 2 s, so a move that
#: did would leave a gap of 2 s and more). The bound is the benchmark's target for a graceful
#: move (``orch bench``, *graceful move*: 1 s).
GAP_BOUND = 1.0
#: The old manager's leader rebalances as a deployment's does (on by default), quickly.
REBALANCE: dict[str, Any] = {
    "rebalance": "true",
    "rebalance_min_age": "1",
    "rebalance_interval": "0.3",
}


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    with previous_release(tmp_path_factory.mktemp("releases")) as release:
        yield release


class Roll:
    """The cluster under the roll, and what each step found."""

    def __init__(self, cluster: MixedCluster) -> None:
        self.cluster = cluster
        self.ids: list[uuid.UUID] = []
        self.worst: dict[str, float] = {}

    async def live(self, *procs: Proc) -> set[uuid.UUID]:
        return {await self.cluster.service_id(p) for p in procs}

    async def check(self, step: str, began: float, on: set[uuid.UUID]) -> None:
        """After ``step`` (begun at ``began``): every observer runs on a service of ``on``,
        checkpointing after now; from the tick logs, none stopped for ``GAP_BOUND`` or more
        since ``began``, and no two copies of one overlapped."""
        await self.cluster.wait_all_running(self.ids, timeout=10, on=on, fresh_after=time.time())
        ticks = read_ticks(self.cluster.tick_dir)
        wanted = {str(i) for i in self.ids}
        gaps = {o: g for o, g in largest_gaps(ticks, began, time.time()).items() if o in wanted}
        assert gaps.keys() == wanted, f"{step}: observers with no tick before it: {gaps}"
        self.worst[step] = max(gaps.values())
        print(f"{step}: longest gap {self.worst[step]:.3f} s", flush=True)
        slow = {o: round(g, 3) for o, g in gaps.items() if g >= GAP_BOUND}
        assert not slow, f"{step}: observers stopped for {GAP_BOUND} s or more: {slow}"
        assert_no_overlap(self.cluster.tick_dir)

    async def create(self, prefix: str) -> list[uuid.UUID]:
        """``LATER`` recorders created through the cluster's current API; running."""
        new = []
        for i in range(LATER):
            body = await self.cluster.create(
                f"{prefix}-{i}", "recorder", dir=str(self.cluster.tick_dir), interval=INTERVAL
            )
            new.append(uuid.UUID(body["id"]))
        await self.cluster.wait_all_running(new, timeout=10)
        await wait_for(lambda: _all_ticked(self.cluster, new), timeout=5, what="new ones tick")
        self.ids += new
        return new

    async def replace(self, proc: Proc, release: Release, name: str) -> Proc:
        """Drain ``proc`` through the API (its observers go to the other services), stop it
        once it runs nothing, and start a service of ``release`` in its place."""
        sid = await self.cluster.service_id(proc)
        async with self.cluster.api() as api:
            r = await api.post(f"/services/{sid}/drain")
            assert r.status_code == 202, r.text

        async def empty() -> bool:
            return await self.holding(proc) == 0

        await wait_for(empty, timeout=15, what=f"{proc.name} drained")
        assert await self.cluster.stop_gracefully(proc) == 0, proc.tail()
        return await self.cluster.start_service_of(release, name, worker_count=20)

    async def holding(self, proc: Proc) -> int:
        held: int = await self.cluster.q(
            "SELECT count(*) FROM observers WHERE service_id = $1 AND status = 'processing'",
            await self.cluster.service_id(proc),
            one=True,
        )
        return held


async def _all_ticked(cluster: MixedCluster, ids: list[uuid.UUID]) -> bool:
    ticked = {t.observer for t in read_ticks(cluster.tick_dir)}
    return {str(i) for i in ids} <= ticked


async def test_rolling_upgrade_from_the_previous_release_and_back(
    servers: Servers, prefix: str, tmp_path: Path, previous: Release
) -> None:
    """v0.1.0's manager and two services run observers on v0.1.0's schema; this release's
    migrations run under them; its manager replaces the old one; each service is drained,
    stopped and replaced by one of this release, then by one of v0.1.0 again, then by one of
    this release again. After each step and over the whole roll every observer runs, none ran
    twice at once and none stopped for ``GAP_BOUND`` or more; observers created through the
    old manager and the new one run, and a delete through the new manager stops one the old
    manager created."""
    previous.assert_imported_from_here()
    async with (
        empty_database(servers.asyncpg_dsn("postgres")) as name,
        mixed_cluster(
            database_url=servers.database_url(name),
            amqp_url=servers.amqp_url,
            prefix=prefix,
            workdir=tmp_path,
        ) as cluster,
    ):
        roll = Roll(cluster)
        # The old release alone, on its own schema.
        assert await cluster.migrate(previous) in previous.alembic_heads()
        old_manager = await cluster.start_manager_of(previous, **REBALANCE)
        a = await cluster.start_service_of(previous, "old-a", worker_count=20)
        b = await cluster.start_service_of(previous, "old-b", worker_count=20)
        roll.ids = await cluster.create_recorders(OBSERVERS, interval=INTERVAL)
        await cluster.wait_all_running(roll.ids, timeout=15, on=await roll.live(a, b))
        await wait_for(lambda: _all_ticked(cluster, roll.ids), timeout=5, what="all tick")
        await roll.create("old-api")
        rolled_from = time.time()

        # 1. This release's migrations, under the running old cluster.
        began = time.time()
        assert await cluster.migrate(HEAD) in HEAD.alembic_heads()
        await roll.check("migrate", began, await roll.live(a, b))

        # 2. A new manager replaces the old one, and leads the old services.
        began = time.time()
        new_manager = await cluster.start_manager_of(HEAD, **REBALANCE)
        # uvicorn ends a SIGTERMed server by raising the signal again once it has shut down.
        stopped = await cluster.stop_gracefully(old_manager)
        assert stopped in (0, -signal.SIGTERM), old_manager.tail()
        assert new_manager.port is not None
        cluster.api_port = new_manager.port

        async def leads() -> bool:
            async with cluster.api() as api:
                return bool((await api.get("/leader")).json()["this_replica_leads"])

        await wait_for(leads, timeout=10, what="the new manager leads")
        await roll.check("manager replaced", began, await roll.live(a, b))
        await roll.create("new-api")
        await roll.check("created through the new manager", time.time(), await roll.live(a, b))

        # 3. Each service in turn: drained, stopped, replaced by one of this release. Then back
        # to the previous release, and forward again.
        services = [a, b]
        releases = {p.name: previous for p in services}
        for step, release in (("up", HEAD), ("back", previous), ("forward", HEAD)):
            for i in range(len(services)):
                gone = services[i]
                began = time.time()
                services[i] = await roll.replace(gone, release, f"{step}-{i}")
                releases[services[i].name] = release
                await roll.check(
                    f"{step}: {gone.name} -> {services[i].name}", began, await roll.live(*services)
                )
            kinds = {r["id"]: r["kinds"] for r in await cluster.q("SELECT id, kinds FROM services")}
            for p in services:  # each process runs its own release: only this one advertises
                advertised = kinds[await cluster.service_id(p)]
                assert (advertised is None) == (release is previous), (p.name, advertised)

        # Over the whole roll: each observer there from the start ran in old and in new
        # services, never twice at once, and never stopped for long.
        end = time.time()
        ticks = read_ticks(cluster.tick_dir)
        by_release: dict[Release, set[int]] = {}
        for p in cluster.procs:
            if p.name in releases:
                by_release.setdefault(releases[p.name], set()).add(p.pid)
        for oid in roll.ids[:OBSERVERS]:
            pids = {t.pid for t in ticks if t.observer == str(oid)}
            assert pids & by_release[previous], f"{oid} never ran in an old service"
            assert pids & by_release[HEAD], f"{oid} never ran in a new service"
        whole = largest_gaps(ticks, rolled_from, end)
        longest = max(whole[str(i)] for i in roll.ids[: OBSERVERS + LATER])  # there from before
        print(f"whole roll: longest gap {longest:.3f} s, {end - rolled_from:.1f} s", flush=True)
        assert longest < GAP_BOUND
        assert_no_overlap(cluster.tick_dir)
        async with cluster.api() as api:
            live = {s["name"]: s for s in (await api.get("/services")).json()}
        assert set(live) == {p.name for p in services}, live
        assert all("recorder" in (s["kinds"] or []) for s in live.values()), live

        # The new manager stops an observer the old one created, with a delete.
        victim = roll.ids[OBSERVERS]
        async with cluster.api() as api:
            r = await api.delete(f"/observers/{victim}")
            assert r.status_code == 202, r.text
        await cluster.wait_status(victim, "deleted", timeout=10)
        deleted_at = time.time()
        await quiet(0.5, "a copy still running would tick 5 times")
        late = [t for t in read_ticks(cluster.tick_dir) if t.observer == str(victim)]
        assert all(t.at <= deleted_at for t in late), "the deleted observer still ticks"
        for p in (*services, new_manager):
            assert p.alive, p.tail()
        assert cluster.errors() == []
