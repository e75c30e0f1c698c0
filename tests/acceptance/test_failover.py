"""An unplanned failover of the database to an asynchronous standby that lags.

The orchestrator's database is a primary with an asynchronous streaming standby of the test's
own, fed through a proxy that holds the primary's WAL for ``LAG`` seconds
(``tests/support/pg_pair.py``): the common setup, and what most managed databases create by
default. Deletes and creates are acknowledged, the primary is SIGKILLed before they reach the
standby, the standby is promoted. The tail is lost; what must hold is judged from the
observers' own tick logs:

- no two copies of an observer at once;
- no epoch goes back (a promotion raises every fencing token: the epochs carry the timeline);
- an acknowledged delete is final: the manager applies it again, and a deleted observer runs
  no longer than it takes the system to notice;
- the creates the failover lost are reported (``/healthz``), and their copies stop;
- every observer the new primary has runs again; those whose take the failover lost (their
  service was killed just before it) are taken again at an epoch above every earlier one.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from orch_bench.ticklog import overlap_seconds, read_ticks
from tests.conftest import Servers
from tests.support.cluster import Cluster, migrated_cluster, quiet, wait_for
from tests.support.pg_auto_failover import AutoFailover
from tests.support.pg_auto_failover import missing_binaries as missing_auto_failover
from tests.support.pg_pair import PgPair, missing_binaries

#: It needs the machine, or the shared servers, to itself.
pytestmark = pytest.mark.alone

#: Seconds the standby is behind.
LAG = 8.0


@pytest.fixture
async def async_pair() -> AsyncIterator[PgPair]:
    why = missing_binaries()
    if why is not None:
        pytest.skip(why)
    pair = PgPair(synchronous=False, lag=LAG)
    try:
        await pair.start()
        yield pair
    finally:
        pair.close()


@pytest.fixture
async def cluster(
    async_pair: PgPair, servers: Servers, prefix: str, tmp_path: Path
) -> AsyncIterator[Cluster]:
    url = async_pair.url("orch_failover")
    async with migrated_cluster(url, servers.amqp_url, prefix, tmp_path) as cluster:
        yield cluster


async def _recorder(cluster: Cluster, name: str) -> uuid.UUID:
    body = await cluster.create(name, "recorder", dir=str(cluster.tick_dir), interval=0.05)
    return uuid.UUID(body["id"])


@pytest.mark.processes
async def test_an_async_failover_runs_one_copy_keeps_deletes_and_epochs_and_reports_lost_creates(
    async_pair: PgPair, cluster: Cluster
) -> None:
    manager = await cluster.start_manager()
    services = [await cluster.start_service(n, worker_count=20) for n in ("a", "b")]
    kept = await cluster.create_recorders(10)
    doomed = [await _recorder(cluster, f"doomed-{i}") for i in range(2)]
    await cluster.wait_all_running(kept + doomed, timeout=20)
    async with cluster.api() as c:
        shown = (await c.get("/healthz")).json()
        # Paused then resumed long before the crash: nothing of it is to be made good (the
        # pause was applied again after the failover, stopping an observer its user resumed).
        resumed = kept[0]
        assert (await c.post(f"/observers/{resumed}/pause")).status_code < 300
        await cluster.wait_status(resumed, "paused", timeout=10)
        assert (await c.post(f"/observers/{resumed}/resume")).status_code < 300
        # One paused, whose params are edited within the standby's lag below.
        edited = await _recorder(cluster, "edited")
        assert (await c.post(f"/observers/{edited}/pause")).status_code < 300
        await cluster.wait_status(edited, "paused", timeout=10)
    assert shown["database"]["durability"] == "asynchronous", shown
    assert any("asynchronous" in w for w in shown["warnings"]), shown
    await cluster.wait_all_running(kept, timeout=10)
    await async_pair.caught_up(timeout=LAG + 10)

    # Within the standby's lag: b is killed and its observers taken by a, two deletes are
    # answered and carried out, two creates answered.
    acknowledged = time.time()
    on_b = await cluster.q(
        "SELECT id FROM observers WHERE service_id = $1", await cluster.service_id(services[1])
    )
    services[1].signal(signal.SIGKILL)
    moved = [r["id"] for r in on_b if r["id"] in kept]
    await cluster.wait_all_running(moved, timeout=LAG / 4, fresh_after=acknowledged)
    async with cluster.api() as c:
        for oid in doomed:
            r = await c.delete(f"/observers/{oid}")
            assert r.status_code < 300, r.text
    for oid in doomed:
        await cluster.wait_status(oid, "deleted", timeout=LAG / 4)
    late = [await _recorder(cluster, f"late-{i}") for i in range(2)]
    async with cluster.api() as c:
        r = await c.patch(f"/observers/{edited}", json={"params": {"interval": 0.2}})
        assert r.status_code == 200, r.text
    if cluster.db is not None:  # the test's own pool would hold the dead server's connections
        cluster.db.terminate()
        cluster.db = None
    crashed = await async_pair.crash()
    assert crashed - acknowledged < LAG - 1, "too slow to stay within the standby's lag"
    promoted = await async_pair.promote()

    # What the promotion lost, on the new primary.
    rows = {r["id"]: r["status"] for r in await cluster.q("SELECT id, status FROM observers")}
    assert not set(late) & set(rows), "the late creates reached the standby: no tail was lost"
    assert all(rows[o] == "processing" for o in doomed), f"the deletes were not lost: {rows}"

    await cluster.wait_all_running(kept, timeout=30)

    async def deleted_again() -> bool:
        statuses = await cluster.q("SELECT status FROM observers WHERE id = ANY($1)", doomed)
        return all(s["status"] in ("on_deleting", "deleted") for s in statuses)

    await wait_for(deleted_again, timeout=15, what="the lost deletes applied again")

    async def reported() -> list[str]:
        async with cluster.api() as c:
            warnings: list[str] = (await c.get("/healthz")).json()["warnings"]
        return [w for w in warnings if "lost 2 acknowledged creates" in w]

    report = await wait_for(reported, timeout=15, what="the lost creates reported")
    assert all(str(o) in report[0] for o in late), report

    async def edit_reported() -> list[str]:
        async with cluster.api() as c:
            warnings: list[str] = (await c.get("/healthz")).json()["warnings"]
        return [w for w in warnings if "lost 1 acknowledged edits of params" in w]

    report = await wait_for(edit_reported, timeout=15, what="the lost edit reported")
    assert str(edited) in report[0], report

    settle = cluster.lease_ttl * 2 + 2.0
    await asyncio.sleep(settle)  # every observer that runs is seen running, the rest stopped
    end = time.time()
    ticks = read_ticks(cluster.tick_dir)
    assert overlap_seconds(ticks) == {}, "two copies of an observer ran at the same time"
    before: dict[str, int] = {}
    for t in ticks:
        if t.at < crashed:
            before[t.observer] = max(before.get(t.observer, 0), t.epoch)
    seen: dict[str, int] = {}
    for t in sorted(ticks, key=lambda t: t.at):
        assert t.epoch >= seen.get(t.observer, 0), f"{t.observer}: its epoch went back"
        seen[t.observer] = t.epoch
    running_at_end = {t.observer for t in ticks if t.at > end - 1.0}
    assert running_at_end == {str(o) for o in kept}, "an observer is not running, or too many"
    gone = {str(o) for o in doomed + late}
    last = max((t.at for t in ticks if t.observer in gone), default=crashed)
    assert last - promoted <= cluster.lease_ttl + 2.0, (
        f"a deleted or lost observer ran {last - promoted:.2f}s after the promotion"
    )
    epochs = {r["id"]: r["epoch"] for r in await cluster.q("SELECT id, epoch FROM observers")}
    for oid in kept:
        assert epochs[oid] >= seen[str(oid)], f"{oid}: the row's epoch is below a copy's"
    taken_after = {
        t.epoch for t in ticks if t.at > promoted and t.epoch > before.get(t.observer, 0)
    }
    assert taken_after, "no observer was taken again after the promotion"
    assert min(taken_after) >= 1 << 32, f"an epoch taken after the promotion: {taken_after}"
    assert manager.alive
    assert services[0].alive
    print(
        f"\nasync failover (lag {LAG:.0f} s): promoted {promoted - crashed:.2f} s after the "
        f"crash; deleted or lost observers last ticked {last - promoted:+.2f} s after it"
    )


# ------------------------------------------------------------------------------------------
# An automatic failover of a pg_auto_failover formation with a synchronous standby
# (tests/support/pg_auto_failover.py): the primary's machine is lost under load, the monitor
# promotes the standby by itself. A synchronous standby has every acknowledged write, so nothing
# acknowledged may be lost; what must hold is judged from the observers' own tick logs.

#: Creates the load makes (acknowledged ones: some before the kill, the rest after).
LOAD = 15


@pytest.fixture
async def ha_stack() -> AsyncIterator[AutoFailover]:
    why = missing_auto_failover()
    if why is not None:
        pytest.skip(why)
    stack = AutoFailover()
    try:
        await stack.start()
        yield stack
    finally:
        stack.close()


@pytest.fixture
async def ha_cluster(
    ha_stack: AutoFailover, servers: Servers, prefix: str, tmp_path: Path
) -> AsyncIterator[Cluster]:
    async with migrated_cluster(ha_stack.url(), servers.amqp_url, prefix, tmp_path) as cluster:
        yield cluster


async def _load(
    cluster: Cluster, acked: list[tuple[uuid.UUID, float]], stop: asyncio.Event
) -> None:
    """Create recorders one after another until ``LOAD`` are acknowledged (201: the id and
    when); a create that fails (the database is failing over) is not acknowledged."""
    async with cluster.api() as c:
        while len(acked) < LOAD and not stop.is_set():
            name = f"load-{len(acked)}-{uuid.uuid4().hex[:6]}"
            params = {"dir": str(cluster.tick_dir), "interval": 0.05}
            try:
                r = await c.post(
                    "/observers", json={"name": name, "kind": "recorder", "params": params}
                )
            except httpx.HTTPError:
                continue
            if r.status_code == 201:
                acked.append((uuid.UUID(r.json()["id"]), time.time()))


async def test_an_automatic_failover_to_a_synchronous_standby_loses_nothing_acknowledged(
    ha_stack: AutoFailover, ha_cluster: Cluster
) -> None:
    cluster = ha_cluster
    manager = await cluster.start_manager()
    services = [await cluster.start_service(n, worker_count=20) for n in ("a", "b")]
    kept = await cluster.create_recorders(10)
    doomed = await _recorder(cluster, "doomed")
    await cluster.wait_all_running([*kept, doomed], timeout=20)
    async with cluster.api() as c:
        shown = (await c.get("/healthz")).json()
    assert shown["database"]["durability"] == "synchronous", shown

    # Under load (creates going on, twenty recorders ticking), a delete is acknowledged and the
    # primary's machine is lost right after.
    acked: list[tuple[uuid.UUID, float]] = []
    stop = asyncio.Event()
    loader = asyncio.create_task(_load(cluster, acked, stop))
    try:

        async def under_way() -> bool:
            return len(acked) >= 5

        await wait_for(under_way, timeout=20, what="creates acknowledged")
        async with cluster.api() as c:
            r = await c.delete(f"/observers/{doomed}")
        assert r.status_code < 300, r.text
        if cluster.db is not None:  # the test's own pool would hold the dead server's connections
            await cluster.db.close()
            cluster.db = None
        lost, crashed = await ha_stack.crash_primary()
        failover = await ha_stack.wait_failover(lost, crashed)

        async def taking_creates() -> bool:
            return any(at > failover.writable for _, at in acked) or loader.done()

        await wait_for(taking_creates, timeout=60, what="a create acknowledged after the failover")
    finally:
        stop.set()
        await loader

    # The keeper reports the state it reached on its next round: the node may take writes
    # (as ``wait_failover`` saw) while the monitor still shows ``stop_replication``.
    async def reported_primary() -> bool:
        return (await ha_stack.states())[failover.port][0] in ("wait_primary", "primary")

    await wait_for(reported_primary, timeout=15, what="the survivor reported as primary")

    # Nothing acknowledged is lost: every create is there, the delete stays.
    rows = {r["id"]: r["status"] for r in await cluster.q("SELECT id, status FROM observers")}
    missing = [o for o, _ in acked if o not in rows]
    assert not missing, f"acknowledged creates lost by the failover: {missing}"
    assert rows[doomed] in ("on_deleting", "deleted"), f"the acknowledged delete was lost: {rows}"
    live = [*kept, *(o for o, _ in acked)]
    await cluster.wait_all_running(live, timeout=30)
    await cluster.wait_status(doomed, "deleted", timeout=15)

    await quiet(cluster.lease_ttl * 2 + 2.0, "a deleted observer ticking, a copy too many")
    end = time.time()
    ticks = read_ticks(cluster.tick_dir)
    assert overlap_seconds(ticks) == {}, "two copies of an observer ran at the same time"
    seen: dict[str, int] = {}
    for t in ticks:  # oldest first
        assert t.epoch >= seen.get(t.observer, 0), f"{t.observer}: its epoch went back"
        seen[t.observer] = t.epoch
    running_at_end = {t.observer for t in ticks if t.at > end - 1.0}
    assert running_at_end == {str(o) for o in live}, "an observer is not running, or too many"

    # The deleted observer runs on no later than its copy's lease lets it (it expires while
    # the database is down, or the first renewal on the new primary stops it).
    fenced = max(failover.writable, crashed + cluster.lease_ttl)
    last_doomed = max(t.at for t in ticks if t.observer == str(doomed))
    assert last_doomed <= fenced, (
        f"the deleted observer ticked {last_doomed - failover.writable:+.2f}s after the failover"
    )

    # Every observer that ran before the kill runs again within the lease's TTL of the failover.
    bound = cluster.lease_ttl + failover.seconds + 2.0
    before = {str(o) for o in kept} | {str(o) for o, at in acked if at < crashed}
    gap = 0.0
    for oid in before:
        times = [t.at for t in ticks if t.observer == oid]
        around = [at for at in times if at >= crashed] + [max(at for at in times if at < crashed)]
        around.sort()
        gap = max(gap, *(b - a for a, b in itertools.pairwise(around)))
        again = min(at for at in times if at > failover.writable)
        assert again - crashed <= bound, (
            f"{oid} ran again {again - crashed:.2f}s after the kill (bound {bound:.2f}s)"
        )
    assert gap <= bound, f"an observer stopped for {gap:.2f}s (bound {bound:.2f}s)"
    assert manager.alive
    assert all(s.alive for s in services)
    print(
        f"\npg_auto_failover: the standby took writes {failover.seconds:.2f} s after the "
        f"primary was killed; largest tick gap {gap:.2f} s (bound {bound:.2f} s); "
        f"{len(acked)} creates acknowledged ({sum(at < crashed for _, at in acked)} before the "
        f"kill), none lost; the deleted observer last ticked "
        f"{last_doomed - crashed:+.2f} s after the kill"
    )
