"""Rebalance on join, weighted shares, drain before scale-down, no ping-pong."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sys
import time
import uuid
from typing import Any

import aio_pika
import httpx
import pytest

from orch_bench.ticklog import overlap_seconds, read_ticks
from orch_contracts.topology import Topology, service_present
from tests.support.cluster import Cluster, quiet, wait_for
from tests.support.faults import via

FAST: dict[str, Any] = {"rebalance": "true", "rebalance_min_age": "2", "rebalance_interval": "0.3"}


async def counts(cluster: Cluster) -> dict[uuid.UUID, int]:
    rows = await cluster.q(
        "SELECT s.id, count(o.id) AS n FROM services s LEFT JOIN observers o "
        "ON o.service_id = s.id AND o.status = 'processing' WHERE NOT s.is_deleted "
        "GROUP BY s.id"
    )
    return {r["id"]: r["n"] for r in rows}


async def moves_per_observer(cluster: Cluster) -> collections.Counter[uuid.UUID]:
    rows = await cluster.q(
        "SELECT observer_id FROM observer_events WHERE event = 'handoff requested'"
    )
    return collections.Counter(r["observer_id"] for r in rows)


@pytest.mark.processes
async def test_join_reaches_fair_share_without_overlap(cluster: Cluster) -> None:
    await cluster.start_manager(**FAST)
    for name in ("a", "b", "c"):
        await cluster.start_service(name, worker_count=40)
    ids = await cluster.create_recorders(90, interval=0.1)
    await cluster.wait_all_running(ids, timeout=30)

    async def even() -> bool:  # a, b and c first even out what the work queue left uneven
        return sorted((await counts(cluster)).values()) == [30, 30, 30]

    await wait_for(even, timeout=20, what="a, b and c at 30 each")
    await quiet(1.0, "moves still landing would change the baseline")
    before = await moves_per_observer(cluster)
    d = await cluster.start_service("d", worker_count=40)
    d_id = await cluster.service_id(d)
    joined = time.monotonic()

    async def fair() -> bool:
        c = await counts(cluster)
        return len(c) == 4 and all(n in (22, 23) for n in c.values()) and c.get(d_id, 0) > 0

    await wait_for(fair, timeout=30, what="every service at 22 or 23")
    took = time.monotonic() - joined
    await cluster.wait_all_running(ids, timeout=10)
    await quiet(1.5, "a second round would move observers again")
    assert all(n in (22, 23) for n in (await counts(cluster)).values())
    moved = await moves_per_observer(cluster) - before
    assert 22 <= sum(moved.values()) <= 23, moved
    assert max((moved + before).values()) == 1, "an observer moved twice"
    assert overlap_seconds(read_ticks(cluster.tick_dir)) == {}
    # Each moved observer resumed from its checkpoint, on d.
    for oid in moved:
        row = await cluster.observer(oid)
        assert row["service_id"] == d_id
        assert await cluster.checkpoint_count(oid) > 1
    assert took < 30


async def test_shares_follow_worker_counts(cluster: Cluster) -> None:
    await cluster.start_manager(**FAST)
    small = await cluster.start_service("small", worker_count=10)
    for i in range(20):
        await cluster.create(f"t{i}", interval=0.2)
    await wait_for(
        lambda: cluster.q(
            "SELECT count(*) = 10 FROM observers WHERE service_id IS NOT NULL", one=True
        ),
        timeout=15,
        what="small service full",
    )
    big = await cluster.start_service("big", worker_count=30)
    small_id, big_id = await cluster.service_id(small), await cluster.service_id(big)

    async def weighted() -> bool:
        c = await counts(cluster)
        return c.get(small_id) == 5 and c.get(big_id) == 15

    await wait_for(weighted, timeout=30, what="shares 5 and 15")


@pytest.mark.processes
async def test_drain_moves_everything_then_stop_moves_nothing(cluster: Cluster) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=20)
    ids = await cluster.create_recorders(10, interval=0.05)
    await cluster.wait_all_running(ids, timeout=15)
    b = await cluster.start_service("b", worker_count=20)
    a_id, b_id = await cluster.service_id(a), await cluster.service_id(b)
    before = {i: await cluster.checkpoint_count(i) for i in ids}
    async with cluster.api() as c:
        r = await c.post(f"/services/{a_id}/drain")
        assert r.status_code == 202, r.text
        assert r.json()["draining"] is True
        assert (await c.post(f"/services/{uuid.uuid4()}/drain")).status_code == 404
    started = time.monotonic()
    await cluster.wait_all_running(ids, timeout=10, on={b_id}, fresh_after=time.time())
    assert time.monotonic() - started < 2, "a drain is one handoff per observer, not a wait"
    for i in ids:
        assert await cluster.checkpoint_count(i) >= before[i], "not resumed from its checkpoint"
    # A new observer does not land on the draining service.
    new = uuid.UUID((await cluster.create("after-drain", interval=0.05))["id"])
    await cluster.wait_all_running([new], timeout=10, on={b_id})
    epochs = {
        r["id"]: r["epoch"]
        for r in await cluster.q("SELECT id, epoch FROM observers WHERE id = ANY($1)", ids)
    }
    a.signal(signal.SIGTERM)
    await asyncio.to_thread(a.popen.wait, 15)
    await quiet(0.5, "a moved observer would move again")
    after = {
        r["id"]: r["epoch"]
        for r in await cluster.q("SELECT id, epoch FROM observers WHERE id = ANY($1)", ids)
    }
    assert after == epochs, "stopping the drained service moved observers again"
    assert overlap_seconds(read_ticks(cluster.tick_dir)) == {}


@pytest.mark.processes
async def test_flapping_service_causes_no_ping_pong(cluster: Cluster) -> None:
    await cluster.start_manager(**{**FAST, "rebalance_min_age": "3"})
    await cluster.start_service("a", worker_count=30)
    await cluster.start_service("b", worker_count=30)
    ids = await cluster.create_recorders(20, interval=0.1)
    await cluster.wait_all_running(ids, timeout=15)

    async def settled() -> bool:  # a and b even out whatever the work queue left uneven
        return sorted((await counts(cluster)).values()) == [10, 10]

    await wait_for(settled, timeout=20, what="a and b at 10 each")
    await quiet(1.0, "moves still landing would change the baseline")
    baseline = sum((await moves_per_observer(cluster)).values())
    epochs = {
        r["id"]: r["epoch"]
        for r in await cluster.q("SELECT id, epoch FROM observers WHERE id = ANY($1)", ids)
    }
    for i in range(3):
        flap = await cluster.start_service(f"flap{i}", worker_count=30)
        await quiet(1.0, "a flapping service would receive moves")
        flap.signal(signal.SIGTERM)
        await asyncio.to_thread(flap.popen.wait, 15)
    await quiet(1.0, "observers would ping-pong")
    assert sum((await moves_per_observer(cluster)).values()) == baseline
    now = {
        r["id"]: r["epoch"]
        for r in await cluster.q("SELECT id, epoch FROM observers WHERE id = ANY($1)", ids)
    }
    assert now == epochs, "observers moved because a service flapped"


@pytest.mark.processes
async def test_a_service_back_from_a_partition_gets_its_share(cluster: Cluster) -> None:
    """Cut off from the broker with its lease held in PostgreSQL, then healed: within a round
    and the minimum age of its control queue reappearing (plus the rounds the pace needs), it
    runs its share again. Before, every handoff planned to it during the cut bounced to the work
    queue yet put its observer under the cooldown (600 s); once all had bounced, no round could
    move anything to it."""
    interval, min_age = float(FAST["rebalance_interval"]), float(FAST["rebalance_min_age"])
    await cluster.start_manager(**FAST)
    proxy = await cluster.proxy(cluster.amqp_url)
    for name in ("a", "b"):
        await cluster.start_service(name, worker_count=20, amqp_heartbeat=2)
    c = await cluster.start_service(
        "c", worker_count=20, amqp_url=via(cluster.amqp_url, proxy), amqp_heartbeat=2
    )
    c_id = await cluster.service_id(c)
    ids = await cluster.create_recorders(30, interval=0.2)
    await cluster.wait_all_running(ids, timeout=30)

    async def fair() -> bool:
        n = await counts(cluster)
        return n.get(c_id) == 10 and sorted(n.values()) == [10, 10, 10]

    await wait_for(fair, timeout=20, what="a, b and c at 10 each")
    topology = Topology(cluster.prefix)
    async with await aio_pika.connect(cluster.amqp_url) as broker:

        async def c_on_broker() -> bool:
            return await service_present(broker, topology, c_id)

        async def c_off_broker() -> bool:
            return not await c_on_broker()

        proxy.cut()
        await wait_for(c_off_broker, timeout=20, what="c off the broker")
        await quiet(10.0, "rounds would hand observers to c, each bouncing to the work queue")
        proxy.heal()
        await wait_for(c_on_broker, timeout=20, what="c back on the broker")
    rounds = 4  # three moves a round (pace 0.1 of 30) for c's ten
    await wait_for(
        fair, timeout=interval + min_age + rounds * interval + 3.0, what="c back at its share"
    )
    await cluster.wait_all_running(ids, timeout=10)
    assert c.alive


async def test_drain_cli(cluster: Cluster) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=5)
    await cluster.start_service("b", worker_count=5)
    a_id = await cluster.service_id(a)
    api = f"http://127.0.0.1:{cluster.api_port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "orch",
        "services",
        "drain",
        str(a_id),
        "--api",
        api,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "ORCH_TOKEN": cluster.token or ""},
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out
    assert b"draining a" in out
    async with httpx.AsyncClient(headers=cluster.auth_headers) as c:
        services = (await c.get(f"{api}/services")).json()
    assert next(s for s in services if s["id"] == str(a_id))["draining"] is True
