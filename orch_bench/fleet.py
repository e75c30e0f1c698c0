"""The fleet scenario (``orch bench --only fleet``): many service processes and a hundred
thousand observers on this one machine.

What it measures, in one run:

- the broker's own intake floor: bare aio-pika publishing persistent start messages with
  confirms, in the batches bulk create uses, to a process of consumers that hold them unacked
  as services do (``intake_floor``, ``hold``);
- bulk intake from ``10%`` to all of the observers, through ``POST /observers/batch``, as a
  rate, as a ratio to that floor, and as CPU per observer by role;
- idle rows read per second at 10 % and at 100 % of the observers (the same services);
- the p99 and response size of the API's list and lookup, the console's views, ``/services``,
  ``/pools`` and ``/metrics`` at 100 %;
- the memory of the manager and of each service, and a service's memory per observer
  (marginal, between 10 % and 100 %).

Moves at this size (a SIGKILLed service, five at once, a service joining, the leader killed) are
not measured here yet.

Each service's database pool is capped (``ORCH_DB_POOL_MAX``), so that 20 services hold 80
connections. With the manager's and this process's, that is more than PostgreSQL's default
``max_connections`` of 100 leaves room for: the scenario reads the server's limit first and
refuses to start, saying what it needs, when the fleet would not fit.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
import httpx

from orch.cluster import quiet
from orch_bench.harness import Bench, BenchCluster, Figure, cpu_by_role, percentile, rss_bytes

#: Connections each service's pool opens at most (its lease session is one more).
POOL_MAX = 3
#: Connections the manager, this process and a margin may hold besides the services'.
OTHERS = 30
#: The held-rows check's period and a little: one window sees each service check once.
IDLE_WINDOW = 31.0
#: For the database's statistics to catch up before a window, seconds.
SETTLE = 11.0
#: Requests per read measured.
READS = 60
#: Targets (issue: a hundred thousand observers on twenty processes).
INTAKE_TARGET = 5000
FLOOR_RATIO_TARGET = 0.7
CPU_TARGET_MS = 0.4
IDLE_RATIO_TARGET = 1.5
LIST_TARGET_MS = 100
VIEW_TARGET_MS = 200
METRICS_TARGET_MS = 100
MEMORY_TARGET_KIB = 10.0

Tick = Callable[..., None]
IDLE = {"interval": 3600}
#: What is read at full size: (label, path, target ms).
READS_AT_SIZE = (
    ("GET /observers (a page of 100)", "/observers?limit=100", LIST_TARGET_MS),
    ("GET /observers/{id}", "/observers/{id}", None),
    ("GET /views/observers", "/views/observers", VIEW_TARGET_MS),
    ("GET /views/totals", "/views/totals", VIEW_TARGET_MS),
    ("GET /views/activity", "/views/activity", VIEW_TARGET_MS),
    ("GET /services", "/services", VIEW_TARGET_MS),
    ("GET /pools", "/pools", VIEW_TARGET_MS),
    ("GET /metrics", "/metrics", METRICS_TARGET_MS),
)


async def hold(url: str, queue: str, n: int, consumers: int) -> None:
    """The floor's consumers, a process of their own: ``consumers`` channels (prefetch
    n/consumers) hold ``n`` messages unacked, as services hold running observers' starts; says
    ``consuming`` once ready and ``received N`` once they all came."""
    connection = await aio_pika.connect(url)
    got = 0
    done = asyncio.Event()

    async def received(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal got
        got += 1
        if got >= n:
            done.set()

    for _ in range(consumers):
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=-(-n // consumers))
        await (await channel.declare_queue(queue, durable=True)).consume(received)
    print("consuming", flush=True)
    await done.wait()
    print(f"received {got}", flush=True)
    await asyncio.Event().wait()  # holds them until killed


async def intake_floor(
    c: BenchCluster, url: str, n: int, *, consumers: int, batch: int = 1000, senders: int = 2
) -> float:
    """Seconds for bare aio-pika to publish ``n`` persistent messages with confirms, ``batch``
    at a time on each of ``senders`` channels (as the manager publishes starts), to a durable
    queue, until a consumer process (``hold``) has received them all."""
    queue = f"{c.prefix}.floor"
    body = b'{"observer_id": "%s", "dispatch_id": "%s"}'
    consumer = c.spawn("floor", [url, queue, str(n), str(consumers)], module="orch_bench.fleet")
    publishing = await aio_pika.connect(url)
    try:
        await consumer.wait_log("consuming", timeout=60)
        todo = iter(range(0, n, batch))

        async def sender() -> None:
            channel = await publishing.channel(publisher_confirms=True)
            exchange = channel.default_exchange
            for first in todo:
                await asyncio.gather(
                    *(
                        exchange.publish(
                            aio_pika.Message(
                                body % (uuid.uuid4().hex.encode(), uuid.uuid4().hex.encode()),
                                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                            ),
                            routing_key=queue,
                        )
                        for _ in range(min(batch, n - first))
                    )
                )

        began = time.monotonic()
        await asyncio.gather(*(sender() for _ in range(senders)))
        await consumer.wait_log(f"received {n}", timeout=600)
        return time.monotonic() - began
    finally:
        consumer.signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            await (await publishing.channel()).queue_delete(queue)
        await publishing.close()


async def _idle_reads(c: BenchCluster) -> float:
    """Rows read per second by an idle cluster over one window (after ANALYZE and a settle)."""
    await (await c.connect()).execute("ANALYZE observers")
    await quiet(SETTLE, "let the database's counters catch up")
    t0, _, _, r0 = await c.db_counters()
    await asyncio.sleep(IDLE_WINDOW)
    t1, _, _, r1 = await c.db_counters()
    return (r1 - r0) / (t1 - t0)


async def _read_p99(client: httpx.AsyncClient, path: str) -> tuple[float, int]:
    """(p99 ms, response bytes) of ``READS`` requests of ``path``, one after the other."""
    times: list[float] = []
    size = 0
    for _ in range(READS):
        t = time.perf_counter()
        r = await client.get(path)
        times.append((time.perf_counter() - t) * 1000)
        if r.status_code != 200:
            raise RuntimeError(f"GET {path}: {r.status_code} {r.text[:200]!r}")
        size = len(r.content)
    return percentile(times, 99), size


def _service_rss(c: BenchCluster) -> list[int]:
    return [rss_bytes(p.pid) for p in c.procs if p.name != "manager" and p.alive]


async def fleet(bench: Bench, size: Any, tick: Tick) -> list[Figure]:
    services, per = size.fleet_services, size.fleet_per_service
    n = services * per
    first = n // 10
    figures: list[Figure] = []
    needed = services * (1 + POOL_MAX) + OTHERS
    async with bench.cluster("fleet", db_pool_max=POOL_MAX, prune_interval=5) as c:
        limit = int(await (await c.connect()).fetchval("SHOW max_connections"))
        if limit < needed:
            raise RuntimeError(
                f"{services} services need PostgreSQL's max_connections ≥ {needed} "
                f"(it is {limit}): raise it for the run (docs/scaling.md)"
            )
        floor = await intake_floor(c, bench.settings.amqp_url, n - first, consumers=services)
        tick()
        await c.start(services=services, worker_count=per)
        await c.grow_to(first, tag="f")
        tick()
        reads_low = await _idle_reads(c)
        rss_low = _service_rss(c)
        tick()

        todo = iter(range(first, n, 1000))

        async def sender() -> None:
            for start in todo:
                await c.create_batches(min(1000, n - start), "ticker", IDLE, tag=f"b{start}")

        before = cpu_by_role(c)
        began = time.monotonic()
        await asyncio.gather(sender(), sender())
        await c.wait_running(n, timeout=900)
        took = time.monotonic() - began
        cpu = cpu_by_role(c, since=before)
        tick()
        reads_high = await _idle_reads(c)
        rss_high = _service_rss(c)
        tick()
        reads: dict[str, tuple[float, int]] = {}
        any_id = await (await c.connect()).fetchval("SELECT id FROM observers LIMIT 1")
        async with c.api() as client:
            await client.get("/metrics")  # the first scrape waits for its first read
            for label, path, _ in READS_AT_SIZE:
                reads[label] = await _read_p99(client, path.replace("{id}", str(any_id)))
        manager = next(p for p in c.procs if p.name == "manager")
        manager_rss = rss_bytes(manager.pid)
        tick()

    bulk = n - first
    rate = bulk / took
    floor_rate = bulk / floor
    per_role = ", ".join(
        f"{role} {s / bulk * 1000:.3f}" for role, s in sorted(cpu.items()) if s > 0
    )
    cpu_ms = sum(cpu.values()) / bulk * 1000
    idle_ratio = reads_high / reads_low if reads_low else float("inf")
    mean_low = sum(rss_low) / len(rss_low)
    mean_high = sum(rss_high) / len(rss_high)
    kib = (mean_high - mean_low) / (per - per // 10) / 1024
    label = f"{services} services of {per}"
    figures += [
        Figure("fleet", "broker intake floor", round(floor_rate), "1/s", note=f"{bulk} messages"),
        Figure(
            "fleet",
            "bulk intake, observers/s reaching processing",
            round(rate),
            "1/s",
            f"≥ {INTAKE_TARGET}",
            rate >= INTAKE_TARGET,
            f"{bulk} from {first} to {n} ({label}) in {took:.1f} s",
        ),
        Figure(
            "fleet",
            "bulk intake ÷ broker floor",
            round(rate / floor_rate, 2),
            "x",
            f"≥ {FLOOR_RATIO_TARGET}",
            rate / floor_rate >= FLOOR_RATIO_TARGET,
        ),
        Figure(
            "fleet",
            "CPU per observer, bulk, all roles",
            round(cpu_ms, 3),
            "ms",
            f"≤ {CPU_TARGET_MS}",
            cpu_ms <= CPU_TARGET_MS,
            f"by role, ms: {per_role}",
        ),
        Figure("fleet", f"idle rows read/s at {first}", round(reads_low), "1/s"),
        Figure("fleet", f"idle rows read/s at {n}", round(reads_high), "1/s"),
        Figure(
            "fleet",
            f"idle rows read/s, {n} ÷ {first}",
            round(idle_ratio, 2),
            "x",
            f"≤ {IDLE_RATIO_TARGET}",
            idle_ratio <= IDLE_RATIO_TARGET,
        ),
    ]
    for label, _, target in READS_AT_SIZE:
        p99, body = reads[label]
        figures.append(
            Figure(
                "fleet",
                f"{label} p99 at {n}",
                round(p99, 1),
                "ms",
                f"< {target}" if target else "",
                p99 < target if target else None,
                f"{body} bytes",
            )
        )
    figures += [
        Figure("fleet", f"manager RSS at {n}", round(manager_rss / 2**20, 1), "MiB"),
        Figure(
            "fleet",
            f"service RSS at {per}, mean",
            round(mean_high / 2**20, 1),
            "MiB",
            note=f"max {max(rss_high) / 2**20:.1f} MiB",
        ),
        Figure(
            "fleet",
            f"service memory per observer, {per // 10} → {per}",
            round(kib, 2),
            "KiB",
            f"≤ {MEMORY_TARGET_KIB:g}",
            kib <= MEMORY_TARGET_KIB,
        ),
    ]
    return figures


if __name__ == "__main__":
    url_, queue_, n_, consumers_ = sys.argv[1:5]
    asyncio.run(hold(url_, queue_, int(n_), int(consumers_)))
