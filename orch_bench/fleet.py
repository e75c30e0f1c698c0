"""The fleet scenario (``orch bench --only fleet``): many service processes and a hundred
thousand observers on this one machine.

What it measures, in one run:

- the broker's own intake floor: bare aio-pika publishing persistent start messages with
  confirms, in the batches bulk create uses, to a process of consumers that hold them unacked
  as services do (``intake_floor``, ``hold``);
- bulk intake from ``10%`` to all of the observers, through ``POST /observers/batch``, as a
  rate, as a ratio to that floor, and as CPU per observer by role;
- idle rows read per second, and idle CPU by role, at 10 % and at 100 % of the observers (the
  same services), each once the rebalance's moves after the bulk are over; and CPU per
  observer in the bulk less that idle burn;
- the p99 and response size of the API's list and lookup, the console's views, ``/services``,
  ``/pools`` and ``/metrics`` at 100 %;
- the memory of the manager and of each service, and a service's memory per observer
  (marginal, between 10 % and 100 %).

Then, at full size, moves (``moves``), each timed from the observers' own tick logs and put
next to the broker's floor for the same count, measured just before on the same loaded machine:

- one service SIGKILLed: seconds from the kill until each of its observers ticked in a new copy,
  re-dispatches and takes per moved observer, and duplicate starts (two new copies of one);
- a service joining: seconds until every live service holds its share ±10 %, and observers moved
  twice;
- five services SIGKILLed at once, as the first;
- the leader manager SIGKILLed: seconds until the standby leads, the rows its loops read in their
  first seconds next to the idle rate, and observers started again (re-dispatches, and new copies
  in the tick logs) that did not need it.

The observers are ``recorder`` at one tick a minute and one checkpoint (at their first tick), so
that they cost what idle tickers cost and still say in their own logs when each copy began. A
service has slots enough (and 5 % more) for the fifteen left after five are killed to hold every
observer: 7,000 for a share of 5,000.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import httpx

from orch.cluster import Proc, quiet, wait_for
from orch_bench.floor import measure_floor
from orch_bench.harness import Bench, BenchCluster, Figure, cpu_by_role, percentile, rss_bytes
from orch_bench.ticklog import Tick, TickTail
from orch_contracts.statuses import Event

#: Connections each service's pool opens at most (its lease session is one more).
POOL_MAX = 3
#: Connections two managers, this process and a margin may hold besides the services'.
OTHERS = 50
#: Slots beyond what the services left after the largest kill need to hold every observer.
SLOTS_MARGIN = 1.05
#: Seconds between an observer's ticks (and so its log lines): a copy's first tick is at its start.
TICK_EVERY = 60.0
#: Seconds watched after all moved observers run again, for a second copy to show.
AFTER_MOVE = 5.0
#: Seconds watched after the new leader leads: its first pass, and what it re-dispatches.
LEADER_WINDOW = 15.0
#: The held-rows check's period and a little: one window sees each service check once.
IDLE_WINDOW = 31.0
#: For the database's statistics to catch up before a window, seconds.
SETTLE = 11.0
#: Seconds an idle window waits at most for the moves after a bulk to end.
MOVES_PATIENCE = 180.0
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
KILL_RATIO_TARGET = 2.0
KILL5_TARGET_S = 10.0
JOIN_TARGET_S = 60.0
#: Seconds a join is watched before it is reported as not reaching its fair share.
JOIN_PATIENCE = 240.0
LEADER_MARGIN_S = 2.0

Progress = Callable[..., None]
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


@dataclass
class Idle:
    """An idle cluster over one window: rows read per second, and CPU seconds per second by
    role (its observers' own ticks included)."""

    reads: float
    cpu: dict[str, float]

    @property
    def cores(self) -> float:
        return sum(self.cpu.values())


async def _moves_over(c: BenchCluster) -> None:
    """Until no observer was taken, handed off or re-dispatched for ``SETTLE`` seconds (the
    rebalance spreads the bulk's observers in rounds for a while after it): an idle window
    measures an idle cluster, not the rebalance's last rounds. At most ``MOVES_PATIENCE``."""
    db = await c.connect()

    async def over() -> bool:
        # The newest such event, by the primary key backwards: a scan of the whole history
        # here was counted in the leader kill's window (a backend reports its reads up to 10 s
        # late), as 16,000 history rows read a second by the new leader.
        since = await db.fetchval(
            "SELECT EXTRACT(EPOCH FROM clock_timestamp() - at) FROM observer_events "
            "WHERE event = ANY($1::text[]) ORDER BY id DESC LIMIT 1",
            [Event.TAKEN.value, Event.HANDOFF_REQUESTED.value, Event.REDISPATCHED.value],
        )
        return since is None or since > SETTLE

    with contextlib.suppress(TimeoutError):  # a rebalance that never settles: measured anyway
        await wait_for(over, timeout=MOVES_PATIENCE, what="the moves' end", every=1.0)


async def _idle(c: BenchCluster) -> Idle:
    """One idle window (once the moves are over, after ANALYZE and a settle)."""
    await _moves_over(c)
    await (await c.connect()).execute("ANALYZE observers")
    await quiet(SETTLE, "let the database's counters catch up")
    t0, _, _, r0 = await c.db_counters()
    before = cpu_by_role(c)
    await asyncio.sleep(IDLE_WINDOW)
    t1, _, _, r1 = await c.db_counters()
    cpu = cpu_by_role(c, since=before)
    return Idle((r1 - r0) / (t1 - t0), {role: s / (t1 - t0) for role, s in cpu.items()})


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


async def fleet(bench: Bench, size: Any, tick: Progress) -> list[Figure]:
    services, per = size.fleet_services, size.fleet_per_service
    n = services * per
    first = n // 10
    figures: list[Figure] = []
    needed = (services + 1) * (1 + POOL_MAX) + OTHERS  # one more service joins
    # The rebalance runs, as by default: a joining service is given its share.
    async with bench.cluster(
        "fleet", db_pool_max=POOL_MAX, prune_interval=5, rebalance="true"
    ) as c:
        limit = int(await (await c.connect()).fetchval("SHOW max_connections"))
        if limit < needed:
            raise RuntimeError(
                f"{services} services need PostgreSQL's max_connections ≥ {needed} "
                f"(it is {limit}): raise it for the run (docs/scaling.md)"
            )
        floor = await intake_floor(c, bench.settings.amqp_url, n - first, consumers=services)
        tick()
        slots = round(n / (services - _many(services)) * SLOTS_MARGIN)
        await c.start(services=services, worker_count=slots)
        await c.start_manager()  # a standby, for the leader's kill
        ticks = str(c.workdir / "ticks")
        params = {"dir": ticks, "interval": TICK_EVERY, "checkpoint_every": 10**6}
        await c.create_batches(first, "recorder", params, tag="f")
        await c.wait_running(first, timeout=300)
        tick()
        idle_low = await _idle(c)
        rss_low = _service_rss(c)
        tick()

        todo = iter(range(first, n, 1000))

        async def sender() -> None:
            for start in todo:
                await c.create_batches(min(1000, n - start), "recorder", params, tag=f"b{start}")

        before = cpu_by_role(c)
        began = time.monotonic()
        await asyncio.gather(sender(), sender())
        await c.wait_running(n, timeout=900)
        took = time.monotonic() - began
        cpu = cpu_by_role(c, since=before)
        tick()
        idle_high = await _idle(c)
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
        moved = await moves(bench, c, n, per, slots, idle_high.reads, tick)

    bulk = n - first
    rate = bulk / took
    floor_rate = bulk / floor
    per_role = ", ".join(
        f"{role} {s / bulk * 1000:.3f}" for role, s in sorted(cpu.items()) if s > 0
    )
    cpu_ms = sum(cpu.values()) / bulk * 1000
    reads_low, reads_high = idle_low.reads, idle_high.reads
    idle_ratio = reads_high / reads_low if reads_low else float("inf")
    # The idle burn (leases, the observers' own ticks, the leader's loops) grows from the
    # first to the second window during the bulk: its mean over the bulk, taken away.
    burn = (idle_low.cores + idle_high.cores) / 2 * took
    marginal_ms = max(0.0, sum(cpu.values()) - burn) / bulk * 1000
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
        Figure(
            "fleet",
            "CPU per observer, bulk, less the idle burn",
            round(marginal_ms, 3),
            "ms",
            note=f"the idle burn over the bulk: {burn:.1f} CPU s of {sum(cpu.values()):.1f}",
        ),
        *(
            Figure(
                "fleet",
                f"idle CPU at {count}, all roles",
                round(idle.cores, 3),
                "cores",
                note="by role, cores: "
                + ", ".join(f"{r} {v:.3f}" for r, v in sorted(idle.cpu.items()) if v > 0),
            )
            for count, idle in ((first, idle_low), (n, idle_high))
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
    return figures + moved


@dataclass
class Moved:
    """What the observers' logs say of one fault's moves, and what the orchestrator did."""

    observers: int
    #: Per moved observer: seconds from the fault to its first tick in a new copy.
    resumed: list[float]
    #: Moved observers of which more than one new copy ticked.
    twice: int
    #: ``observer_events`` of the moved observers since the fault, by event.
    events: dict[str, int]


class NewCopies:
    """Per observer (of ``observers``, if given): the copies that ticked after ``at``, and when
    the first of them did."""

    def __init__(self, at: float, observers: set[str] | None = None) -> None:
        self.at = at
        self.observers = observers
        self.first: dict[str, float] = {}
        self.copies: dict[str, set[tuple[int, int]]] = {}

    def take(self, ticks: list[Tick]) -> None:
        for t in ticks:
            if t.at > self.at and (self.observers is None or t.observer in self.observers):
                self.first[t.observer] = min(self.first.get(t.observer, t.at), t.at)
                self.copies.setdefault(t.observer, set()).add(t.copy)


async def _events(c: BenchCluster, at: float, observers: set[str] | None) -> dict[str, int]:
    db = await c.connect()
    rows = await db.fetch(
        "SELECT event, count(*) AS k FROM observer_events WHERE at > to_timestamp($1) "
        "AND ($2::text[] IS NULL OR observer_id = ANY($2::text[]::uuid[])) GROUP BY event",
        at,
        None if observers is None else sorted(observers),
    )
    return {r["event"]: int(r["k"]) for r in rows}


async def _kill(c: BenchCluster, tail: TickTail, victims: list[Proc]) -> Moved:
    """SIGKILL ``victims`` at once; wait until every observer they held ticks in a new copy."""
    db = await c.connect()
    ids = [await c.service_id(p) for p in victims]
    held = {
        r[0]
        for r in await db.fetch(
            "SELECT id::text FROM observers WHERE service_id = ANY($1::uuid[]) "
            "AND status = 'processing'",
            ids,
        )
    }
    tail.skip()
    at = time.time()
    for p in victims:
        p.signal(signal.SIGKILL)
    new = NewCopies(at, held)

    async def resumed() -> bool:
        new.take(tail.read())
        return len(new.first) == len(held)

    await wait_for(resumed, timeout=300, what=f"{len(held)} moved observers ticking", every=0.25)
    await quiet(AFTER_MOVE, "a second copy of a moved observer would start")
    new.take(tail.read())
    return Moved(
        len(held),
        [new.first[o] - at for o in held],
        sum(1 for copies in new.copies.values() if len(copies) > 1),
        await _events(c, at, held),
    )


async def _floor(bench: Bench, c: BenchCluster, count: int) -> float:
    """The broker's own move of ``count`` held messages, from the kill to the last resumed."""
    gaps = await measure_floor(
        c, bench.settings.amqp_url, c.workdir / f"floor-{count}", count, TICK_EVERY, from_fault=True
    )
    return max(gaps)


def _kill_figures(scenario: str, m: Moved, floor: float, target: Figure | None) -> list[Figure]:
    worst = max(m.resumed)
    ratio = worst / floor
    per = {e: k / m.observers for e, k in m.events.items()}
    figures = [
        Figure(
            scenario,
            "last moved observer ticking again",
            round(worst, 2),
            "s",
            note=f"{m.observers} moved; median {sorted(m.resumed)[len(m.resumed) // 2]:.2f} s",
        ),
        Figure(scenario, "the broker's floor for as many", round(floor, 2), "s"),
        Figure(
            scenario,
            "last moved ÷ floor",
            round(ratio, 2),
            "x",
            f"≤ {KILL_RATIO_TARGET:g}",
            ratio <= KILL_RATIO_TARGET,
        ),
        Figure(
            scenario,
            "re-dispatches per moved observer",
            round(per.get("redispatched", 0.0), 3),
            "",
            note="per moved observer: "
            + ", ".join(f"{e} {k:.3f}" for e, k in sorted(per.items()) if e != "redispatched"),
        ),
        Figure(scenario, "moved observers started twice", float(m.twice), "", "0", m.twice == 0),
    ]
    if target is not None:
        figures.insert(1, target)
    return figures


def _many(services: int) -> int:
    """How many services are killed at once: five of twenty."""
    return max(1, services // 4)


async def _leads(c: BenchCluster, manager: Proc) -> bool:
    async with httpx.AsyncClient(headers=c.auth_headers, timeout=5) as h:
        try:
            r = await h.get(f"http://127.0.0.1:{manager.port}/leader")
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and bool(r.json()["this_replica_leads"])


async def moves(
    bench: Bench,
    c: BenchCluster,
    n: int,
    per: int,
    slots: int,
    idle_reads: float,
    tick: Progress,
) -> list[Figure]:
    """The moves at full size, in turn: one service killed, one joining, five killed at once,
    the leader killed (see the module's docstring). A step that fails is one figure saying so;
    the steps after it still run."""
    figures: list[Figure] = []
    tail = TickTail(c.workdir / "ticks")
    services = [p for p in c.procs if p.name.startswith("s") and p.alive]
    live = services[1:]
    k = _many(len(services))

    async def step(scenario: str, measure: Callable[[], Awaitable[list[Figure]]]) -> None:
        try:
            figures.extend(await measure())
        except Exception as exc:  # one step's failure is its figure, not the run's end
            figures.append(Figure(scenario, "step failed", None, "", note=repr(exc)[:300]))
        tick()

    async def kill_one() -> list[Figure]:
        floor = await _floor(bench, c, per)
        moved = await _kill(c, tail, services[:1])
        return _kill_figures(f"fleet, 1 of {len(services)} killed", moved, floor, None)

    async def join() -> list[Figure]:
        joiner = await c.start_service(f"s{len(services) + 1}", slots)
        live.append(joiner)
        return await _join(c, n, live)

    async def kill_many() -> list[Figure]:
        floor = await _floor(bench, c, k * per)
        moved = await _kill(c, tail, live[:k])
        last = max(moved.resumed)
        scenario = f"fleet, {k} of {len(live)} killed at once"
        all_running = Figure(
            scenario,
            "all running again",
            round(last, 2),
            "s",
            f"≤ {KILL5_TARGET_S:g}",
            last <= KILL5_TARGET_S,
        )
        return _kill_figures(scenario, moved, floor, all_running)

    await step(f"fleet, 1 of {len(services)} killed", kill_one)
    await step(f"fleet, a service joins {len(live)}", join)
    await step(f"fleet, {k} killed at once", kill_many)
    await step("fleet, the leader killed", lambda: _leader_kill(c, tail, idle_reads))
    return figures


async def _join(c: BenchCluster, n: int, live: list[Proc]) -> list[Figure]:
    """Until every live service (the last one just joined) holds its share ±10 %, by the
    database's holders; and the observers handed over more than once meanwhile."""
    db = await c.connect()
    live_ids = [await c.service_id(p) for p in live]
    at = time.time()
    began = time.monotonic()
    share = n / len(live)
    worst = {"off": 1.0, "joiner": 0}

    async def fair() -> bool:
        rows = {
            r["service_id"]: r["k"]
            for r in await db.fetch(
                "SELECT service_id, count(*) AS k FROM observers WHERE status = 'processing' "
                "AND service_id = ANY($1::uuid[]) GROUP BY service_id",
                live_ids,
            )
        }
        held = [rows.get(sid, 0) for sid in live_ids]
        worst["off"] = max(abs(k - share) / share for k in held)
        worst["joiner"] = held[-1]
        return worst["off"] <= 0.1

    scenario = f"fleet, a service joins {len(live) - 1}"
    try:
        await wait_for(fair, timeout=JOIN_PATIENCE, what="every service within ±10 %", every=0.5)
        took: float | None = time.monotonic() - began
    except TimeoutError:
        took = None
    await quiet(AFTER_MOVE, "an observer would be moved again")
    handed = await db.fetch(
        "SELECT count(*) AS k FROM observer_events WHERE event = 'handoff requested' "
        "AND at > to_timestamp($1) GROUP BY observer_id",
        at,
    )
    twice = sum(1 for r in handed if r["k"] > 1)
    note = f"{len(handed)} observers moved, about {round(share)} expected"
    if took is None:
        note += (
            f"; after {JOIN_PATIENCE:g} s a service was {worst['off']:.0%} off its share, "
            f"the new one held {worst['joiner']}"
        )
    return [
        Figure(
            scenario,
            "time to fair share (±10 %)",
            None if took is None else round(took, 1),
            "s",
            f"< {JOIN_TARGET_S:g}",
            took is not None and took < JOIN_TARGET_S,
            note,
        ),
        Figure(scenario, "observers moved twice", float(twice), "", "0", twice == 0),
    ]


async def _table_reads(c: BenchCluster) -> dict[str, int]:
    """Rows read so far of each of the project's tables, by sequential scan (``<table> seq``)
    and by index (``<table> idx``); the database's own total counts the system catalogs too."""
    rows = await (await c.connect()).fetch(
        "SELECT relname, seq_tup_read, COALESCE(idx_tup_fetch, 0) AS idx FROM pg_stat_user_tables"
    )
    out: dict[str, int] = {}
    for r in rows:
        out[f"{r['relname']} seq"] = int(r["seq_tup_read"])
        out[f"{r['relname']} idx"] = int(r["idx"])
    return out


async def _leader_kill(c: BenchCluster, tail: TickTail, idle_reads: float) -> list[Figure]:
    """SIGKILL the leading manager, once the moves of the steps before are over; time until the
    standby leads, what its loops read first, and which observers started again."""
    await _moves_over(c)
    db = await c.connect()
    managers = [p for p in c.procs if p.name == "manager" and p.alive]
    leading = [p for p in managers if await _leads(c, p)]
    if len(leading) != 1 or len(managers) != 2:
        raise RuntimeError(f"{len(leading)} of {len(managers)} managers lead")
    leader, standby = leading[0], next(p for p in managers if p is not leading[0])
    epochs = {
        r[0]: r[1]
        for r in await db.fetch("SELECT id::text, epoch FROM observers WHERE status = 'processing'")
    }
    tail.skip()
    at = time.time()
    began = time.monotonic()
    leader.signal(signal.SIGKILL)
    await wait_for(lambda: _leads(c, standby), timeout=60, what="the standby leading", every=0.05)
    took = time.monotonic() - began
    t0, _, w0, r0 = await c.db_counters()
    tables0 = await _table_reads(c)
    await quiet(LEADER_WINDOW, "the new leader would re-dispatch what runs")
    t1, _, w1, r1 = await c.db_counters()
    tables1 = await _table_reads(c)
    by_table = sorted(
        ((t, (n - tables0.get(t, 0)) / (t1 - t0)) for t, n in tables1.items()), key=lambda x: -x[1]
    )
    new = NewCopies(at)
    new.take(tail.read())
    restarted = sum(
        1 for o, copies in new.copies.items() if any(e > epochs.get(o, 0) for e, _ in copies)
    )
    events = await _events(c, at, None)
    redispatched = events.get("redispatched", 0)
    ttl = float(c.env["ORCH_LEASE_TTL"])
    scenario = f"fleet, the leader killed at {len(epochs)}"
    reads = (r1 - r0) / (t1 - t0)
    return [
        Figure(
            scenario,
            "until the standby's loops run",
            round(took, 2),
            "s",
            f"≤ {ttl + LEADER_MARGIN_S:g}",
            took <= ttl + LEADER_MARGIN_S,
            f"lease TTL {ttl:g} s",
        ),
        Figure(
            scenario,
            f"rows read/s in the new leader's first {LEADER_WINDOW:g} s",
            round(reads),
            "1/s",
            note=f"idle {round(idle_reads)}/s; rows written {round((w1 - w0) / (t1 - t0))}/s; "
            "of the project's tables, /s: "
            + ", ".join(f"{t} {round(v)}" for t, v in by_table if v >= 1),
        ),
        Figure(
            scenario, "observers re-dispatched", float(redispatched), "", "0", redispatched == 0
        ),
        Figure(
            scenario,
            "observers started again (their logs)",
            float(restarted),
            "",
            "0",
            restarted == 0,
            "history since the kill: "
            + (", ".join(f"{e} {k}" for e, k in sorted(events.items())) or "none"),
        ),
    ]


if __name__ == "__main__":
    url_, queue_, n_, consumers_ = sys.argv[1:5]
    asyncio.run(hold(url_, queue_, int(n_), int(consumers_)))
