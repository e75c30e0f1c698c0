"""On a three-node RabbitMQ cluster with a quorum work queue: observers run, move and stop as on
one broker, and the loss of the node that leads the work queue stops none of them and runs
none twice. The cluster is the test's own (extra nodes of the installed server, on ports of
their own); the machine's broker is not touched.

Judged from the observers' own tick logs."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from orch_bench import rabbit_cluster
from orch_bench.rabbit_cluster import RabbitCluster
from orch_bench.ticklog import largest_gaps, read_ticks
from tests.conftest import Servers
from tests.support.cluster import Cluster, quiet, wait_for
from tests.support.faults import assert_no_overlap

#: It needs the machine, or the shared servers, to itself.
pytestmark = pytest.mark.alone

#: The largest tick gap a running observer may show through the loss of a broker node, seconds.
MAX_GAP = 1.0


@pytest.fixture(scope="module")
def rabbit() -> Iterator[RabbitCluster]:
    why = rabbit_cluster.available()
    if why is not None:
        pytest.skip(f"no local RabbitMQ cluster can be started: {why}")
    cluster = RabbitCluster(size=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def on_quorum(
    servers: Servers, rabbit: RabbitCluster, database_url: str, prefix: str, tmp_path: Path
) -> AsyncIterator[Cluster]:
    c = Cluster(
        database_url=database_url, amqp_url=rabbit.amqp_url, prefix=prefix, workdir=tmp_path
    )
    c.env["ORCH_QUEUE_TYPE"] = "quorum"
    await c.connect()
    try:
        yield c
    finally:
        await c.stop()


def work_queue(rabbit: RabbitCluster, prefix: str) -> dict[str, Any]:
    return rabbit.queue(f"{prefix}.work")


async def test_observers_run_move_and_stop_on_a_quorum_queue(
    on_quorum: Cluster, rabbit: RabbitCluster, prefix: str
) -> None:
    c = on_quorum
    await c.start_manager(amqp_url=rabbit.first(rabbit.nodes[0]))
    await c.start_service("a", worker_count=10, amqp_url=rabbit.first(rabbit.nodes[1]))
    b = await c.start_service("b", worker_count=10, amqp_url=rabbit.first(rabbit.nodes[2]))
    queue = work_queue(rabbit, prefix)
    assert queue["type"] == "quorum"
    assert len(queue["members"]) == 3
    ids = await c.create_recorders(8)
    await c.wait_all_running(ids, timeout=30)
    async with c.api() as api:
        r = await api.delete(f"/observers/{ids[0]}")
        assert r.status_code in (200, 202), r.text
    await c.wait_status(ids[0], "deleted", timeout=20)
    killed_at = time.time()
    b.signal(signal.SIGKILL)
    await c.wait_all_running(ids[1:], timeout=30, fresh_after=killed_at)
    await quiet(1.0, "a second copy would tick")
    assert_no_overlap(c.tick_dir)
    late = [t for t in read_ticks(c.tick_dir) if t.observer == str(ids[0]) and t.at > killed_at]
    assert late == [], "a deleted observer ran again"


@pytest.mark.parametrize("how", ["stop_app", "kill"])
async def test_losing_the_node_that_leads_the_work_queue_stops_no_observer(
    on_quorum: Cluster, rabbit: RabbitCluster, prefix: str, how: str
) -> None:
    """The node is stopped (``stop_app``: its connections closed) or killed (SIGKILL of its VM:
    a machine lost). Services on its connections reconnect to a survivor and their observers go
    on under the lease; services on the survivors never notice. None runs twice, none is lost,
    a delete accepted during the loss completes, and the node rejoins when it comes back."""
    c = on_quorum
    await c.start_manager(amqp_url=rabbit.first(rabbit.nodes[0]))
    lost = rabbit.node(work_queue(rabbit, prefix)["leader"])
    survivor = next(n for n in rabbit.nodes if n is not lost)
    on_lost = await c.start_service("on-lost", worker_count=10, amqp_url=rabbit.first(lost))
    await c.start_service("on-survivor", worker_count=10, amqp_url=rabbit.first(survivor))
    ids = await c.create_recorders(12)
    await c.wait_all_running(ids, timeout=30)
    doomed, kept = ids[0], ids[1:]
    lost_at = time.time()
    if how == "kill":
        await asyncio.to_thread(rabbit.kill, lost)
    else:
        await asyncio.to_thread(rabbit.ctl, lost, "stop_app")
    try:
        await on_lost.wait_log("broker session 1 closed", timeout=15)
        await quiet(2.0, "observers would stop while the node is lost")
        async with c.api() as api:
            r = await api.delete(f"/observers/{doomed}")
            assert r.status_code in (200, 202), r.text
        deleted_at = time.time()
        await c.wait_status(doomed, "deleted", timeout=30)
        await quiet(3.0, "a second copy would tick")
    finally:
        if how == "kill":
            await asyncio.to_thread(rabbit.start_node, lost)
        else:
            await asyncio.to_thread(rabbit.ctl, lost, "start_app")
    await asyncio.to_thread(rabbit.wait_running, 3)
    end = time.time()
    wanted = {str(i) for i in kept}
    gaps = {
        o: round(g, 3)
        for o, g in largest_gaps(read_ticks(c.tick_dir), lost_at, end).items()
        if o in wanted
    }
    logs = "".join(p.log.read_text(errors="replace") for p in c.procs if p.log is not None)
    adopted, duplicates = logs.count("adopted its redelivered start"), logs.count("drop: duplicate")
    print(
        f"node loss ({how}): largest tick gaps {sorted(gaps.values())[-3:]} s; redelivered "
        f"starts adopted {adopted}, dropped as duplicates {duplicates}"
    )
    assert {o: g for o, g in gaps.items() if g > MAX_GAP} == {}, "observers stopped"
    assert_no_overlap(c.tick_dir)
    late = [t for t in read_ticks(c.tick_dir) if t.observer == str(doomed) and t.at > deleted_at]
    assert [t for t in late if t.at > deleted_at + 2.5] == [], "a deleted observer ran on"
    await c.wait_all_running(kept, timeout=20, fresh_after=end)
    assert all(p.alive for p in c.procs)
    # The cluster healed: the work queue has its three members online again, and new work runs.
    await wait_for(
        lambda: _online(rabbit, prefix, 3), timeout=60, what="the work queue's three members"
    )
    fresh = await c.create_recorders(1)
    await c.wait_all_running(fresh, timeout=20)


async def _online(rabbit: RabbitCluster, prefix: str, n: int) -> bool:
    queue = await asyncio.to_thread(work_queue, rabbit, prefix)
    return len(queue["online"]) == n
