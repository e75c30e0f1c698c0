"""Riding through the broker: the lease, not the broker, proves a copy is the only one, so
observers go on while the broker restarts or a service's link to it drops; a lost lease session
during a partition never runs two copies; a start that meets a database error is settled.

Judged from the observers' own tick logs (written outside the fenced path)."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import aio_pika
import pytest

from orch_bench.ticklog import largest_gaps, read_ticks
from orch_contracts.settings import CommonSettings
from orch_contracts.topology import service_present
from orch_verify.proxy import Proxy
from tests.support.cluster import Cluster, Proc, quiet, wait_for
from tests.support.faults import (
    LEASE_BACKEND,
    assert_no_overlap,
    memory_alarm,
    queue_counts,
    rabbitmqctl,
    via,
)

#: The largest tick gap a running observer may show through a broker fault, seconds.
MAX_GAP = 1.0


def _gaps_over(
    cluster: Cluster, ids: list[uuid.UUID], start: float, end: float
) -> dict[str, float]:
    wanted = {str(i) for i in ids}
    gaps = largest_gaps(read_ticks(cluster.tick_dir), start, end)
    return {o: round(g, 3) for o, g in gaps.items() if o in wanted and g > MAX_GAP}


async def _deleted(cluster: Cluster, ids: list[uuid.UUID]) -> bool:
    rows = await cluster.q("SELECT status FROM observers WHERE id = ANY($1)", ids)
    return all(r["status"] == "deleted" for r in rows)


@pytest.mark.processes
@pytest.mark.alone
@pytest.mark.slow
@pytest.mark.parametrize("down", [10, 60])
async def test_observers_ride_through_a_broker_restart(cluster: Cluster, down: float) -> None:
    """``rabbitmqctl stop_app`` for ``down`` seconds, then ``start_app``: no observer stops for
    more than a second, none runs twice, deletes accepted meanwhile complete afterwards, and
    every service takes work again."""
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=15)
    await cluster.start_service("b", worker_count=15)
    ids = await cluster.create_recorders(12)
    await cluster.wait_all_running(ids, timeout=20)
    doomed, kept = ids[:2], ids[2:]
    try:
        await asyncio.to_thread(rabbitmqctl, "stop_app")
        stopped_at = time.time()
        await quiet(down / 2, "observers would stop while the broker is down")
        async with cluster.api() as c:
            for oid in doomed:
                r = await c.delete(f"/observers/{oid}")
                assert r.status_code in (200, 202), r.text
        deleted_at = time.time()
        await quiet(down / 2, "observers would stop while the broker is down")
    finally:
        await asyncio.to_thread(rabbitmqctl, "start_app")
    started_at = time.time()
    await wait_for(lambda: _deleted(cluster, doomed), timeout=30, what="deletes completed")
    await quiet(3.0, "redelivered starts would stop or double a copy")
    end = time.time()
    assert _gaps_over(cluster, kept, stopped_at, end) == {}, (
        f"observers stopped through a {down} s broker outage"
    )
    assert_no_overlap(cluster.tick_dir)
    late = [
        t
        for t in read_ticks(cluster.tick_dir)
        if t.observer in {str(i) for i in doomed} and t.at > deleted_at + 2.5
    ]
    assert late == [], "a deleted observer ran on"
    await cluster.wait_all_running(kept, timeout=10, fresh_after=started_at)
    assert all(p.alive for p in cluster.procs)
    # Every service consumes again: a new observer runs.
    (fresh,) = await cluster.create_recorders(1)
    await cluster.wait_all_running([fresh], timeout=15)


@pytest.mark.processes
async def test_a_service_cut_off_from_the_broker_goes_on(cluster: Cluster) -> None:
    """A blackholed AMQP link: the broker drops the connection and redelivers its starts to the
    other service, which drops them as duplicates; the cut service's observers never stop, and
    once the link heals it takes work again."""
    a, a_id, proxy, ids, _ = await _a_behind_a_proxy_and_b(cluster, 6)
    cut_at = time.time()
    proxy.cut()
    await _wait_off_broker(cluster, a_id)
    await quiet(3.0, "the other service would take the cut service's observers")
    proxy.heal()
    await cluster.wait_all_running(ids, timeout=10, on={a_id}, fresh_after=time.time())
    assert _gaps_over(cluster, ids, cut_at, time.time()) == {}
    assert_no_overlap(cluster.tick_dir)
    assert a.alive


@pytest.mark.processes
async def test_a_service_is_back_on_the_broker_soon_after_it_returns(cluster: Cluster) -> None:
    """Its broker link refused for 8 s (a broker restart, as the service sees it): back on the
    broker within 2 s of the link's return. Its retries waited up to 5 s once doubled, and a
    chaos run's observers, stopped by a lost lease during a broker restart, waited 4.7 s after
    the broker was back for their service to try again."""
    a, a_id, proxy, _, _ = await _a_behind_a_proxy_and_b(cluster, 3)
    topology = CommonSettings(prefix=cluster.prefix).topology
    proxy.refuse()
    proxy.reset()
    await _wait_off_broker(cluster, a_id)
    await quiet(8.0, "the refused link would stop the service")
    proxy.accept()
    back_from = time.monotonic()
    connection = await aio_pika.connect(cluster.amqp_url, timeout=5)
    async with connection:

        async def present() -> bool:
            return await service_present(connection, topology, a_id)

        await wait_for(present, timeout=10, what="the service back on the broker", every=0.02)
    took = time.monotonic() - back_from
    assert took < 2.0, f"back on the broker {took:.2f} s after the link returned"
    assert a.alive


async def _a_behind_a_proxy_and_b(
    cluster: Cluster, n: int
) -> tuple[Proc, uuid.UUID, Proxy, list[uuid.UUID], Proc]:
    """Service A, its AMQP link through a proxy, running ``n`` recorders; then service B."""
    await cluster.start_manager()
    proxy = await cluster.proxy(cluster.amqp_url)
    a = await cluster.start_service(
        "a", worker_count=20, amqp_url=via(cluster.amqp_url, proxy), amqp_heartbeat=2
    )
    a_id = await cluster.service_id(a)
    ids = await cluster.create_recorders(n)
    await cluster.wait_all_running(ids, timeout=15, on={a_id})
    b = await cluster.start_service("b", worker_count=20, amqp_heartbeat=2)
    return a, a_id, proxy, ids, b


async def _wait_off_broker(cluster: Cluster, service_id: uuid.UUID) -> None:
    """Until the broker has dropped that service's connection (its control queue is gone)."""
    topology = CommonSettings(prefix=cluster.prefix).topology
    connection = await aio_pika.connect(cluster.amqp_url, timeout=5)
    async with connection:

        async def gone() -> bool:
            return not await service_present(connection, topology, service_id)

        await wait_for(gone, timeout=30, what="the broker to drop the cut link", every=0.02)


@pytest.mark.processes
async def test_a_partition_then_a_lost_lease_session_runs_one_copy(cluster: Cluster) -> None:
    """A's AMQP link is blackholed; the moment the broker drops it (its starts go to B, marked
    redelivered), A's lease session is ended while A still reaches the database. B may now take
    A's observers (A's lock is free and its control queue gone): A's copies pause at once and
    those B took never run again on A. A lives on."""
    a, a_id, proxy, ids, b = await _a_behind_a_proxy_and_b(cluster, 10)
    proxy.cut()
    await _wait_off_broker(cluster, a_id)
    db = await cluster.connect()
    pid = await db.fetchval(LEASE_BACKEND, a_id)
    assert pid is not None
    await db.execute("SELECT pg_terminate_backend($1)", pid)
    ended_at = time.time()
    await quiet(3.0, "two copies would run, or A would exit")
    proxy.heal()
    await cluster.wait_all_running(ids, timeout=20, fresh_after=time.time())
    assert_no_overlap(cluster.tick_dir)
    assert a.alive, "the cut service exited"
    assert b.alive
    assert _gaps_over(cluster, ids, ended_at, time.time()) == {}, "observers were stranded"


@pytest.mark.processes
async def test_a_start_that_meets_database_errors_is_settled(cluster: Cluster) -> None:
    """Starts arrive while the service's connections to the database are reset (a blip during
    a burst): each take is retried, none is left unsettled, and all run at once afterwards,
    without the leader's audit (slowed down here) having to find them."""
    await cluster.start_manager(audit_grace=60)
    proxy = await cluster.proxy(cluster.database_url)
    await cluster.start_service("a", worker_count=20, database_url=via(cluster.database_url, proxy))
    blip = asyncio.create_task(proxy.blip(0.8))
    ids = await cluster.create_recorders(8)
    await blip
    healed = time.time()
    await cluster.wait_all_running(ids, timeout=5, fresh_after=healed)
    redispatched = await cluster.q(
        "SELECT count(*) FROM observer_events WHERE event = 'redispatched' "
        "AND observer_id = ANY($1)",
        ids,
        one=True,
    )
    assert redispatched == 0, "a start was left for the leader's audit to find"
    # One unacked delivery per running observer: none is held unsettled beside them.
    await wait_for(
        lambda: _value(queue_counts(cluster.prefix) == (0, len(ids))),
        timeout=5,
        what="one unacked start per observer",
    )
    assert_no_overlap(cluster.tick_dir)


async def _value(v: bool) -> bool:
    return v


@pytest.mark.processes
async def test_a_kind_that_blocks_the_loop_is_failed_and_moves_its_neighbours_once(
    cluster: Cluster,
) -> None:
    """A kind that blocks the event loop past the lease costs its service the lease once (its
    neighbours move once); it is then failed with the reason, wherever it would have gone."""
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=10)
    neighbours = await cluster.create_recorders(4)
    await cluster.wait_all_running(neighbours, timeout=15)
    await cluster.start_service("b", worker_count=10)
    body = await cluster.create("blocker", "blocker", block=cluster.lease_ttl + 1, every=0.5)
    blocker = uuid.UUID(body["id"])
    await cluster.wait_status(blocker, "failed", timeout=30)
    row = await cluster.observer(blocker)
    assert "blocked the event loop for" in row["last_error"]
    await quiet(cluster.lease_ttl * 3, "the blocker would land on a service again")
    takes = await cluster.q(
        "SELECT observer_id, count(*) AS n FROM observer_events WHERE event = 'taken' "
        "AND observer_id = ANY($1) GROUP BY observer_id",
        neighbours,
    )
    assert max(r["n"] for r in takes) <= 2, "a neighbour was moved more than once"
    await cluster.wait_all_running(neighbours, timeout=10, fresh_after=time.time())
    assert_no_overlap(cluster.tick_dir)


def _ticking(cluster: Cluster, ids: list[uuid.UUID], after: float) -> set[str]:
    """Which of these observers ticked after ``after`` (epoch seconds), by their tick logs."""
    wanted = {str(i) for i in ids}
    return {t.observer for t in read_ticks(cluster.tick_dir) if t.at > after} & wanted


async def test_a_deleted_work_queue_loses_no_observer(cluster: Cluster) -> None:
    """``rabbitmqctl delete_queue`` of the work queue: every service's consumer is cancelled by
    the broker. Each consumes again (the queue declared again), observers created afterwards
    run, and a service drained afterwards hands its observers over (their starts published
    anew, not nacked into the deleted queue); none runs twice."""
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=12)
    b = await cluster.start_service("b", worker_count=12)
    old = await cluster.create_recorders(6)
    await cluster.wait_all_running(old, timeout=15)
    await asyncio.to_thread(rabbitmqctl, "delete_queue", f"{cluster.prefix}.work")
    deleted_at = time.time()
    new = []
    for i in range(4):
        body = await cluster.create(
            f"new-{i}", "recorder", dir=str(cluster.tick_dir), interval=0.05
        )
        new.append(uuid.UUID(body["id"]))
    every = [*old, *new]

    async def all_ticking(after: float) -> bool:
        return _ticking(cluster, every, after) == {str(i) for i in every}

    await wait_for(
        lambda: all_ticking(time.time() - 0.5), timeout=15, what="every observer ticking"
    )
    ran_at = time.time()
    a_id = await cluster.service_id(a)
    async with cluster.api() as c:
        assert (await c.post(f"/services/{a_id}/drain")).status_code == 202
    b_id = await cluster.service_id(b)
    await cluster.wait_all_running(every, timeout=15, on={b_id}, fresh_after=time.time())
    await wait_for(
        lambda: all_ticking(time.time() - 0.5), timeout=15, what="every observer ticking"
    )
    assert_no_overlap(cluster.tick_dir)
    print(f"all {len(every)} observers ticking {ran_at - deleted_at:.2f} s after the delete")


IDLE_IN_TX = (
    "SELECT coalesce(max(extract(epoch FROM clock_timestamp() - state_change)), 0) "
    "FROM pg_stat_activity WHERE datname = current_database() "
    "AND state = 'idle in transaction'"
)


@pytest.mark.processes
@pytest.mark.alone
async def test_a_memory_alarm_stops_neither_the_sweeper_nor_the_api(cluster: Cluster) -> None:
    """With publishers blocked by a memory alarm, no manager transaction waits on the broker
    (none idle in transaction for more than 2 s), create answers promptly, and the observers
    of a service SIGKILLed during the alarm run on the other one once it clears."""
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=10)
    b = await cluster.start_service("b", worker_count=10)
    ids = await cluster.create_recorders(4)
    await cluster.wait_all_running(ids, timeout=15)
    db = await cluster.connect()
    longest = 0.0
    with memory_alarm():
        a.signal(signal.SIGKILL)
        began = time.monotonic()
        async with cluster.api() as c:
            r = await c.post(
                "/observers",
                json={"name": "late", "kind": "recorder", "params": {"dir": str(cluster.tick_dir)}},
            )
        created_in = time.monotonic() - began
        assert r.status_code == 201, r.text
        ids.append(uuid.UUID(r.json()["id"]))
        while time.monotonic() - began < 8:
            longest = max(longest, float(await db.fetchval(IDLE_IN_TX)))
            await asyncio.sleep(0.05)
    cleared = time.time()
    print(f"create answered in {created_in:.2f} s; longest idle in transaction {longest:.2f} s")
    assert created_in < 5, f"create took {created_in:.1f} s during the alarm"
    assert longest < 2, f"a transaction sat idle for {longest:.1f} s during the alarm"
    b_id = await cluster.service_id(b)
    await cluster.wait_all_running(ids, timeout=15, on={b_id}, fresh_after=cleared)
    assert_no_overlap(cluster.tick_dir)
