"""The benchmark scenarios. Each takes the run's Bench and a Progress, and returns Figures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from orch.cluster import free_port, quiet, wait_for
from orch_bench import rabbit_cluster
from orch_bench.floor import measure_floor
from orch_bench.harness import (
    Bench,
    BenchCluster,
    Figure,
    cpu_by_role,
    cpu_seconds,
    median,
    percentile,
    rss_bytes,
)
from orch_bench.loadgen import RawClient, create_for
from orch_bench.ticklog import failover_gaps, largest_gaps, overlap_seconds, read_ticks

IDLE_TICKER = {"interval": 3600}
#: Slots of each service where creates are measured: 30 s of creates at 3,000/s must fit in
#: two services, or the last ones wait unheld and the figure measures a full cluster.
INTAKE_ROOM = 50_000
TICK = 0.02  # recorder interval in failover scenarios: the resolution of measured gaps


@dataclass(frozen=True)
class Size:
    start_samples: int
    throughput_seconds: float
    cancel_running: int
    cancel_samples: int
    failover_observers: int
    crash_moved: tuple[int, ...]
    bulk_observers: int
    density_levels: tuple[int, ...]
    cost_observers: tuple[int, ...]
    cost_services: tuple[int, ...]
    cost_seconds: float
    outputs_observers: int = 1000
    outputs_seconds: float = 10
    fleet_services: int = 20
    fleet_per_service: int = 5000


QUICK = Size(30, 5, 200, 40, 40, (20,), 3000, (1000,), (1000,), (3,), 5, 1000, 5, 3, 500)
FULL = Size(
    200,
    30,
    1000,
    200,
    200,
    (10, 20, 100, 1000),
    20_000,
    (10_000, 25_000, 50_000),
    (1000, 5000, 10000),
    (1, 3, 10),
    31,  # one period of the services' held-rows check (ORCH_CHECK_EVERY, 30 s)
)

Tick = Callable[..., None]


async def _latencies(cluster: BenchCluster, t0: dict[uuid.UUID, float], sql: str) -> list[float]:
    db = await cluster.connect()
    rows = await db.fetch(sql, list(t0))
    return [(float(r["at"]) - t0[r["id"]]) * 1000 for r in rows]


async def _create_idle(client: RawClient, name: str) -> uuid.UUID:
    body = {"name": name, "kind": "ticker", "params": IDLE_TICKER}
    status, text = await client.post("/observers", body)
    if status != 201:
        raise RuntimeError(f"create failed: {status} {text[:200]!r}")
    return uuid.UUID(json.loads(text)["id"])


class Starter:
    """Creates idle observers on one cluster, one at a time, each waited for until its first
    checkpoint; ``latencies()`` gives the milliseconds from POST to that checkpoint."""

    def __init__(self, c: BenchCluster, tag: str) -> None:
        self.c, self.tag = c, tag
        self.client = RawClient(c.api_port, c.token)
        self.sent: dict[uuid.UUID, float] = {}

    async def one(self) -> None:
        db = await self.c.connect()
        sent = time.time()
        oid = await _create_idle(self.client, f"{self.tag}-{len(self.sent)}")
        self.sent[oid] = sent

        async def checkpointed() -> bool:
            return bool(
                await db.fetchval(
                    "SELECT checkpointed_at IS NOT NULL FROM observers WHERE id = $1", oid
                )
            )

        await wait_for(checkpointed, timeout=10, what="first checkpoint", every=0.002)

    async def latencies(self) -> list[float]:
        await self.client.close()
        return await _latencies(
            self.c,
            self.sent,
            "SELECT id, extract(epoch FROM checkpointed_at) AS at "
            "FROM observers WHERE id = ANY($1)",
        )


async def measure_starts(c: BenchCluster, n: int, tick: Tick, tag: str = "start") -> list[float]:
    """Milliseconds from POST to the first checkpoint, ``n`` times, one at a time."""
    starter = Starter(c, tag)
    try:
        for _ in range(n):
            await starter.one()
            tick()
    finally:
        ms = await starter.latencies()
    return ms


async def start_latency(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """POST → first checkpoint, one at a time on an idle cluster."""
    async with bench.cluster("start") as c:
        await c.start(services=2, worker_count=1000)
        ms = await measure_starts(c, size.start_samples, tick)
    return _distribution("start latency", "POST → first checkpoint", ms, "ms", p99_target=50)


#: Manager processes in the intake scenarios: one per core, as an operator would run it.
INTAKE_WORKERS = max(1, min(4, os.cpu_count() or 1))


async def create_throughput(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """Creates per second through one manager replica (one worker process per core) from 32
    keep-alive connections, where the CPU goes meanwhile, and the latency of one client alone
    (what a request costs when it does not queue behind 31 others)."""
    async with bench.cluster("throughput", workers=INTAKE_WORKERS) as c:
        await c.start(services=2, worker_count=INTAKE_ROOM)
        alone = await measure_creates(c, 50, tag="solo")

        def body(client: int, i: int) -> dict[str, Any]:
            return {"name": f"tp-{client}-{i}", "kind": "ticker", "params": IDLE_TICKER}

        why_not = await c.reset_statements()
        before = cpu_by_role(c)
        created, elapsed, latencies = await create_for(
            c.api_port,
            size.throughput_seconds,
            token=c.token,
            clients=32,
            body=body,
            progress=lambda: tick(advance=0),
        )
        cpu = {k: v / elapsed * 100 for k, v in cpu_by_role(c, since=before).items()}
        all_running = await c.wait_running(created, timeout=300)
        # Until every create is running: the takes and first checkpoints count too.
        seconds = cpu_by_role(c, since=before)
        statements = await c.top_statements("create throughput", why_not)
        tick()
    rate = created / elapsed
    ms = [x * 1000 for x in latencies]
    p99 = percentile(ms, 99)
    split = ", ".join(f"{role} {pct:.0f} %" for role, pct in sorted(cpu.items()) if pct >= 1)
    return [
        Figure(
            "create throughput",
            "creates/s through the API",
            round(rate, 1),
            "1/s",
            "≥ 1000",
            rate >= 1000,
            f"{created} in {elapsed:.1f} s, 32 connections, {INTAKE_WORKERS} manager workers",
        ),
        Figure(
            "create throughput",
            "POST latency under that load p99",
            round(p99, 1),
            "ms",
            "< 100",
            p99 < 100,
        ),
        Figure("create throughput", "POST latency p50", round(percentile(ms, 50), 1), "ms"),
        Figure(
            "create throughput",
            "POST latency of one client alone p50",
            round(percentile(alone, 50), 2),
            "ms",
            note=f"p99 {percentile(alone, 99):.1f} ms; under load a request waits its turn",
        ),
        Figure(
            "create throughput",
            "CPU during the load (% of one core)",
            round(sum(cpu.values())),
            "%",
            note=f"{split}; {os.cpu_count()} cores",
        ),
        Figure("create throughput", "last create → all running", round(all_running, 2), "s"),
        Figure(
            "create throughput",
            "CPU per created-and-running observer",
            round(sum(seconds.values()) / created * 1000, 2),
            "ms",
            "≤ 1",
            sum(seconds.values()) / created * 1000 <= 1,
            "by role, ms: "
            + ", ".join(
                f"{role} {v / created * 1000:.2f}" for role, v in sorted(seconds.items()) if v > 0
            ),
        ),
        *statements,
    ]


async def measure_creates(c: BenchCluster, n: int, *, tag: str) -> list[float]:
    """Milliseconds per POST /observers from one client, ``n`` times."""
    client = RawClient(c.api_port, c.token)
    out: list[float] = []
    try:
        for i in range(n):
            t = time.perf_counter()
            await _create_idle(client, f"{tag}-{i}")
            out.append((time.perf_counter() - t) * 1000)
    finally:
        await client.close()
    return out


BULK_TARGET = 5000


async def bulk_intake(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """Observers created with POST /observers/batch (1,000 a request, two connections): from
    the first request until every one of them is processing."""
    n = size.bulk_observers
    async with bench.cluster("bulk", workers=INTAKE_WORKERS) as c:
        await c.start(services=2, worker_count=n)
        todo = iter(range(0, n, 1000))
        posts: list[float] = []

        async def sender(k: int) -> None:
            for first in todo:
                t = time.perf_counter()
                await c.create_batches(min(1000, n - first), "ticker", IDLE_TICKER, tag=f"b{first}")
                posts.append((time.perf_counter() - t) * 1000)
                tick(advance=0)

        why_not = await c.reset_statements()
        before = cpu_by_role(c)
        began = time.monotonic()
        await asyncio.gather(sender(0), sender(1))
        posted = time.monotonic() - began
        await c.wait_running(n, timeout=300)
        took = time.monotonic() - began
        cpu = cpu_by_role(c, since=before)
        statements = await c.top_statements("bulk intake", why_not)
        tick()
    rate = n / took
    per = ", ".join(
        f"{role} {seconds / n * 1000:.2f}" for role, seconds in sorted(cpu.items()) if seconds > 0
    )
    return [
        Figure(
            "bulk intake",
            "observers/s reaching processing",
            round(rate),
            "1/s",
            f"≥ {BULK_TARGET}",
            rate >= BULK_TARGET,
            f"{n} in {took:.1f} s, batches of 1000 on 2 connections",
        ),
        Figure("bulk intake", "observers/s accepted by the API", round(n / posted), "1/s"),
        Figure("bulk intake", "batch POST latency p50", round(percentile(posts, 50)), "ms"),
        Figure(
            "bulk intake",
            "CPU per observer",
            round(sum(cpu.values()) / n * 1000, 2),
            "ms",
            note=f"by role, ms: {per}",
        ),
        *statements,
    ]


async def cancel_latency(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """DELETE → task stopped (the holder's 'deleted' event), with many observers running."""
    async with bench.cluster("cancel") as c:
        await c.start(services=2, worker_count=size.cancel_running)
        ids = await c.create_many(size.cancel_running, "ticker", IDLE_TICKER, tag="c")
        await c.wait_running(size.cancel_running, timeout=120)
        t0: dict[uuid.UUID, float] = {}
        async with c.api() as client:
            for oid in ids[: size.cancel_samples]:
                t0[oid] = time.time()
                (await client.delete(f"/observers/{oid}")).raise_for_status()
                tick()
        db = await c.connect()

        async def all_deleted() -> bool:
            n = await db.fetchval(
                "SELECT count(*) FROM observer_events WHERE event = 'deleted' "
                "AND observer_id = ANY($1)",
                list(t0),
            )
            return bool(n == len(t0))

        await wait_for(all_deleted, timeout=30, what="cancels")
        ms = await _latencies(
            c,
            t0,
            "SELECT observer_id AS id, extract(epoch FROM at) AS at FROM observer_events "
            "WHERE event = 'deleted' AND observer_id = ANY($1)",
        )
    return _distribution(
        "cancel latency",
        f"DELETE → stopped ({size.cancel_running} running)",
        ms,
        "ms",
        p99_target=50,
    )


async def _recorders(
    c: BenchCluster, n: int, services: int, interval: float = TICK
) -> list[uuid.UUID]:
    await c.start(services=services, worker_count=n)
    every = max(1, round(1 / interval))  # about one checkpoint a second
    params = {"dir": str(c.workdir / "ticks"), "interval": interval, "checkpoint_every": every}
    ids = await c.create_many(n, "recorder", params, tag="r")
    await c.wait_running(n, timeout=120)
    await quiet(1.0, "let every recorder tick before the fault")
    return ids


def overlap_figure(scenario: str, overlap: dict[str, float]) -> Figure:
    """Seconds during which two copies of an observer ran at once: the promise, 0."""
    return Figure(
        scenario,
        "overlap (two copies at once)",
        round(sum(overlap.values()), 3),
        "s",
        "0",
        not overlap,
        f"{len(overlap)} observers overlapped",
    )


def _gap_figures(
    scenario: str,
    c: BenchCluster,
    at: float,
    pid: int,
    target_ms: float,
    target: str,
    interval: float = TICK,
) -> list[Figure]:
    """Gaps of the observers that ran in process ``pid`` at ``at``, and overlap of all."""
    ticks = read_ticks(c.workdir / "ticks")
    gaps = failover_gaps(ticks, at, pid)
    moved = len(gaps)
    resumed = moved > 0 and all(g != float("inf") for g in gaps.values())
    finite = [g * 1000 for g in gaps.values() if g != float("inf")]
    overlap = overlap_seconds(ticks)
    worst = max(finite, default=float("nan"))
    return [
        Figure(
            scenario,
            "max gap of the moved observers",
            round(worst, 1),
            "ms",
            target,
            resumed and worst < target_ms if target else None,
            f"{moved} moved; tick every {interval * 1000:.0f} ms",
        ),
        Figure(scenario, "median gap of the moved observers", round(median(finite), 1), "ms"),
        Figure(scenario, "all resumed", float(resumed), "bool", "1", resumed),
        overlap_figure(scenario, overlap),
    ]


async def _stop_busiest(
    bench: Bench, size: Size, tick: Tick, *, sig: int, scenario: str, target_ms: float
) -> list[Figure]:
    """Signal the service running the most observers; every one of them must move."""
    async with bench.cluster(scenario.split()[0]) as c:
        await _recorders(c, size.failover_observers, services=2)
        pid, _, _ = await c.busiest_service()
        at = time.time()
        c.proc_by_pid(pid).signal(sig)
        await c.wait_running(size.failover_observers, timeout=60)
        await quiet(1.0, "let the moved recorders tick")
        tick()
        return _gap_figures(scenario, c, at, pid, target_ms, f"< {target_ms:g}")


#: Crash failover targets by observers moved: (max gap below, times the floor at most).
CRASH_TARGETS: dict[int, tuple[float, float | None]] = {
    20: (50, None),
    100: (100, 1.5),
    1000: (0, 2.0),
}


async def crash_failover(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """SIGKILL of a service running ``n`` observers while an idle one waits, for each ``n`` of
    the size, next to the broker's own floor measured the same way in the same cluster."""
    figures: list[Figure] = []
    for n in size.crash_moved:
        interval = TICK if n <= 100 else 0.1
        scenario = f"crash failover, {n} moved"
        async with bench.cluster(f"crash{n}") as c:
            floor_s = await measure_floor(c, bench.settings.amqp_url, c.workdir, n, interval)
            await _recorders(c, n, services=1, interval=interval)
            victim = c.procs[-1]
            heir = await c.start_service("s2", n)
            heir_id = await c.service_id(heir)
            await quiet(1.0, "let the idle service settle before the kill")
            at = time.time()
            victim.signal(signal.SIGKILL)
            await c.wait_moved(heir_id, n, timeout=120)
            await quiet(1.0, "let the moved recorders tick")
            tick()
            target_ms, ratio_target = CRASH_TARGETS.get(n, (0, None))
            target = f"< {target_ms:g}" if target_ms else ""
            gaps = _gap_figures(scenario, c, at, victim.pid, target_ms, target, interval)
        floor_ms = [g * 1000 for g in floor_s]
        floor_max = max(floor_ms)
        worst = gaps[0].value or float("nan")
        ratio = worst / floor_max
        figures += [
            *gaps[:2],
            Figure(
                scenario,
                "the broker's floor, max gap",
                round(floor_max, 1),
                "ms",
                note=f"bare aio-pika consumers, median {median(floor_ms):.1f} ms",
            ),
            Figure(
                scenario,
                "max gap ÷ floor",
                round(ratio, 2),
                "x",
                f"≤ {ratio_target:g}" if ratio_target else "",
                ratio <= ratio_target if ratio_target else None,
            ),
            *gaps[2:],
        ]
    return figures


async def graceful_move(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    return await _stop_busiest(
        bench, size, tick, sig=signal.SIGTERM, scenario="graceful move (SIGTERM)", target_ms=1000
    )


async def freeze_failover(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    async with bench.cluster("freeze") as c:
        await _recorders(c, size.failover_observers, services=2)
        pid, _, _ = await c.busiest_service()
        proc = c.proc_by_pid(pid)
        at = time.time()
        proc.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(bench.lease_ttl + 3)
        finally:
            proc.signal(signal.SIGCONT)
        await asyncio.sleep(2.0)
        tick()
        limit = (bench.lease_ttl + 2) * 1000
        return _gap_figures(
            "freeze failover (SIGSTOP)", c, at, pid, limit, f"≤ {limit:.0f} (TTL + 2 s)"
        )


#: How long the broker is stopped in the broker-restart scenario, seconds.
BROKER_DOWN = 10.0


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], capture_output=True, timeout=120, check=True)


def _max_tick_gap(scenario: str, gaps_ms: list[float], more: str = "") -> Figure:
    """The largest tick gap of any observer through a broker fault: under a second, as the
    lease carries them."""
    worst = max(gaps_ms, default=float("nan"))
    return Figure(
        scenario,
        "max tick gap",
        round(worst, 1),
        "ms",
        "< 1000",
        worst < 1000,
        f"{len(gaps_ms)} observers; tick every {TICK * 1000:.0f} ms{more}",
    )


async def broker_restart(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """``rabbitmqctl stop_app`` for 10 s, then ``start_app``, under two loaded services: the
    largest tick gap of any observer through it (the lease carries them, not the broker). It
    needs ``rabbitmqctl`` on this machine, with rights on the broker."""
    scenario = f"broker restart ({BROKER_DOWN:g} s down)"
    if shutil.which("rabbitmqctl") is None:
        tick()
        return [Figure(scenario, "max tick gap", None, "ms", note="no rabbitmqctl here: skipped")]
    async with bench.cluster("broker") as c:
        await _recorders(c, size.failover_observers, services=2)
        try:
            await asyncio.to_thread(_rabbitmqctl, "stop_app")
            stopped = time.time()
            await quiet(BROKER_DOWN, "the broker is down")
        finally:
            await asyncio.to_thread(_rabbitmqctl, "start_app")
        await quiet(3.0, "redelivered starts are adopted or dropped")
        end = time.time()
        tick()
        ticks = read_ticks(c.workdir / "ticks")
        gaps = [g * 1000 for g in largest_gaps(ticks, stopped, end).values()]
        overlap = overlap_seconds(ticks)
        return [
            _max_tick_gap(scenario, gaps),
            Figure(scenario, "median of each observer's max gap", round(median(gaps), 1), "ms"),
            overlap_figure(scenario, overlap),
        ]


async def node_loss(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """SIGKILL of the RabbitMQ node that leads the quorum work queue, in a three-node cluster of
    the bench's own, under two services: one connected to that node, one to another. The
    largest tick gap of the observers of each (the lease carries them; the lost node's service
    reconnects to a survivor)."""
    scenario = "broker node loss (3-node quorum)"
    why = rabbit_cluster.available()
    if why is not None:
        tick()
        return [Figure(scenario, "max tick gap", None, "ms", note=f"skipped: {why}")]
    rabbit = rabbit_cluster.RabbitCluster(3)
    began = time.monotonic()
    await asyncio.to_thread(rabbit.start)
    boot = time.monotonic() - began
    try:
        async with bench.cluster("nodeloss", amqp_url=rabbit.amqp_url, queue_type="quorum") as c:
            await c.start_api()
            lost = rabbit.node(rabbit.queue(f"{c.prefix}.work")["leader"])
            survivor = next(n for n in rabbit.nodes if n is not lost)
            n = size.failover_observers
            on_lost = await c.start_service("on-lost", n, ORCH_AMQP_URL=rabbit.first(lost))
            await c.start_service("on-survivor", n, ORCH_AMQP_URL=rabbit.first(survivor))
            every = max(1, round(1 / TICK))
            params = {"dir": str(c.workdir / "ticks"), "interval": TICK, "checkpoint_every": every}
            await c.create_many(n, "recorder", params, tag="r")
            await c.wait_running(n, timeout=120)
            await quiet(1.0, "let every recorder tick before the fault")
            at = time.time()
            await asyncio.to_thread(rabbit.kill, lost)
            await quiet(5.0, "a node of the cluster is lost")
            await asyncio.to_thread(rabbit.start_node, lost)
            await asyncio.to_thread(rabbit.wait_running, 3)
            await quiet(2.0, "redelivered starts are adopted or dropped")
            end = time.time()
            tick()
            ticks = read_ticks(c.workdir / "ticks")
    finally:
        await asyncio.to_thread(rabbit.stop)
    gaps = largest_gaps(ticks, at, end)
    on_lost_ids = {t.observer for t in ticks if t.pid == on_lost.pid and t.at < at}
    lost_side = [g * 1000 for o, g in gaps.items() if o in on_lost_ids]
    other_side = [g * 1000 for o, g in gaps.items() if o not in on_lost_ids]
    return [
        _max_tick_gap(scenario, lost_side + other_side, f"; cluster booted in {boot:.1f} s"),
        *(
            Figure(
                scenario,
                f"max gap, service on {where}",
                round(max(side, default=float("nan")), 1),
                "ms",
                note=f"{len(side)} observers",
            )
            for where, side in (("the lost node", lost_side), ("a surviving node", other_side))
        ),
        overlap_figure(scenario, overlap_seconds(ticks)),
    ]


async def join_rebalance(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """A fourth service joins three loaded ones: time until all are within ±10 % of their
    share (default settings, so it includes ORCH_REBALANCE_MIN_AGE), moves and overlap."""
    n = size.failover_observers * 3 // 2
    async with bench.cluster("join", rebalance="true") as c:
        await c.start(services=3, worker_count=n)
        params = {"dir": str(c.workdir / "ticks"), "interval": 0.1, "checkpoint_every": 10}
        await c.create_many(n, "recorder", params, tag="j")
        await c.wait_running(n, timeout=60)
        await c.start_service("s4", n)
        joined = time.monotonic()
        db = await c.connect()

        async def fair() -> bool:
            rows = await db.fetch(
                "SELECT count(o.id) AS k FROM services s LEFT JOIN observers o "
                "ON o.service_id = s.id AND o.status = 'processing' WHERE NOT s.is_deleted "
                "GROUP BY s.id"
            )
            share = n / 4
            return len(rows) == 4 and all(abs(r["k"] - share) <= 0.1 * share for r in rows)

        await wait_for(fair, timeout=120, what="fair share", every=0.1)
        took = time.monotonic() - joined
        await c.wait_running(n, timeout=30)
        await asyncio.sleep(2.0)
        rows = await db.fetch(
            "SELECT observer_id, count(*) AS k FROM observer_events "
            "WHERE event = 'handoff requested' GROUP BY observer_id"
        )
        overlap = overlap_seconds(read_ticks(c.workdir / "ticks"))
        tick()
    twice = sum(1 for r in rows if r["k"] > 1)
    return [
        Figure(
            "join rebalance",
            "time to fair share (±10 %)",
            round(took, 2),
            "s",
            "< 30",
            took < 30,
            f"{n} observers, 3 → 4 services, min age 10 s",
        ),
        Figure("join rebalance", "observers moved", float(len(rows)), "", f"≈ {n // 4}"),
        Figure("join rebalance", "observers moved twice", float(twice), "", "0", twice == 0),
        overlap_figure("join rebalance", overlap),
    ]


#: The density scenario's observers: a tick (and a checkpoint) a minute each.
DENSITY_INTERVAL = 60.0
#: Seconds each density level is watched (a whole tick period and a little): its CPU, its
#: renewals and its checkpoint flushes.
DENSITY_WINDOW = 65.0


async def _histograms(port: int) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of a service's histograms, by metric name and upper bound."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics", timeout=10)).text
    out: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                buckets = out.setdefault(sample.name.removesuffix("_bucket"), {})
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name.endswith("_total") or family.type == "gauge":
                totals = out.setdefault(sample.name, {})
                totals[0.0] = totals.get(0.0, 0.0) + sample.value  # summed over labels
    return out


def _slowest(before: dict[float, float], after: dict[float, float]) -> tuple[int, float]:
    """(observations, the bucket bound the slowest of them fell under) between two scrapes."""
    return _bucket_percentile(before, after, 1.0)


async def density(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """One service hosting idle tickers (one tick a minute each) at each level: memory and
    idle CPU per observer, and whether its lease renewals and checkpoint flushes stay on time
    (from its own metrics)."""

    figures: list[Figure] = []
    top = max(size.density_levels)
    port = free_port()
    async with bench.cluster("density") as c:
        await c.start(services=1, worker_count=top, ORCH_METRICS_PORT=port)
        pid = c.procs[-1].pid
        await asyncio.sleep(2.0)
        base = rss_bytes(pid)
        renew_every = bench.lease_ttl / 5  # ORCH_RENEW_INTERVAL's default
        for level in size.density_levels:
            await c.grow_to(level, tag=f"d{level}", interval=DENSITY_INTERVAL)
            await asyncio.sleep(3.0)
            rss = rss_bytes(pid)
            before = await _histograms(port)
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            await asyncio.sleep(DENSITY_WINDOW)
            idle_cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0) * 100
            after = await _histograms(port)
            renewals, renew_max = _slowest(
                before.get("orch_lease_renewal_seconds", {}), after["orch_lease_renewal_seconds"]
            )
            flushes, flush_max = _slowest(
                before.get("orch_checkpoint_flush_seconds", {}),
                after["orch_checkpoint_flush_seconds"],
            )
            lost = sum(
                v.get(0.0, 0.0) for k, v in after.items() if k.startswith("orch_lease_lost")
            ) - sum(v.get(0.0, 0.0) for k, v in before.items() if k.startswith("orch_lease_lost"))
            on_time = renewals >= DENSITY_WINDOW / renew_every - 2 and renew_max <= renew_every
            figures += [
                Figure(
                    "density",
                    f"lease renewals at {level}: slowest under",
                    round(renew_max * 1000, 1),
                    "ms",
                    f"≤ {renew_every * 1000:g} and every {renew_every:g} s",
                    on_time and lost == 0,
                    f"{renewals} renewals in {DENSITY_WINDOW:g} s, {lost:g} leases lost",
                ),
                Figure(
                    "density",
                    f"checkpoint flushes at {level}: slowest under",
                    round(flush_max * 1000, 1),
                    "ms",
                    note=f"{flushes} flushes in {DENSITY_WINDOW:g} s, a tick a minute each",
                ),
            ]
            figures += [
                Figure(
                    "density",
                    f"{level} observers hosted by one process",
                    float(level),
                    "",
                    "≥ 50000" if level == top else "",
                    None if level != top else level >= 50000,
                ),
                Figure("density", f"RSS at {level}", round(rss / 2**20, 1), "MiB"),
                Figure(
                    "density",
                    f"memory per observer at {level}",
                    round((rss - base) / level / 1024, 2),
                    "KiB",
                ),
                Figure("density", f"idle CPU at {level}", round(idle_cpu, 2), "% of a core"),
            ]
            tick()
    return figures


#: PostgreSQL flushes an idle backend's counters within 10 s: measure only after that.
COUNTERS_SETTLE = 11.0
#: An idle cluster's database load may grow with its services, not with its observers.
IDLE_TRANSACTIONS_TARGET = 100.0
IDLE_READS_GROWTH_TARGET = 2.0


async def cost_growth(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """Database and broker load of idle clusters: observers x services."""
    figures: list[Figure] = []
    top = max(size.cost_observers)
    for services in size.cost_services:
        reads: dict[int, float] = {}
        # Retention catches up on the history that growing wrote within the settle, not in
        # the window measured (by default it runs once a minute).
        async with bench.cluster(f"cost{services}", prune_interval=5) as c:
            await c.start(services=services, worker_count=top // services + 100)
            for level in size.cost_observers:
                await c.grow_to(level, tag=f"k{level}")
                # Autovacuum analyses the grown table within a minute or so; until then the
                # planner costs it as the empty table of the template, and scans it whole.
                # The figure is the steady state, so it is analysed here at once.
                await (await c.connect()).execute("ANALYZE observers")
                await quiet(COUNTERS_SETTLE, "let the database's counters catch up")
                t0, x0, w0, r0 = await c.db_counters()
                f0 = await asyncio.to_thread(c.broker_frames)
                await asyncio.sleep(size.cost_seconds)
                t1, x1, w1, r1 = await c.db_counters()
                f1 = await asyncio.to_thread(c.broker_frames)
                dt = t1 - t0
                reads[level] = (r1 - r0) / dt
                label = f"{level} observers, {services} services"
                xacts = (x1 - x0) / dt
                at_top = level == top and services == max(size.cost_services)
                figures += [
                    Figure(
                        "cost growth",
                        f"db transactions/s ({label})",
                        round(xacts, 1),
                        "1/s",
                        f"≤ {IDLE_TRANSACTIONS_TARGET:g}" if at_top else "",
                        xacts <= IDLE_TRANSACTIONS_TARGET if at_top else None,
                    ),
                    Figure("cost growth", f"db rows read/s ({label})", round(reads[level]), "1/s"),
                    Figure(
                        "cost growth", f"db row writes/s ({label})", round((w1 - w0) / dt, 1), "1/s"
                    ),
                    Figure(
                        "cost growth", f"broker frames/s ({label})", round((f1 - f0) / dt, 1), "1/s"
                    ),
                ]
                tick()
        low, high = min(reads), max(reads)
        if high > low:
            growth = reads[high] / max(reads[low], 1.0)
            figures.append(
                Figure(
                    "cost growth",
                    f"rows read/s at {high} ÷ at {low} observers ({services} services)",
                    round(growth, 2),
                    "x",
                    f"≤ {IDLE_READS_GROWTH_TARGET:g}",
                    growth <= IDLE_READS_GROWTH_TARGET,
                    "grows with the services, not with the observers",
                )
            )
    return figures


def _distribution(
    scenario: str,
    what: str,
    ms: list[float],
    unit: str,
    *,
    p99_target: float,
) -> list[Figure]:
    p99 = percentile(ms, 99)
    return [
        Figure(scenario, f"{what} p50", round(percentile(ms, 50), 2), unit),
        Figure(
            scenario,
            f"{what} p99",
            round(p99, 2),
            unit,
            f"< {p99_target}",
            p99 < p99_target,
            f"{len(ms)} samples",
        ),
        Figure(scenario, f"{what} max", round(max(ms, default=float("nan")), 2), unit),
    ]


#: What the outputs scenario's queue keeps: a bound, persistent queue makes the broker do a real
#: consumer's enqueue work, with nobody consuming during the window (a Python consumer of 20,000
#: messages a second would take a core of this machine's two).
OUTPUTS_QUEUE_MAX = 100_000


async def outputs_throughput(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    """One service, ``outputs_observers`` observers emitting (records that commit on their
    own), over ``outputs_seconds``: records committed and published (confirmed) per second,
    commit → confirmed (the service's own histogram), CPU per record of every process; the
    same lag first with a quarter of them emitting (a load the broker carries here), and the
    broker's own floor for the same messages; then a plain aio-pika consumer reads what its
    queue kept and checks every message is whole."""
    import aio_pika

    from orch_contracts.outputs import Output

    n, seconds = size.outputs_observers, size.outputs_seconds
    rate = 20.0  # records per observer per second: 20,000/s at 1,000 observers
    per_tick = 4
    port = free_port()
    floor, floor_p99 = await _outputs_floor(bench.settings.amqp_url, seconds=3.0)
    async with bench.cluster("outputs") as c:
        await c.start(services=1, worker_count=n, ORCH_METRICS_PORT=port)
        connection = await aio_pika.connect(bench.settings.amqp_url)
        try:
            channel = await connection.channel()
            exchange = await channel.declare_exchange(
                f"{c.prefix}.outputs", aio_pika.ExchangeType.TOPIC, durable=True
            )
            queue = await channel.declare_queue(
                f"{c.prefix}.bench-outputs",
                durable=True,
                arguments={"x-max-length": OUTPUTS_QUEUE_MAX, "x-overflow": "drop-head"},
            )
            await queue.bind(exchange, routing_key="#")
            params = {"interval": per_tick / rate, "per_tick": per_tick}
            light = n // 4
            await c.create_many(light, "bench_emitter", params, tag="l")
            await c.wait_running(light, timeout=120)
            await quiet(3.0, "let the emitters reach their rate")
            low = await _outputs_window(c, port, seconds / 2, tick)
            await c.create_many(n - light, "bench_emitter", params, tag="e")
            await c.wait_running(n, timeout=120)
            await quiet(3.0, "let the emitters reach their rate")
            full = await _outputs_window(c, port, seconds, tick)
            read, whole = await _read_outputs(channel, queue.name, Output)
            await queue.delete(if_unused=False, if_empty=False)
        finally:
            await connection.close()

    before, after, cpu, elapsed = full
    backlog = after.get("orch_outputs_unconfirmed", {})

    def counted(name: str) -> float:
        return sum(after.get(name, {}).values()) - sum(before.get(name, {}).values())

    committed = counted("orch_outputs_committed_total") / elapsed
    published = counted("orch_outputs_published_total") / elapsed
    lag_n, lag_p99 = _bucket_percentile(
        before.get("orch_output_lag_seconds", {}), after.get("orch_output_lag_seconds", {}), 0.99
    )
    low_n, low_p99 = _bucket_percentile(
        low[0].get("orch_output_lag_seconds", {}), low[1].get("orch_output_lag_seconds", {}), 0.99
    )
    cpu_total = sum(cpu.values())
    per_record = cpu_total / max(1.0, published * elapsed) * 1e6
    profile = ", ".join(f"{k} {v / elapsed:.2f}" for k, v in sorted(cpu.items()))
    return [
        Figure(
            "outputs",
            f"records committed per second ({n} observers emitting, one service)",
            round(committed),
            "/s",
            target="≥ 20000",
            passed=committed >= 20_000,
        ),
        Figure(
            "outputs",
            "records published (broker-confirmed) per second",
            round(published),
            "/s",
            target="≥ 20000",
            passed=published >= 20_000,
            note=f"unconfirmed at the end: {int(backlog.get(0.0, 0))}",
        ),
        Figure(
            "outputs",
            "the broker's own floor: a bare publisher of the same messages",
            round(floor),
            "/s",
            note=f"the service published {published / floor:.2f} times it",
        ),
        Figure(
            "outputs",
            "commit → confirmed p99 (the bucket it falls in)",
            round(lag_p99 * 1000, 1),
            "ms",
            target="< 50",
            passed=lag_p99 <= 0.05,
            note=f"{lag_n} commits",
        ),
        Figure(
            "outputs",
            f"commit → confirmed p99 at {light * rate:.0f} records/s ({light} emitting)",
            round(low_p99 * 1000, 1),
            "ms",
            note=f"{low_n} commits; the broker's floor: rounds of 100 confirmed in "
            f"{floor_p99 * 1000:.1f} ms p99",
        ),
        Figure(
            "outputs",
            "CPU per record, all processes",
            round(per_record, 1),
            "µs",
            note=f"cores by role: {profile}",
        ),
        Figure(
            "outputs",
            "messages a plain consumer read afterwards, whole",
            whole,
            "",
            target=f"= {read}",
            passed=read > 0 and whole == read,
        ),
    ]


Window = tuple[
    dict[str, dict[float, float]], dict[str, dict[float, float]], dict[str, float], float
]


async def _outputs_window(c: BenchCluster, port: int, seconds: float, tick: Tick) -> Window:
    """(the service's metrics before, after, CPU by role, seconds) of one measuring window."""
    before = await _histograms(port)
    cpu0 = cpu_by_role(c)
    t0 = time.monotonic()
    for _ in range(int(seconds)):
        await asyncio.sleep(1.0)
        tick()
    elapsed = time.monotonic() - t0
    return before, await _histograms(port), cpu_by_role(c, cpu0), elapsed


async def _outputs_floor(amqp_url: str, *, seconds: float) -> tuple[float, float]:
    """(records a second, p99 seconds of a round of 100 from publish to confirm) that the
    broker gives a bare publisher of output messages (the same frames, rounds of 1,000, into a
    bound durable queue like the scenario's), with no orchestrator around: what the service's
    own figures compare to."""
    import aio_pika

    from orch_contracts.outputs import Committed
    from orch_contracts.topology import Topology, publish_outputs

    topology = Topology(f"orch-floor-{uuid.uuid4().hex[:8]}")
    record = json.dumps({"t": time.time()})
    commits = [
        Committed(uuid.uuid4(), 1, 1, "bench_emitter", f"e-{i}", time.time(), (record,) * 4)
        for i in range(250)
    ]
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(
            topology.outputs_exchange, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(
            f"{topology.prefix}.q",
            durable=True,
            arguments={"x-max-length": OUTPUTS_QUEUE_MAX, "x-overflow": "drop-head"},
        )
        await queue.bind(exchange, routing_key="#")
        sent, t0 = 0, time.monotonic()
        try:
            while time.monotonic() - t0 < seconds:
                await publish_outputs(channel, topology, commits)
                sent += 1000
            rate = sent / (time.monotonic() - t0)
            rounds: list[float] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                started = time.monotonic()
                await publish_outputs(channel, topology, commits[:25])
                rounds.append(time.monotonic() - started)
            return rate, percentile(rounds, 99)
        finally:
            await queue.delete(if_unused=False, if_empty=False)
            await exchange.delete()
    finally:
        await connection.close()


async def _read_outputs(channel: Any, queue: str, parse: Any, limit: int = 2000) -> tuple[int, int]:
    """(read, of which whole output messages) of the first ``limit`` messages in ``queue``."""
    q = await channel.get_queue(queue, ensure=False)
    read = whole = 0
    while read < limit and (message := await q.get(no_ack=True, fail=False)) is not None:
        read += 1
        with contextlib.suppress(ValueError):
            parse.from_message(message.body, dict(message.headers))
            whole += 1
    return read, whole


def _bucket_percentile(
    before: dict[float, float], after: dict[float, float], q: float
) -> tuple[int, float]:
    """(observations, the bucket bound under which the ``q`` quantile fell) between scrapes."""
    deltas = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = deltas.get(float("inf"), 0.0)
    bound = next((le for le, k in deltas.items() if k >= q * total), float("inf"))
    return int(total), bound


SCENARIOS: dict[str, tuple[Callable[..., Any], Callable[[Size], int]]] = {
    "start": (start_latency, lambda s: s.start_samples),
    "throughput": (create_throughput, lambda s: 1),
    "bulk": (bulk_intake, lambda s: 1),
    "cancel": (cancel_latency, lambda s: s.cancel_samples),
    "crash": (crash_failover, lambda s: len(s.crash_moved)),
    "freeze": (freeze_failover, lambda s: 1),
    "broker": (broker_restart, lambda s: 1),
    "nodeloss": (node_loss, lambda s: 1),
    "graceful": (graceful_move, lambda s: 1),
    "join": (join_rebalance, lambda s: 1),
    "density": (density, lambda s: len(s.density_levels)),
    "cost": (cost_growth, lambda s: len(s.cost_observers) * len(s.cost_services)),
    "outputs": (outputs_throughput, lambda s: int(s.outputs_seconds) + int(s.outputs_seconds / 2)),
}


def _observability() -> tuple[Callable[..., Any], Callable[[Size], int]]:
    from orch_bench.overhead import observability_cost

    return observability_cost, lambda s: 3 * s.start_samples


SCENARIOS["observability"] = _observability()


def _fleet() -> tuple[Callable[..., Any], Callable[[Size], int]]:
    from orch_bench.fleet import fleet

    return fleet, lambda s: 10


SCENARIOS["fleet"] = _fleet()
#: Left out of --quick (ask for them with --only): the observability cost's paired samples
#: take minutes, and density's target (50,000 in one process) only a full run can show.
#: The broker restart needs rights on the broker and stops it for every user of it; the node
#: loss starts a three-node cluster of its own (about 16 s and 450 MiB); the outputs scenario
#: loads the machine with 20,000 records a second for its whole length; the fleet starts 20
#: service processes and 100,000 observers (about 10 minutes, and PostgreSQL's max_connections
#: raised past its default 100).
FULL_ONLY = frozenset({"observability", "density", "broker", "nodeloss", "outputs", "fleet"})
