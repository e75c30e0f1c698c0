"""The second half of the promise: a live observer is never left unrun for longer than the fault
explains (a fault that takes its holder: the lease TTL and two seconds), whatever the broker is
doing. Judged from the observers' own ticks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import resource
import signal
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aio_pika
import pytest
import websockets

from orch_bench.ticklog import failover_gaps, read_ticks
from orch_contracts.statuses import Event
from orch_contracts.topology import Topology
from orch_verify.soak import page
from tests.support.cluster import Cluster, Proc, wait_for
from tests.support.faults import (
    assert_no_overlap,
    disk_alarm,
    memory_alarm,
    rabbitmqctl,
    via,
)

#: Seconds a takeover may take after its holder was lost: the lease TTL of the test cluster
#: (``tests/support/cluster.py``) and two seconds.
BOUND = 2.0 + 2.0


async def _work_queue(cluster: Cluster) -> tuple[int, int]:
    """(messages ready, consumers) of the work queue, as the broker declares it now."""
    connection = await aio_pika.connect(cluster.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(Topology(cluster.prefix).work_queue, passive=True)
        result = queue.declaration_result
        return int(result.message_count or 0), int(result.consumer_count or 0)


async def _delete_work_queue_and_wait(cluster: Cluster, services: int) -> None:
    """The work queue deleted from outside (an operator, a policy): its unacked deliveries go
    with it. Every service declares it again and consumes it."""
    connection = await aio_pika.connect(cluster.amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(Topology(cluster.prefix).work_queue)

    async def consumed() -> bool:
        try:
            return (await _work_queue(cluster))[1] == services
        except aio_pika.exceptions.ChannelClosed:
            return False

    await wait_for(consumed, timeout=20, what="every service consuming the work queue again")


@contextlib.asynccontextmanager
async def _creating(cluster: Cluster, every: float = 0.3) -> AsyncIterator[list[uuid.UUID]]:
    """A busy cluster: a new observer every ``every`` seconds while inside (so its pool keeps
    taking)."""
    made: list[uuid.UUID] = []

    async def create() -> None:
        while True:
            body = await cluster.create(f"busy-{len(made)}", "ticker")
            made.append(uuid.UUID(body["id"]))
            await asyncio.sleep(every)

    task = asyncio.create_task(create())
    try:
        yield made
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _assert_moved_within(cluster: Cluster, killed: float, proc: Proc, n: int) -> None:
    gaps = failover_gaps(read_ticks(cluster.tick_dir), killed, proc.pid, from_fault=True)
    assert len(gaps) == n, gaps
    slow = {o: round(g, 2) for o, g in gaps.items() if g > BOUND}
    assert not slow, f"unrun longer than {BOUND} s after their holder was lost: {slow}"
    print(f"moved {n} observers, the last {max(gaps.values()):.2f} s after the fault")


@pytest.mark.processes
async def test_a_crash_after_the_work_queue_was_deleted_moves_its_observers_at_once(
    cluster: Cluster,
) -> None:
    """The deleted queue took the running copies' deliveries with it: when their service dies,
    there is nothing for the broker to requeue. The leader must not wait for a requeue (it
    waited up to a minute while the pool kept taking other observers)."""
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=20)
    ids = await cluster.create_recorders(8)
    await cluster.wait_all_running(ids, timeout=15)
    b = await cluster.start_service("b", worker_count=40)
    b_id = await cluster.service_id(b)
    await _delete_work_queue_and_wait(cluster, services=2)
    async with _creating(cluster):
        killed = time.time()
        a.signal(signal.SIGKILL)
        await cluster.wait_all_running(ids, timeout=70, on={b_id}, fresh_after=killed)
    _assert_moved_within(cluster, killed, a, len(ids))
    assert_no_overlap(cluster.tick_dir)


@pytest.mark.processes
async def test_a_drain_after_the_work_queue_was_deleted_moves_its_observers_at_once(
    cluster: Cluster,
) -> None:
    """After the queue's deletion every copy runs without a delivery, so the broker's prefetch
    no longer counts them: a drain's requeued starts reach full services too. Each must still
    run at once on a service with room."""
    await cluster.start_manager()
    services = [await cluster.start_service(n, worker_count=12) for n in ("a", "b", "c")]
    ids = await cluster.create_recorders(27)
    await cluster.wait_all_running(ids, timeout=20)
    await _delete_work_queue_and_wait(cluster, services=3)
    d = await cluster.start_service("d", worker_count=12)
    await wait_for(lambda: _consumers_are(cluster, 4), timeout=15, what="the new service consuming")
    busiest = services[0]
    held = await cluster.q(
        "SELECT count(*) FROM observers WHERE service_id = $1", await cluster.service_id(busiest)
    )
    async with cluster.api() as c:
        r = await c.post(f"/services/{await cluster.service_id(busiest)}/drain")
    drained = time.time()
    assert r.status_code == 202, r.text
    others = {await cluster.service_id(p) for p in [*services[1:], d]}
    await cluster.wait_all_running(ids, timeout=40, on=others, fresh_after=drained)
    gaps = failover_gaps(read_ticks(cluster.tick_dir), drained, busiest.pid)
    assert len(gaps) == held[0]["count"], gaps
    slow = {o: round(g, 2) for o, g in gaps.items() if g > 1.5}
    assert not slow, f"a drained observer waited for a service with room: {slow}"
    assert_no_overlap(cluster.tick_dir)


async def _consumers_are(cluster: Cluster, n: int) -> bool:
    return (await _work_queue(cluster))[1] == n


@pytest.mark.processes
@pytest.mark.alone
async def test_failover_runs_through_a_memory_alarm(cluster: Cluster) -> None:
    """Publishers are blocked, deliveries still flow. The observers of a service SIGKILLed in
    the alarm, and of one frozen in it, run on the other service within the lease TTL and two
    seconds, not when the alarm ends."""
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=20)
    ids = await cluster.create_recorders(8)
    await cluster.wait_all_running(ids, timeout=15)
    f = await cluster.start_service("f", worker_count=20)
    more = [await _recorder(cluster, f"frozen-{i}") for i in range(6)]
    await cluster.wait_all_running(ids + more, timeout=15)
    b = await cluster.start_service("b", worker_count=40)
    b_id = await cluster.service_id(b)
    on_a = await _held(cluster, a)
    on_f = await _held(cluster, f)
    with memory_alarm():
        killed = time.time()
        a.signal(signal.SIGKILL)
        f.signal(signal.SIGSTOP)
        try:
            await cluster.wait_all_running(
                on_a + on_f, timeout=BOUND + 6, on={b_id}, fresh_after=killed
            )
            lasted = time.time() - killed
        finally:
            f.signal(signal.SIGKILL)
            f.signal(signal.SIGCONT)
    _assert_moved_within(cluster, killed, a, len(on_a))
    _assert_moved_within(cluster, killed, f, len(on_f))
    print(f"all running on b {lasted:.2f} s into the alarm")
    assert_no_overlap(cluster.tick_dir, {f.pid: [(killed, time.time())]})


async def _recorder(cluster: Cluster, name: str) -> uuid.UUID:
    body = await cluster.create(name, "recorder", dir=str(cluster.tick_dir), interval=0.05)
    return uuid.UUID(body["id"])


async def _held(cluster: Cluster, proc: Proc) -> list[uuid.UUID]:
    rows = await cluster.q(
        "SELECT id FROM observers WHERE service_id = $1 AND status = 'processing'",
        await cluster.service_id(proc),
    )
    return [r["id"] for r in rows]


@pytest.mark.processes
@pytest.mark.alone
async def test_directed_observers_of_a_crashed_service_move_during_a_disk_alarm(
    cluster: Cluster,
) -> None:
    """Observers that reached their service by a directed start hold no broker delivery: when
    that service dies in a disk alarm, nothing is requeued, and the leader's directed starts
    cannot be published. They must reach a live service all the same."""
    await cluster.start_manager()
    c = await cluster.start_service("c", worker_count=20)
    ids = await cluster.create_recorders(6)
    await cluster.wait_all_running(ids, timeout=15)
    a = await cluster.start_service("a", worker_count=20)
    a_id = await cluster.service_id(a)
    c.signal(signal.SIGSTOP)  # the leader re-dispatches C's observers, directed, to A
    try:
        await cluster.wait_all_running(ids, timeout=10, on={a_id}, fresh_after=time.time())
    finally:
        c.signal(signal.SIGKILL)
        c.signal(signal.SIGCONT)
    b = await cluster.start_service("b", worker_count=20)
    b_id = await cluster.service_id(b)
    with disk_alarm():
        killed = time.time()
        a.signal(signal.SIGKILL)
        await cluster.wait_all_running(ids, timeout=BOUND + 6, on={b_id}, fresh_after=killed)
    _assert_moved_within(cluster, killed, a, len(ids))
    assert_no_overlap(cluster.tick_dir)


@pytest.mark.processes
async def test_a_service_at_its_descriptor_limit_fails_no_observer(cluster: Cluster) -> None:
    """One service may open 128 files. Its pollers' connections reach that limit: the copy that
    meets EMFILE goes to the other service, spending no restart, and the limited service takes
    no more than it has descriptors for. Before, it took up to its worker count, and the
    observers that met the limit restarted until they failed, for good."""
    with page() as port:
        cluster.env["ORCH_HTTP_POLL_ALLOW"] = f"127.0.0.1:{port}"
        await cluster.start_manager()
        small = await cluster.start_service("small", worker_count=200)
        resource.prlimit(small.pid, resource.RLIMIT_NOFILE, (128, 128))
        url = f"http://127.0.0.1:{port}/"
        ids = []
        for i in range(100):
            body = await cluster.create(f"poll-{i}", "http_poll", url=url, interval=0.5)
            ids.append(uuid.UUID(body["id"]))
        big = await cluster.start_service("big", worker_count=200)
        for i in range(100, 200):
            body = await cluster.create(f"poll-{i}", "http_poll", url=url, interval=0.5)
            ids.append(uuid.UUID(body["id"]))
        began = time.time()
        await cluster.wait_all_running(ids, timeout=60, fresh_after=began)
        rows = await cluster.q(
            "SELECT o.status, o.restart_count, s.name FROM observers o "
            "LEFT JOIN services s ON s.id = o.service_id WHERE o.id = ANY($1)",
            ids,
        )
        restarted = await cluster.q(
            "SELECT count(*) AS n FROM observer_events WHERE event IN ('restarted', 'failed')"
        )
        where = {name: sum(1 for r in rows if r["name"] == name) for name in ("small", "big")}
        print(f"running on each service: {where}")
        assert restarted[0]["n"] == 0, "a restart was spent on the service's own limit"
        assert all(r["status"] == "processing" for r in rows)
        assert small.alive
        assert big.alive
        assert 0 < where["small"] < 100, where


@pytest.mark.processes
async def test_a_service_starts_on_a_slow_database_link(cluster: Cluster) -> None:
    """Every chunk on its database link is delayed 200-800 ms from its first connection on. It
    starts all the same (its connections tried again, with a line in its log), holds its lease
    and runs observers: under a supervisor, a service that exits at start only crash-loops."""
    await cluster.start_manager()
    proxy = await cluster.proxy(cluster.database_url)
    proxy.slow(0.2, 0.8)
    slow = await cluster.start_service(
        "slow", worker_count=10, database_url=via(cluster.database_url, proxy), lease_ttl=5
    )
    ids = await cluster.create_recorders(3)
    await cluster.wait_all_running(ids, timeout=60, on={await cluster.service_id(slow)})
    assert slow.alive
    # Its join and renewals are statements parsed when the session opens: the first renewal
    # parsed on the lease's clock outlasted the deadline the join had set (a round trip of up to
    # 1.6 s each way), and the service was fenced at once, then after every rejoin, for 35 s.
    assert slow.log is not None
    assert "lease lost" not in slow.log.read_text(errors="replace"), slow.tail()
    # Each take lasts seconds on this link. The leader's audit sent the starts of observers
    # still being taken anew every second or two (19 to 28 starts for these 3), and each start
    # sent anew cost the link a round trip to drop it as stale: the first checkpoints landed
    # about 50 s in. The renewal reports the starts being admitted; the audit leaves them alone
    # once it has read one (it acts before the service's first renewal lands: 2 rounds here).
    sent = await cluster.q(
        "SELECT count(*) FROM observer_events WHERE observer_id = ANY($1) AND event = $2",
        ids,
        Event.REDISPATCHED.value,
        one=True,
    )
    assert sent <= 3 * len(ids), f"the audit sent {sent} starts anew to a slow service"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def _round(cluster: Cluster, kind: str, params: dict[str, object], n: int, tag: str) -> None:
    """``n`` observers of ``kind`` created, seen running, then deleted and seen stopped."""
    async with cluster.api() as api:
        body = {
            "observers": [{"name": f"{tag}-{i}", "kind": kind, "params": params} for i in range(n)]
        }
        r = await api.post("/observers/batch", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["created"] == n, r.text

        async def running() -> bool:
            rows = await cluster.q(
                "SELECT count(*) AS k FROM observers WHERE kind = $1 AND status = 'processing' "
                "AND (checkpointed_at IS NOT NULL OR committed_at IS NOT NULL)",
                kind,
            )
            return bool(rows[0]["k"] == n)

        await wait_for(running, timeout=120, what=f"{n} {kind} observers running")
        action = {"action": "delete", "selector": {"kind": kind}, "limit": n}
        r = await api.post("/observers/actions", json=action)
        assert r.status_code == 200, r.text

    async def gone() -> bool:
        rows = await cluster.q(
            "SELECT count(*) AS k FROM observers WHERE kind = $1 AND status <> 'deleted'", kind
        )
        return bool(rows[0]["k"] == 0)

    await wait_for(gone, timeout=120, what=f"{kind} observers deleted")


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_service_keeps_no_memory_of_the_observers_it_ran(cluster: Cluster) -> None:
    """A thousand observers of each built-in kind created and deleted, twice: the service's
    memory after the second round is what it was after the first. Each poller kept its own TLS
    context (about 830 KiB) after it ended, and every ended copy waited for a full collection
    (about 65 objects in a cycle)."""
    n = 1000
    with page() as http_port:
        async with _feed() as ws_port:
            cluster.env["ORCH_HTTP_POLL_ALLOW"] = f"127.0.0.1:{http_port},127.0.0.1:{ws_port}"
            await cluster.start_manager()
            service = await cluster.start_service("s", worker_count=n + 10, lease_ttl=5)
            kinds: list[tuple[str, dict[str, object]]] = [
                ("recorder", {"dir": str(cluster.tick_dir), "interval": 1}),
                ("ticker", {"interval": 1}),
                ("http_poll", {"url": f"http://127.0.0.1:{http_port}/", "interval": 5}),
                ("websocket", {"url": f"ws://127.0.0.1:{ws_port}/"}),
            ]
            after: list[int] = []
            for round_ in range(2):
                for kind, params in kinds:
                    await _round(cluster, kind, params, n, f"{kind}-{round_}")
                after.append(_rss(service.pid))
            grown = (after[1] - after[0]) / 2**20
            print(f"service RSS after each round: {[round(a / 2**20) for a in after]} MiB")
            assert grown < 16, f"the service kept {grown:.0f} MiB of ended copies"


@contextlib.asynccontextmanager
async def _feed(every: float = 1.0) -> AsyncIterator[int]:
    """A local websocket server that sends a message every ``every`` seconds; its port."""

    async def handler(ws: Any) -> None:
        for n in itertools.count():
            await ws.send(f"tick {n}")
            await asyncio.sleep(every)

    async with websockets.serve(handler, "127.0.0.1", 0) as server:
        yield next(iter(server.sockets)).getsockname()[1]


@contextlib.contextmanager
def _delivery_limit(queue: str, limit: int) -> Iterator[None]:
    """A broker policy capping the deliveries of ``queue`` (a quorum queue), removed after."""
    name = f"test-delivery-limit-{uuid.uuid4().hex[:8]}"
    rabbitmqctl(
        "set_policy",
        name,
        f"^{re.escape(queue)}$",
        json.dumps({"delivery-limit": limit}),
        "--apply-to",
        "queues",
    )
    try:
        yield
    finally:
        rabbitmqctl("clear_policy", name)


@pytest.mark.processes
async def test_a_start_dead_lettered_by_a_delivery_limit_loses_no_observer(
    cluster: Cluster,
) -> None:
    """A quorum queue counts a crash as a delivery, and from RabbitMQ 4.0 dead-letters a start
    after 20 (4.3 counts a closed channel too). The project lifts that limit on the work queue
    it declares; where a policy sets one anyway (here a limit of 0 deliveries, on 3.x), a start
    whose holder crashed goes to the error queue: its observer must still run again, within the
    lease TTL and two seconds."""
    cluster.env["ORCH_QUEUE_TYPE"] = "quorum"
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=20)
    with _delivery_limit(Topology(cluster.prefix).work_queue, 0):
        ids = await cluster.create_recorders(4)
        await cluster.wait_all_running(ids, timeout=15)
        b = await cluster.start_service("b", worker_count=20)
        killed = time.time()
        a.signal(signal.SIGKILL)
        await cluster.wait_all_running(
            ids, timeout=30, on={await cluster.service_id(b)}, fresh_after=killed
        )
    _assert_moved_within(cluster, killed, a, len(ids))
    assert_no_overlap(cluster.tick_dir)
