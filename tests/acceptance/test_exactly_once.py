"""At most one running copy, nothing lost, deleted stays deleted: under freeze, partition,
broker faults, blackout and manager failover. The observers' own tick logs (written outside the
fenced path) decide whether two copies ever ran at once."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import httpx
import pytest

from orch_bench.ticklog import largest_gaps, read_ticks
from tests.support.cluster import Cluster, Proc, quiet, wait_for
from tests.support.faults import assert_no_overlap as check_overlap
from tests.support.faults import broker_env, ticks_of, via


def assert_no_overlap(cluster: Cluster) -> None:
    check_overlap(cluster.tick_dir)


async def loaded(cluster: Cluster, n: int = 8) -> tuple[list[uuid.UUID], uuid.UUID]:
    """A manager, service A running n recorders, and returns (ids, A's id)."""
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=20)
    ids = await cluster.create_recorders(n)
    await cluster.wait_all_running(ids, timeout=15)
    return ids, await cluster.service_id(a)


@pytest.mark.processes
async def test_freeze_longer_than_the_lease(cluster: Cluster) -> None:
    """SIGSTOP past the TTL: the observers run elsewhere; the resumed service stops its stale
    copies before they tick or write again."""
    ids, a_id = await loaded(cluster)
    a = cluster.procs[-1]
    b = await cluster.start_service("b", worker_count=20)
    b_id = await cluster.service_id(b)
    frozen_at = time.time()
    async with cluster.frozen(a):
        await cluster.wait_all_running(
            ids, timeout=cluster.lease_ttl + 2, on={b_id}, fresh_after=frozen_at
        )
        failover = time.time() - frozen_at
    resumed_at = time.time()
    await quiet(1.0, "a stale copy that was not fenced would tick")
    assert ticks_of(cluster.tick_dir, a.pid, after=resumed_at) == 0, (
        "a stale copy ticked after SIGCONT"
    )
    assert_no_overlap(cluster)
    # No write of the stale epoch landed: each observer's history after the freeze shows
    # only B's epoch, and every one is still on B.
    rows = await cluster.q("SELECT service_id, epoch FROM observers WHERE id = ANY($1)", ids)
    assert {r["service_id"] for r in rows} == {b_id}
    assert all(r["epoch"] == 2 for r in rows)
    # The resumed service rejoins the pool (its lease is renewed again).
    await wait_for(
        lambda: cluster.q("SELECT NOT is_deleted FROM services WHERE id = $1", a_id, one=True),
        timeout=10,
        what="frozen service rejoined",
    )
    assert failover <= cluster.lease_ttl + 2


@pytest.mark.processes
async def test_cut_off_from_postgres(cluster: Cluster) -> None:
    """A blackholed database: the holder fences itself within the TTL; others take over."""
    await cluster.start_manager()
    proxy = await cluster.proxy(cluster.database_url)
    a = await cluster.start_service(
        "a", worker_count=20, database_url=via(cluster.database_url, proxy)
    )
    ids = await cluster.create_recorders(6)
    await cluster.wait_all_running(ids, timeout=15)
    b = await cluster.start_service("b", worker_count=20)
    b_id = await cluster.service_id(b)
    cut_at = time.time()
    proxy.cut()
    await cluster.wait_all_running(
        ids, timeout=cluster.lease_ttl + 3, on={b_id}, fresh_after=cut_at
    )
    last_a = max((t.at for t in read_ticks(cluster.tick_dir) if t.pid == a.pid), default=0)
    assert last_a - cut_at < cluster.lease_ttl, "A kept running past its lease"
    assert_no_overlap(cluster)
    proxy.heal()
    await wait_for(
        lambda: cluster.q("SELECT NOT is_deleted FROM services WHERE pid = $1", a.pid, one=True),
        timeout=15,
        what="cut-off service rejoined",
    )
    assert a.popen.poll() is None


@pytest.mark.processes
async def test_blackout_every_service_killed(cluster: Cluster) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=10)
    b = await cluster.start_service("b", worker_count=10)
    ids = await cluster.create_recorders(10)
    await cluster.wait_all_running(ids, timeout=15)
    a.signal(signal.SIGKILL)
    b.signal(signal.SIGKILL)
    killed_at = time.time()
    await quiet(0.5, "nothing runs: a blackout")
    c = await cluster.start_service("c", worker_count=10)
    d = await cluster.start_service("d", worker_count=10)
    alive = {await cluster.service_id(c), await cluster.service_id(d)}
    await cluster.wait_all_running(ids, timeout=15, on=alive, fresh_after=killed_at)
    assert_no_overlap(cluster)


@pytest.mark.processes
async def test_delete_during_redistribution(cluster: Cluster) -> None:
    """Delete while the holder is frozen and its observers are moving: never runs again."""
    ids, _ = await loaded(cluster, n=4)
    a = cluster.procs[-1]
    await cluster.start_service("b", worker_count=20)
    victim = ids[0]
    a.signal(signal.SIGSTOP)
    try:
        async with cluster.api() as c:
            r = await c.delete(f"/observers/{victim}")
            assert r.status_code == 202

        await cluster.wait_status(victim, "deleted", timeout=cluster.lease_ttl + 3)
        deleted_at = time.time()
        await cluster.wait_all_running(ids[1:], timeout=cluster.lease_ttl + 3)
    finally:
        a.signal(signal.SIGCONT)
    await quiet(1.5, "the deleted observer would run again")
    late = [
        t for t in read_ticks(cluster.tick_dir) if t.observer == str(victim) and t.at > deleted_at
    ]
    assert late == [], "a deleted observer ran again"
    assert (await cluster.observer(victim))["status"] == "deleted"
    assert_no_overlap(cluster)


@pytest.mark.processes
async def test_kill_and_delete_race(cluster: Cluster) -> None:
    """SIGKILL the holder and delete at once: the redelivered message must not revive it."""
    ids, _ = await loaded(cluster, n=4)
    a = cluster.procs[-1]
    await cluster.start_service("b", worker_count=20)
    a.signal(signal.SIGKILL)
    async with cluster.api() as c:
        await asyncio.gather(*(c.delete(f"/observers/{i}") for i in ids))

    async def all_deleted() -> bool:
        rows = await cluster.q("SELECT status FROM observers WHERE id = ANY($1)", ids)
        return all(r["status"] == "deleted" for r in rows)

    await wait_for(all_deleted, timeout=cluster.lease_ttl + 3, what="all deleted")
    done_at = time.time()
    await quiet(1.0, "a revived observer would tick")
    assert not [t for t in read_ticks(cluster.tick_dir) if t.at > done_at]
    assert_no_overlap(cluster)


@pytest.mark.processes
async def test_two_managers_one_leader_and_failover(cluster: Cluster) -> None:
    m1 = await cluster.start_manager()
    m2 = await cluster.start_manager()

    async def leaders() -> list[int]:
        out = []
        for p in (m1, m2):
            if p.popen.poll() is not None:
                continue
            try:
                async with httpx.AsyncClient(headers=cluster.auth_headers) as c:
                    r = await c.get(f"http://127.0.0.1:{_port_of(p)}/leader")
            except httpx.HTTPError:
                continue  # just killed
            if r.json()["this_replica_leads"]:
                out.append(p.pid)
        return out

    first = await wait_for(leaders, timeout=10, what="a leader")
    await quiet(cluster.lease_ttl, "a second leader would appear")
    assert len(await leaders()) == 1, "two managers lead at once"
    leader = m1 if first[0] == m1.pid else m2
    other = m2 if leader is m1 else m1
    killed_at = time.monotonic()
    leader.signal(signal.SIGKILL)
    got = await wait_for(leaders, timeout=cluster.lease_ttl + 3, what="failover of the leader")
    assert got == [other.pid]
    assert time.monotonic() - killed_at <= cluster.lease_ttl + 3
    # The new leader's loops work: an outbox row left behind is published by its relay.
    cluster.api_port = _port_of(other)
    await cluster.start_service("a")
    oid = (await cluster.create("after-failover", interval=0.05))["id"]
    await cluster.wait_all_running([uuid.UUID(oid)], timeout=10)


def _port_of(proc: Proc) -> int:
    assert proc.port is not None
    return proc.port


# ---------------------------------------------------------------- broker-wide faults (slow)
@pytest.mark.processes
@pytest.mark.alone
@pytest.mark.slow
async def test_consumer_timeout_fires(cluster: Cluster) -> None:
    """The broker times out the never-acked deliveries and closes the channel: the copies go on
    under the lease (a closed channel is no reason to stop one), their redelivered starts are
    adopted, and nothing runs twice. The broker checks the timeout on each channel's tick (every
    60 s by default): ticks every second bring it to about ten seconds after the delivery."""
    with broker_env(consumer_timeout=10000, channel_tick_interval=1000):
        await cluster.start_manager()
        a = await cluster.start_service("a", worker_count=10)
        ids = await cluster.create_recorders(5)
        await cluster.wait_all_running(ids, timeout=15)
        await cluster.start_service("b", worker_count=10)
        started = time.time()
        await a.wait_log("broker session closed", timeout=150)
    await quiet(3.0, "redelivered starts would stop or double a copy")
    gaps = largest_gaps(read_ticks(cluster.tick_dir), started, time.time())
    assert max(gaps.values()) < 1.0, f"observers stopped: {gaps}"
    assert_no_overlap(cluster)
