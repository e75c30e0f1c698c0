"""Observers start, run, stop, fail and move, with real manager and service processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import aio_pika
import pytest

from orch_bench.ticklog import Tick, read_ticks
from orch_contracts.messages import StartMessage
from tests.support.cluster import Cluster, quiet, wait_for
from tests.support.faults import assert_no_overlap, queue_counts


async def test_create_runs_and_checkpoints_advance(cluster: Cluster) -> None:
    await cluster.start_manager()
    svc = await cluster.start_service("a", worker_count=4)
    body = await cluster.create("t1", interval=0.05)
    assert body["status"] == "created"
    oid = body["id"]

    async def processing() -> bool:
        row = await cluster.observer(oid)
        return bool(
            row["status"] == "processing" and row["service_id"] == await cluster.service_id(svc)
        )

    await wait_for(processing, timeout=10, what="processing")
    first = await cluster.checkpoint_count(oid)
    await wait_for(lambda: _gt(cluster, oid, first + 3), timeout=10, what="checkpoint advancing")
    async with cluster.api() as c:
        got = (await c.get(f"/observers/{oid}")).json()
    assert got["status"] == "processing"
    assert got["epoch"] == 1
    assert got["checkpoint"]["count"] > first


async def _gt(cluster: Cluster, oid: str, n: int) -> bool:
    return await cluster.checkpoint_count(oid) > n


async def test_delete_stops_the_task_and_acks_the_message(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=2)
    oid = (await cluster.create("t1", interval=0.05))["id"]
    await cluster.wait_all_running([uuid.UUID(oid)], timeout=10)
    assert queue_counts(cluster.prefix) == (0, 1)
    async with cluster.api() as c:
        r = await c.delete(f"/observers/{oid}")
        assert r.status_code == 202
        assert r.json()["status"] in ("on_deleting", "deleted")

    await cluster.wait_status(oid, "deleted", timeout=10)
    stopped_at = await cluster.checkpoint_count(oid)
    await quiet(0.3, "a running copy would tick 6 times")
    assert await cluster.checkpoint_count(oid) == stopped_at
    await wait_for(
        lambda: _async(queue_counts(cluster.prefix) == (0, 0)), timeout=10, what="queue empty"
    )
    async with cluster.api() as c:
        again = await c.delete(f"/observers/{oid}")
    assert again.status_code == 202
    assert again.json()["status"] == "deleted"


async def _async(value: bool) -> bool:
    return value


async def test_capacity_and_delete_of_a_waiting_observer(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=2)
    ids = [(await cluster.create(f"t{i}", interval=0.05))["id"] for i in range(3)]

    async def two_running() -> list[str]:
        rows = await cluster.q(
            "SELECT id::text FROM observers WHERE status = 'processing' AND service_id IS NOT NULL"
        )
        return [r[0] for r in rows] if len(rows) == 2 else []

    running = await wait_for(two_running, timeout=10, what="two running")
    await quiet(0.5, "a third would start beyond the worker count")
    assert len(await two_running()) == 2, "a service ran more than its worker_count"
    waiting = next(i for i in ids if i not in running)
    assert (await cluster.observer(waiting))["status"] == "created"

    # Deleting the waiting one: it never runs and ends deleted.
    async with cluster.api() as c:
        r = await c.delete(f"/observers/{waiting}")
    assert r.json()["status"] == "deleted"
    # Deleting a running one frees a slot; the stale start message of the deleted one is
    # consumed and dropped rather than run.
    async with cluster.api() as c:
        await c.delete(f"/observers/{running[0]}")
    await wait_for(
        lambda: _async(queue_counts(cluster.prefix) == (0, 1)),
        timeout=15,
        what="only the remaining observer's message left",
    )
    row = await cluster.observer(waiting)
    assert row["status"] == "deleted"
    assert row["epoch"] == 0, "the deleted observer ran"


async def test_freed_slot_starts_the_waiting_observer(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=2)
    ids = [(await cluster.create(f"t{i}", interval=0.05))["id"] for i in range(3)]
    await wait_for(
        lambda: cluster.q(
            "SELECT count(*) = 2 FROM observers WHERE status = 'processing'", one=True
        ),
        timeout=10,
        what="two running",
    )
    first_running = await cluster.q(
        "SELECT id::text FROM observers WHERE status = 'processing' LIMIT 1", one=True
    )
    async with cluster.api() as c:
        await c.delete(f"/observers/{first_running}")
    others = [uuid.UUID(i) for i in ids if i != first_running]
    await cluster.wait_all_running(others, timeout=10)


@pytest.mark.processes
async def test_sigkill_moves_observers_resumed_from_checkpoint(cluster: Cluster) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=10)
    ids = [uuid.UUID((await cluster.create(f"t{i}", interval=0.05))["id"]) for i in range(6)]
    await cluster.wait_all_running(ids, timeout=10)
    b = await cluster.start_service("b", worker_count=10)
    b_id = await cluster.service_id(b)
    before = {i: await cluster.checkpoint_count(i) for i in ids}
    killed_at = time.time()
    a.signal(signal.SIGKILL)
    await cluster.wait_all_running(ids, timeout=15, on={b_id}, fresh_after=killed_at)
    for i in ids:
        assert await cluster.checkpoint_count(i) >= before[i], "resumed from zero"
        assert (await cluster.observer(i))["epoch"] == 2


@pytest.mark.processes
async def test_sigterm_hands_observers_over_at_once(cluster: Cluster) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=10)
    ids = [uuid.UUID((await cluster.create(f"t{i}", interval=0.05))["id"]) for i in range(5)]
    await cluster.wait_all_running(ids, timeout=10)
    b = await cluster.start_service("b", worker_count=10)
    b_id = await cluster.service_id(b)
    assert a.log is not None
    logged = len(a.log.read_text(errors="replace"))
    start = time.monotonic()
    a.signal(signal.SIGTERM)
    # Well under the lease TTL: nobody waited for a lease to expire.
    await cluster.wait_all_running(
        ids, timeout=cluster.lease_ttl * 0.75, on={b_id}, fresh_after=time.time()
    )
    assert time.monotonic() - start < cluster.lease_ttl
    await asyncio.to_thread(a.popen.wait, 10)
    assert a.popen.returncode == 0
    assert await cluster.q("SELECT is_deleted FROM services WHERE pid = $1", a.pid, one=True)
    # A clean stop warns of nothing: the broker session it closed itself is no trouble.
    stop = a.log.read_text(errors="replace")[logged:]
    warned = [line for line in stop.splitlines() if " WARNING " in line or " ERROR " in line]
    assert not warned, warned


async def test_duplicate_start_message_is_dropped(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=5)
    await cluster.start_service("b", worker_count=5)
    oid = uuid.UUID((await cluster.create("t1", interval=0.05))["id"])
    await cluster.wait_all_running([oid], timeout=10)
    row = await cluster.observer(oid)
    conn = await aio_pika.connect(cluster.amqp_url)
    async with conn:
        ch = await conn.channel()
        body = StartMessage(observer_id=oid, dispatch_id=row["dispatch_id"]).to_bytes()
        for _ in range(3):
            await ch.default_exchange.publish(
                aio_pika.Message(body), routing_key=f"{cluster.prefix}.work"
            )
    await wait_for(
        lambda: _async(queue_counts(cluster.prefix) == (0, 1)),
        timeout=10,
        what="duplicates consumed",
    )
    row2 = await cluster.observer(oid)
    assert row2["epoch"] == row["epoch"] == 1
    assert row2["service_id"] == row["service_id"]


async def test_malformed_message_goes_to_the_error_queue(cluster: Cluster) -> None:
    await cluster.start_manager()
    svc = await cluster.start_service("a", worker_count=2)
    conn = await aio_pika.connect(cluster.amqp_url)
    async with conn:
        ch = await conn.channel()
        await ch.default_exchange.publish(
            aio_pika.Message(b"{not json"), routing_key=f"{cluster.prefix}.work"
        )
        errors = await ch.declare_queue(f"{cluster.prefix}.errors", passive=True)

        async def in_errors() -> bool:
            q = await ch.declare_queue(f"{cluster.prefix}.errors", passive=True)
            return (q.declaration_result.message_count or 0) == 1

        await wait_for(in_errors, timeout=10, what="message dead-lettered")
        msg = await errors.get(timeout=5)
        assert msg.body == b"{not json"
        await msg.ack()
    assert svc.alive
    oid = uuid.UUID((await cluster.create("after", interval=0.05))["id"])
    await cluster.wait_all_running([oid], timeout=10)


async def test_failing_kind_restarts_then_fails_then_restarts_by_api(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=2)
    oid = (await cluster.create("bad", kind="always_fails"))["id"]
    await cluster.wait_status(oid, "failed", timeout=15)
    row = await cluster.observer(oid)
    assert row["restart_count"] == 2
    assert "boom" in row["last_error"]
    assert row["service_id"] is None
    events = [
        r["event"]
        for r in await cluster.q(
            "SELECT event FROM observer_events WHERE observer_id = $1 ORDER BY id", uuid.UUID(oid)
        )
    ]
    assert events.count("restarted") == 2
    assert events[-1] == "failed"
    # Its start message went to the error queue.
    conn = await aio_pika.connect(cluster.amqp_url)
    async with conn:
        ch = await conn.channel()
        q = await ch.declare_queue(f"{cluster.prefix}.errors", passive=True)
        assert q.declaration_result.message_count == 1
    async with cluster.api() as c:
        r = await c.post(f"/observers/{oid}/restart")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "created"
        again = await c.post(f"/observers/{oid}/restart")
        assert again.status_code == 409

    async def taken_again() -> bool:
        return bool((await cluster.observer(oid))["epoch"] > row["epoch"])

    await wait_for(taken_again, timeout=10, what="restarted observer taken")
    await cluster.wait_status(oid, "failed", timeout=15)
    assert (await cluster.observer(oid))["restart_count"] == 2


async def test_row_committed_without_publish_is_not_lost(cluster: Cluster) -> None:
    """The manager dies right after its commit: the outbox record brings the observer up."""
    from orch_manager import repository
    from orch_manager.settings import ManagerSettings
    from orch_manager.store import ManagerStore

    store = ManagerStore(ManagerSettings(database_url=cluster.database_url, auth="disabled"))
    await store.open()
    async with store.transaction() as tx:
        row, _pending = await repository.create_observer(
            tx, repository.NewObserver(name="orphan", kind="ticker", params={"interval": 0.05})
        )
    await store.close()
    # No publish happened. Now the cluster comes up: the leader's relay publishes it.
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=2)
    await cluster.wait_all_running([row["id"]], timeout=15)

    async def relayed() -> bool:  # deleted once confirmed, in the relay's next transaction
        return bool(await cluster.q("SELECT count(*) FROM outbox", one=True) == 0)

    await wait_for(relayed, timeout=5, what="the relayed record deleted")


async def test_pause_keeps_the_checkpoint_and_resume_goes_on_from_it(cluster: Cluster) -> None:
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=4)
    oid = (await cluster.create("p1", interval=0.05))["id"]
    await cluster.wait_all_running([uuid.UUID(oid)], timeout=10)
    await wait_for(lambda: _gt(cluster, oid, 5), timeout=10, what="a few ticks")
    async with cluster.api() as c:
        r = await c.post(f"/observers/{oid}/pause")
        assert r.status_code == 202
        assert r.json()["status"] in ("pausing", "paused")

    await cluster.wait_status(oid, "paused", timeout=10)
    kept = await cluster.checkpoint_count(oid)
    assert kept > 5
    await quiet(0.5, "a paused copy would tick on")
    assert await cluster.checkpoint_count(oid) == kept
    async with cluster.api() as c:
        assert (await c.post(f"/observers/{oid}/resume")).status_code == 200
    await wait_for(lambda: _gt(cluster, oid, kept + 3), timeout=10, what="ticks after resume")
    row = await cluster.observer(oid)
    assert row["epoch"] == 2, "resumed as a new copy"


async def test_a_paused_observer_resumes_with_the_params_it_was_given(cluster: Cluster) -> None:
    """Pause, edit, resume: the copy that runs after the resume runs with the new params (its
    ticks go to the directory it was given), none runs before it, and its count goes on from
    the checkpoint. Judged from the recorder's own tick files."""
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=4)
    (oid,) = await cluster.create_recorders(1)
    await cluster.wait_all_running([oid], timeout=10)
    async with cluster.api() as c:
        assert (await c.post(f"/observers/{oid}/pause")).status_code == 202
        await cluster.wait_status(oid, "paused", timeout=10)
        paused_at = time.time()
        moved = cluster.workdir / "edited-ticks"
        r = await c.patch(f"/observers/{oid}", json={"params": {"dir": str(moved)}})
        assert r.status_code == 200, r.text
        assert r.json()["params"]["dir"] == str(moved)
        assert (await c.post(f"/observers/{oid}/resume")).status_code == 200

    async def ticked_there() -> list[Tick]:
        return [t for t in read_ticks(moved) if t.observer == str(oid)] if moved.exists() else []

    there = await wait_for(ticked_there, timeout=10, what="ticks in the new directory")
    assert all(t.epoch == 2 for t in there)
    before = [t for t in read_ticks(cluster.tick_dir) if t.observer == str(oid)]
    assert before, "it ticked before the pause"
    assert all(t.at <= paused_at for t in before), "a copy ran on in the old directory"
    assert there[0].count > before[-1].count - 2, "it started over instead of going on"


@pytest.mark.processes
async def test_a_pause_whose_holder_died_is_completed_by_the_sweeper(cluster: Cluster) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=4)
    oid = (await cluster.create("p2", interval=0.05))["id"]
    await cluster.wait_all_running([uuid.UUID(oid)], timeout=10)
    a.signal(signal.SIGSTOP)
    try:
        async with cluster.api() as c:
            assert (await c.post(f"/observers/{oid}/pause")).json()["status"] == "pausing"

        await cluster.wait_status(oid, "paused", timeout=cluster.lease_ttl + 5)
    finally:
        a.signal(signal.SIGCONT)


async def test_a_service_serves_its_metrics(cluster: Cluster) -> None:
    import httpx

    from orch.cluster import free_port

    await cluster.start_manager()
    port = free_port()
    await cluster.start_service("a", worker_count=4, metrics_port=port)
    oid = uuid.UUID((await cluster.create("m", interval=0.05))["id"])
    await cluster.wait_all_running([oid], timeout=10)

    async def scraped() -> str | None:
        async with httpx.AsyncClient() as c:
            text = (await c.get(f"http://127.0.0.1:{port}/metrics")).text
        return text if "orch_takes_total 1.0" in text else None

    text = await wait_for(scraped, timeout=10, what="the take counted")
    assert "orch_observers_running 1.0" in text
    assert "orch_lease_renewal_seconds_count" in text
    assert "orch_checkpoint_batch_size_bucket" in text


async def test_the_error_queue_keeps_only_its_newest_messages(cluster: Cluster) -> None:
    """A broker policy (set by `orch broker-policy --apply`, removed again after the test)."""
    from tests.support.faults import rabbitmqctl

    await cluster.start_manager()  # declares the queues
    env = {**os.environ, **cluster.env}
    try:
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "orch", "broker-policy", "--max-length", "3", "--apply"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert f"{cluster.prefix}-errors-limit" in await asyncio.to_thread(
            rabbitmqctl, "list_policies"
        )
        conn = await aio_pika.connect(cluster.amqp_url)
        async with conn:
            ch = await conn.channel()
            for i in range(5):
                await ch.default_exchange.publish(
                    aio_pika.Message(str(i).encode()), routing_key=f"{cluster.prefix}.errors"
                )

            async def three() -> bool:
                q = await ch.declare_queue(f"{cluster.prefix}.errors", passive=True)
                return q.declaration_result.message_count == 3

            await wait_for(three, timeout=10, what="the error queue capped at 3")
            first = await (await ch.declare_queue(f"{cluster.prefix}.errors", passive=True)).get()
            assert first.body == b"2", "the oldest went first"
    finally:
        await asyncio.to_thread(rabbitmqctl, "clear_policy", f"{cluster.prefix}-errors-limit")


async def test_a_running_observer_restarts_from_its_checkpoint_never_beside_itself(
    cluster: Cluster,
) -> None:
    """``POST /observers/{id}/restart`` on a running observer: its copy stops (a handoff to its
    own service), and a new copy under the next epoch goes on from the old one's checkpoint,
    after a short gap and never beside it. Judged from the observer's own ticks."""
    await cluster.start_manager()
    await cluster.start_service("a", worker_count=4)
    oid, other = await cluster.create_recorders(2, interval=0.05)
    await cluster.wait_all_running([oid, other], timeout=10)
    before = (await cluster.observer(oid))["epoch"]

    async def ticked(epoch: int) -> list[Tick]:
        ticks = read_ticks(cluster.tick_dir)
        return [t for t in ticks if t.observer == str(oid) and t.epoch == epoch]

    await wait_for(lambda: ticked(before), timeout=10, what="ticks of the first copy")
    asked = time.time()
    async with cluster.api() as c:
        r = await c.post(f"/observers/{oid}/restart")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "processing", r.text

    await wait_for(lambda: ticked(before + 1), timeout=10, what="ticks of the restarted copy")
    old, new = await ticked(before), await ticked(before + 1)
    assert old[-1].at < new[0].at, "the new copy ticked before the old one stopped"
    assert new[0].at - asked < 2.0, f"back {new[0].at - asked:.2f} s after the restart"
    assert new[0].count > old[-1].count - 2, "not resumed from its checkpoint"
    assert_no_overlap(cluster.tick_dir)
    others = {t.epoch for t in read_ticks(cluster.tick_dir) if t.observer == str(other)}
    assert len(others) == 1, "the other observer was restarted too"
    details = await cluster.q(
        "SELECT detail FROM observer_events WHERE observer_id = $1 AND event = $2",
        oid,
        "restart requested",
    )
    assert [r["detail"] for r in details] == [
        "running: a new copy on its service, from its checkpoint"
    ], details

    async with cluster.api() as c:
        assert (await c.post(f"/observers/{other}/pause")).status_code < 300
        await cluster.wait_status(other, "paused", timeout=10)
        r = await c.post(f"/observers/{other}/restart")
        assert r.status_code == 409, r.text
        assert "resume it instead" in r.json()["detail"], r.text
