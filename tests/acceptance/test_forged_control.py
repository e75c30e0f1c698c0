"""Control messages published by hand on the real control exchange of a running cluster: what
the database does not confirm changes nothing (judged from the recorders' own tick logs and
the broker), and the real drain, delete and move still take their usual time."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest

from orch_bench.ticklog import overlap_seconds, read_ticks
from orch_contracts.messages import (
    CancelMessage,
    DirectedStart,
    DrainMessage,
    HandoffMessage,
    Message,
    StartMessage,
    UndrainMessage,
)
from orch_contracts.topology import Topology
from tests.support.cluster import Cluster, Proc, quiet, wait_for


class Forger:
    """Anyone with an account on the broker: publishes straight to the control exchange, or to
    one service's control queue."""

    def __init__(self, channel: aio_pika.abc.AbstractChannel, prefix: str) -> None:
        self.channel = channel
        self.topology = Topology(prefix)

    async def broadcast(self, message: Message) -> None:
        exchange = await self.channel.get_exchange(self.topology.control_exchange)
        await exchange.publish(aio_pika.Message(message.to_bytes()), routing_key="")

    async def to(self, service_id: uuid.UUID, message: Message) -> None:
        await self.channel.default_exchange.publish(
            aio_pika.Message(message.to_bytes()),
            routing_key=self.topology.control_queue(service_id),
        )

    async def consumers(self) -> int:
        """Consumers of the work queue now (a draining service has none)."""
        queue = await self.channel.declare_queue(self.topology.work_queue, passive=True)
        assert queue.declaration_result.consumer_count is not None
        return int(queue.declaration_result.consumer_count)


@pytest.fixture
async def forger(cluster: Cluster) -> AsyncIterator[Forger]:
    connection = await aio_pika.connect(cluster.amqp_url)
    try:
        yield Forger(await connection.channel(), cluster.prefix)
    finally:
        await connection.close()


async def _ignored(proc: Proc, n: int) -> None:
    """The service logged ``n`` control messages it did not act on."""

    async def logged() -> bool:
        return proc.tail(2000).count("the database does not confirm it") >= n

    await wait_for(logged, timeout=10, what=f"{n} control messages ignored")


async def _epochs(cluster: Cluster, ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[int, str]]:
    rows = await cluster.q(
        "SELECT id, epoch, status, service_id FROM observers WHERE id = ANY($1)", ids
    )
    return {r["id"]: (r["epoch"], r["status"]) for r in rows}


@pytest.mark.processes
async def test_forged_drain_cancel_handoff_and_start_change_nothing(
    cluster: Cluster, forger: Forger
) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=10)
    ids = await cluster.create_recorders(4, interval=0.05)
    await cluster.wait_all_running(ids, timeout=15)
    b = await cluster.start_service("b", worker_count=10)
    a_id, b_id = await cluster.service_id(a), await cluster.service_id(b)

    async def both_consume() -> bool:  # b joins the database before it consumes
        return await forger.consumers() == 2

    await wait_for(both_consume, timeout=10, what="both services consuming the work queue")
    epochs = await _epochs(cluster, ids)
    assert {e for e, _ in epochs.values()} == {1}

    forged_at = time.time()
    await forger.broadcast(DrainMessage(service_id=a_id))
    for oid in ids:
        for _ in range(5):
            await forger.broadcast(CancelMessage(observer_id=oid))
        await forger.to(a_id, HandoffMessage(observer_id=oid, to=b_id))
        row = await cluster.observer(oid)
        start = StartMessage(observer_id=oid, dispatch_id=row["dispatch_id"])
        await forger.to(b_id, DirectedStart.of(start))  # the current dispatch id, even
    await _ignored(a, 1 + 5 * len(ids) + len(ids))
    await quiet(1.0, "a stopped copy would show here as a new epoch or a gap")

    assert await _epochs(cluster, ids) == epochs, "an observer was released or taken again"
    assert await forger.consumers() == 2, "a stopped consuming"
    async with cluster.api() as c:
        a_row = next(s for s in (await c.get("/services")).json() if s["id"] == str(a_id))
    assert a_row["draining"] is False
    ticks = read_ticks(cluster.tick_dir)
    for oid in ids:
        mine = [t for t in ticks if t.observer == str(oid)]
        assert {t.copy for t in mine} == {(1, a.pid)}, f"{oid} ran as another copy"
        after = [t.at for t in mine if t.at > forged_at]
        assert len(after) > 10, f"{oid} stopped ticking"
        assert max(y - x for x, y in itertools.pairwise(after)) < 0.5
    assert overlap_seconds(ticks) == {}
    # New work still reaches a: b is drained for real, and what it gets lands on a.
    async with cluster.api() as c:
        assert (await c.post(f"/services/{b_id}/drain")).status_code == 202
    late = uuid.UUID((await cluster.create("after-forgery", interval=0.05))["id"])
    await cluster.wait_all_running([late], timeout=5, on={a_id})


async def test_a_forged_undrain_leaves_a_drained_service_drained(
    cluster: Cluster, forger: Forger
) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=10)
    b = await cluster.start_service("b", worker_count=10)
    a_id, b_id = await cluster.service_id(a), await cluster.service_id(b)
    async with cluster.api() as c:
        assert (await c.post(f"/services/{a_id}/drain")).status_code == 202

    async def drained() -> bool:
        return await forger.consumers() == 1

    await wait_for(drained, timeout=5, what="a drained")
    await forger.broadcast(UndrainMessage(service_id=a_id))
    await _ignored(a, 1)
    assert await forger.consumers() == 1, "a consumes again"
    ids = await cluster.create_recorders(3, interval=0.05)
    await cluster.wait_all_running(ids, timeout=10, on={b_id})


async def test_a_real_delete_and_drain_take_their_usual_time_after_forgeries(
    cluster: Cluster, forger: Forger
) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=10)
    ids = await cluster.create_recorders(4, interval=0.05)
    await cluster.wait_all_running(ids, timeout=15)
    b = await cluster.start_service("b", worker_count=10)
    a_id, b_id = await cluster.service_id(a), await cluster.service_id(b)
    await forger.broadcast(CancelMessage(observer_id=ids[0]))
    await _ignored(a, 1)
    started = time.monotonic()
    async with cluster.api() as c:
        assert (await c.delete(f"/observers/{ids[0]}")).status_code == 202
    await cluster.wait_status(ids[0], "deleted", timeout=5)
    deleted_in = time.monotonic() - started
    started = time.monotonic()
    async with cluster.api() as c:
        assert (await c.post(f"/services/{a_id}/drain")).status_code == 202
    await cluster.wait_all_running(ids[1:], timeout=5, on={b_id}, fresh_after=time.time())
    drained_in = time.monotonic() - started
    print(f"delete {deleted_in * 1000:.0f} ms, drain of 3 {drained_in * 1000:.0f} ms")
    assert deleted_in < 1.0
    assert drained_in < 2.0
    assert overlap_seconds(read_ticks(cluster.tick_dir)) == {}
