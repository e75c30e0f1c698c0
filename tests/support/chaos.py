"""A seeded random fault schedule over two managers and three services, and the verdict from the
observers' own tick logs.

Faults: SIGKILL, SIGSTOP of random length, SIGTERM, leader kill, drain, database resets and blips
(per service, through its own proxy), broker connection closes, silent AMQP partitions of random
length (blackholed), lease sessions ended while the process lives, broker restarts
(``rabbitmqctl stop_app`` / ``start_app``, restored whatever happens), delete/create churn.
After the schedule everything heals, and the tick logs must show: no two copies of an observer
ever ran at once, every live observer runs, deleted ones stopped, none failed. The seed and every
fault are printed, so a failure can be replayed.
"""

from __future__ import annotations

import asyncio
import collections
import random
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from orch_bench.ticklog import Tick, overlap_seconds, read_ticks
from tests.support.cluster import Cluster, Proc, wait_for
from tests.support.faults import LEASE_BACKEND, rabbitmqctl, via
from tests.support.proxy import Proxy

FAULTS = (
    "kill",
    "freeze",
    "term",
    "leader",
    "drain",
    "db_blip",
    "db_reset",
    "broker_close",
    "churn",
    "amqp_partition",
    "lease_kill",
    "broker_restart",
)


@dataclass
class Service:
    proc: Proc
    db: Proxy
    mq: Proxy


@dataclass
class Chaos:
    cluster: Cluster
    seed: int
    observers: int = 30
    worker_count: int = 40
    services: list[Service] = field(default_factory=list)
    managers: list[Proc] = field(default_factory=list)
    live: set[uuid.UUID] = field(default_factory=set)
    deleted: set[uuid.UUID] = field(default_factory=set)
    done: collections.Counter[str] = field(default_factory=collections.Counter)
    log: list[str] = field(default_factory=list)
    _names: int = 0
    _frozen: set[int] = field(default_factory=set)
    broker_down: bool = False
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        #: Every service ever started, for naming the processes in a report.
        self.all_services: list[Service] = []

    def note(self, what: str) -> None:
        line = f"{time.monotonic() - self.t0:7.2f}s {what}"
        self.log.append(line)
        print(f"[chaos seed={self.seed}] {line}", flush=True)

    # ------------------------------------------------------------------ the cluster
    async def start(self) -> None:
        for _ in range(2):
            self.managers.append(await self.cluster.start_manager(wait=30))
        for _ in range(3):
            await self._start_service()
        for _ in range(self.observers):
            await self._create()

    async def _start_service(self) -> None:
        self._names += 1
        db = await self.cluster.proxy(self.cluster.database_url)
        mq = await self.cluster.proxy(self.cluster.amqp_url)
        proc = await self.cluster.start_service(
            f"s{self._names}",
            worker_count=self.worker_count,
            database_url=via(self.cluster.database_url, db),
            amqp_url=via(self.cluster.amqp_url, mq),
            shutdown_timeout=2,
            wait=30,  # it may start while the broker is being restarted
        )
        self.services.append(Service(proc, db, mq))
        self.all_services.append(self.services[-1])

    def _api(self) -> httpx.AsyncClient:
        manager = self.rng.choice([m for m in self.managers if m.alive])
        return httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{manager.port}",
            timeout=30,
            headers=self.cluster.auth_headers,
        )

    async def _create(self) -> None:
        interval = self.rng.choice((0.05, 0.1))
        body = {
            "name": f"chaos-{uuid.uuid4().hex[:8]}",
            "kind": "recorder",
            "params": {
                "dir": str(self.cluster.tick_dir),
                "interval": interval,
                "checkpoint_every": self.rng.choice((1, 5)),
            },
        }
        async with self._api() as api:
            r = await api.post("/observers", json=body)
        assert r.status_code == 201, r.text
        self.live.add(uuid.UUID(r.json()["id"]))

    async def _delete(self, oid: uuid.UUID) -> None:
        async with self._api() as api:
            r = await api.delete(f"/observers/{oid}")
        assert r.status_code == 202, r.text
        self.live.discard(oid)
        self.deleted.add(oid)

    # ------------------------------------------------------------------ the faults
    def _pick_service(self) -> Service | None:
        running = [s for s in self.services if s.proc.alive and s.proc.pid not in self._frozen]
        return self.rng.choice(running) if running else None

    def _later(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace(self, s: Service) -> None:
        self.services.remove(s)
        await self._start_service()

    async def step(self) -> None:
        fault = self.rng.choices(FAULTS, weights=(2, 3, 1, 1, 1, 2, 2, 2, 3, 2, 2, 1))[0]
        s = self._pick_service()
        if fault == "leader":
            await self._kill_leader()
        elif fault == "churn":
            await self._churn()
        elif fault == "broker_restart":
            if self.broker_down:
                return
            length = round(self.rng.uniform(2.0, 10.0), 2)
            self.note(f"broker stopped for {length}s")
            self.broker_down = True
            await asyncio.to_thread(rabbitmqctl, "stop_app")
            self._later(self._restart_broker(length))
        elif s is None:
            return
        else:
            await self._service_fault(fault, s)
        self.done[fault] += 1

    async def _service_fault(self, fault: str, s: Service) -> None:
        name = s.proc.name
        if fault == "kill":
            self.note(f"SIGKILL {name}")
            s.proc.signal(signal.SIGKILL)
            await self._replace(s)
        elif fault == "freeze":
            length = round(self.rng.uniform(0.2, 4.0), 2)
            self.note(f"SIGSTOP {name} for {length}s")
            s.proc.signal(signal.SIGSTOP)
            self._frozen.add(s.proc.pid)
            self._later(self._thaw(s, length))
        elif fault == "term":
            self.note(f"SIGTERM {name}")
            s.proc.signal(signal.SIGTERM)
            await self._replace(s)
        elif fault == "drain":
            self.note(f"drain {name}")
            sid = await self.cluster.service_id(s.proc)
            async with self._api() as api:
                await api.post(f"/services/{sid}/drain")
            self._later(self._retire(s, self.rng.uniform(1, 3)))
        elif fault == "db_blip":
            length = round(self.rng.uniform(0.2, 1.5), 2)
            self.note(f"database blip of {name} for {length}s")
            self._later(s.db.blip(length))
        elif fault == "db_reset":
            self.note(f"database connections of {name} reset")
            s.db.reset()
        elif fault == "broker_close":
            self.note(f"broker connection of {name} closed")
            s.mq.reset()
        elif fault == "amqp_partition":
            length = round(self.rng.uniform(1.0, 12.0), 2)
            self.note(f"AMQP link of {name} blackholed for {length}s")
            s.mq.cut()
            self._later(self._heal_link(s, length))
        elif fault == "lease_kill":
            sid = await self.cluster.service_id(s.proc)
            pid = await self.cluster.q(LEASE_BACKEND, sid, one=True)
            if pid is not None:
                self.note(f"lease session of {name} ended")
                await self.cluster.q("SELECT pg_terminate_backend($1)", pid)
        else:
            raise AssertionError(f"unknown fault {fault}")

    async def _heal_link(self, s: Service, after: float) -> None:
        await asyncio.sleep(after)
        s.mq.heal()

    async def _restart_broker(self, after: float) -> None:
        await asyncio.sleep(after)
        await self.start_broker()

    async def start_broker(self) -> None:
        """Start the broker if this run stopped it (also when the run fails)."""
        if self.broker_down:
            await asyncio.to_thread(rabbitmqctl, "start_app")
            self.broker_down = False
            self.note("broker started")

    async def _thaw(self, s: Service, after: float) -> None:
        await asyncio.sleep(after)
        s.proc.signal(signal.SIGCONT)
        self._frozen.discard(s.proc.pid)

    async def _retire(self, s: Service, after: float) -> None:
        await asyncio.sleep(after)
        if s in self.services:
            self.note(f"SIGTERM drained {s.proc.name}")
            s.proc.signal(signal.SIGTERM)
            await self._replace(s)

    async def _kill_leader(self) -> None:
        for m in self.managers:
            if not m.alive:
                continue
            async with httpx.AsyncClient(timeout=5, headers=self.cluster.auth_headers) as c:
                try:
                    leads = (await c.get(f"http://127.0.0.1:{m.port}/leader")).json()
                except httpx.HTTPError:
                    continue
            if leads["this_replica_leads"]:
                self.note(f"SIGKILL the leading manager {m.pid}")
                m.signal(signal.SIGKILL)
                self.managers.remove(m)
                self.managers.append(await self.cluster.start_manager(wait=30))
                return

    async def _churn(self) -> None:
        for oid in self.rng.sample(
            sorted(self.live), k=min(len(self.live), self.rng.randint(1, 3))
        ):
            self.note(f"delete {oid}")
            await self._delete(oid)
        for _ in range(self.rng.randint(1, 3)):
            await self._create()
        self.note(f"churn: {len(self.live)} live")

    async def run(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            await self.step()
            await asyncio.sleep(self.rng.uniform(0.3, 1.5))

    async def heal(self) -> None:
        for task in list(self._tasks):
            await task
        await self.start_broker()
        for s in self.services:
            s.proc.signal(signal.SIGCONT)
            s.db.heal()
            s.db.accept()
            s.mq.heal()
        self.note(f"healed; faults: {dict(self.done)}")

    # ------------------------------------------------------------------ the verdict
    async def _overlap_report(self, ticks: list[Tick], overlap: dict[str, float]) -> str:
        """Each overlapping observer's copies (span, epoch, process) and its history, in the
        run's own seconds, to read next to the fault log above."""
        zero = self.wall0
        names = {s.proc.pid: s.proc.name for s in self.all_services}
        lines: list[str] = []
        for oid in overlap:
            spans: dict[tuple[int, int], list[float]] = {}
            for t in ticks:
                if t.observer == oid:
                    span = spans.setdefault(t.copy, [t.at, t.at])
                    span[1] = t.at
            lines.append(f"observer {oid}:")
            for (epoch, pid), (a, b) in sorted(spans.items(), key=lambda kv: kv[1][0]):
                who = names.get(pid, "?")
                lines.append(
                    f"  copy epoch {epoch} on {who} ({pid}): {a - zero:.2f}s .. {b - zero:.2f}s"
                )
            rows = await self.cluster.q(
                "SELECT extract(epoch FROM e.at) AS at, e.event, e.epoch, s.name, e.detail "
                "FROM observer_events e LEFT JOIN services s ON s.id = e.service_id "
                "WHERE e.observer_id = $1 ORDER BY e.id",
                uuid.UUID(oid),
            )
            for r in rows:
                lines.append(
                    f"  {float(r['at']) - zero:7.2f}s {r['event']} epoch {r['epoch']} "
                    f"{r['name'] or ''} {r['detail'] or ''}"
                )
        return "\n".join(lines)

    async def verify(self, *, timeout: float = 60) -> None:
        healed = time.time()

        async def every_live_one_runs() -> bool:
            ticks = read_ticks(self.cluster.tick_dir)
            recent = {t.observer for t in ticks if t.at > healed + 1}
            return {str(o) for o in self.live} <= recent

        await wait_for(
            every_live_one_runs, timeout=timeout, what="every live observer ticking", every=0.5
        )
        await asyncio.sleep(1.0)
        ticks = read_ticks(self.cluster.tick_dir)
        overlap = overlap_seconds(ticks)
        if overlap:
            try:
                report = await self._overlap_report(ticks, overlap)
            except Exception as exc:  # the verdict stands without its details
                report = f"(no report: {exc!r})"
            raise AssertionError(f"seed {self.seed}: two copies ran at once: {overlap}\n{report}")
        rows = await self.cluster.q(
            "SELECT o.id, o.status, extract(epoch FROM e.at) AS deleted_at FROM observers o "
            "LEFT JOIN observer_events e ON e.observer_id = o.id AND e.event = 'deleted'"
        )
        failed = [r["id"] for r in rows if r["status"] == "failed"]
        assert failed == [], f"seed {self.seed}: failed observers: {failed}"
        deleted_at = {str(r["id"]): float(r["deleted_at"]) for r in rows if r["deleted_at"]}
        assert {str(o) for o in self.deleted} <= set(deleted_at), (
            f"seed {self.seed}: deletes never completed"
        )
        late = [t for t in ticks if t.observer in deleted_at and t.at > deleted_at[t.observer]]
        assert late == [], f"seed {self.seed}: deleted observers ran on: {late[:5]}"
        self.note(
            f"verdict: no overlap, {len(self.live)} live all running, "
            f"{len(self.deleted)} deleted stopped, none failed ({len(ticks)} ticks)"
        )
