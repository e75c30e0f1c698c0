"""The fault engine: a schedule drawn from a seed, applied to a cluster of managers and services.

The schedule is drawn before anything runs (``plan``): the same seed, faults, rates and length
give the same faults at the same offsets, aimed at the same slots. Each service slot holds one
process at a time; a fault aimed at a slot whose process is frozen, restarting or gone is noted
as skipped, so a replay may differ only in what the cluster's own timing made impossible.

Faults (``FAULTS``, with their default weights):

- ``kill``: SIGKILL a service; a new process takes its slot.
- ``freeze``: SIGSTOP a service for 0.2-4 s (a paused VM, a long GC, swapping).
- ``suspend``: SIGSTOP a service for 1-8 s, and make its monotonic clock not count that time,
  as a suspended VM or laptop wakes up (the clock hook, ``ORCH_CLOCK_HOOK``): a lease deadline
  kept on that clock would still look valid.
- ``term``: SIGTERM a service (a graceful stop; its copies are released); replaced.
- ``leader``: SIGKILL the manager that leads (its loops move to the other); replaced.
- ``drain``: drain a service through the API, then SIGTERM it after 1-3 s; replaced.
- ``db_blip``: the service's database link resets and refuses for 0.2-1.5 s (proxy).
- ``db_reset``: every open database connection of the service is reset (proxy).
- ``broker_close``: the service's broker connection is reset (proxy).
- ``amqp_partition``: the service's broker link is blackholed for 1-12 s (proxy: bytes stop,
  sockets stay open, as in a network partition).
- ``db_partition``: the service's database link is blackholed for 1-8 s: what it sent meanwhile
  arrives when the link heals, after its lease may have expired and others took its observers
  (the writes the database's epoch fences are there for).
- ``isolate``: both links of the service (database and broker) reset and refused for 0.5-3 s
  at once, as when its host's network drops: its lease session ends and its broker session
  too while the process lives, so others may take its observers.
- ``lease_kill``: the service's lease session is ended from the database side while the
  process lives (``pg_terminate_backend``; needs the right to do that).
- ``slow_link``: every chunk on the service's database link is delayed 150-800 ms for 3-15 s,
  nothing lost: a congested or distant link that works.
- ``row_lock``: one observer row the service holds is locked from outside (``SELECT … FOR
  UPDATE``) for 2-20 s, as a long report or a stuck migration would.
- ``crash_blip``: SIGKILL a service, and 0.4 s later reset the next service's database links,
  refuse new ones for 0.5 s and delay every chunk by 150 ms for 3 s: a crash met by a blip,
  where only what the dead service held may move.
- ``queue_deleted``: the work queue is deleted (by an operator, a policy, a broker bug); the
  services declare it again and the audit re-dispatches what it held.
- ``churn``: 1-3 observers deleted and as many created (the population stays as it began: a
  random walk took one soak from 42 observers to 7, another to 73).
- ``broker_restart``: the broker application stopped for 2-10 s (``rabbitmqctl stop_app``;
  needs rights on the broker, so only with ``--broker-restart``).
- ``alarm``: a broker memory alarm for 2-10 s (``rabbitmqctl set_vm_memory_high_watermark``;
  publishers block), then the watermark put back; only with ``--broker-restart`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import httpx

from orch.cluster import Proc, wait_for
from orch_contracts.clock import set_suspend_lag
from orch_contracts.settings import asyncpg_dsn
from orch_contracts.topology import Topology
from orch_verify.availability import Fault
from orch_verify.cluster import FaultCluster
from orch_verify.proxy import Proxy

#: Every fault and its default weight (how often it is drawn relative to the others).
FAULTS: dict[str, float] = {
    "kill": 2,
    "freeze": 3,
    "suspend": 2,
    "term": 1,
    "leader": 1,
    "drain": 1,
    "db_blip": 2,
    "db_reset": 2,
    "broker_close": 2,
    "amqp_partition": 2,
    "isolate": 2,
    "db_partition": 2,
    "lease_kill": 2,
    "slow_link": 2,
    "row_lock": 2,
    "crash_blip": 2,
    "queue_deleted": 1,
    "churn": 3,
    "broker_restart": 1,
    "alarm": 1,
}
#: Faults aimed at one service slot.
SERVICE_FAULTS = frozenset(FAULTS) - {"leader", "churn", "broker_restart", "alarm", "queue_deleted"}
#: What needs rights beyond the cluster's own (it touches the whole broker): chosen explicitly.
OPT_IN = frozenset({"broker_restart", "alarm"})

#: Lengths drawn for the faults that last, seconds.
LENGTHS = {
    "freeze": (0.2, 4.0),
    "suspend": (1.0, 8.0),
    "db_blip": (0.2, 1.5),
    "amqp_partition": (1.0, 12.0),
    "isolate": (0.5, 3.0),
    "db_partition": (1.0, 8.0),
    "broker_restart": (2.0, 10.0),
    "drain": (1.0, 3.0),
    "slow_link": (3.0, 15.0),
    "row_lock": (2.0, 20.0),
    "alarm": (2.0, 10.0),
}
#: Seconds each chunk on a slow link is delayed by.
SLOW_CHUNK = (0.15, 0.8)

WATERMARK = "vm_memory_monitor:get_vm_memory_high_watermark()."

ROW_LOCK = """
SELECT id FROM observers WHERE service_id = $1 AND status = 'processing' LIMIT 1 FOR UPDATE
"""

LEASE_BACKEND = """
SELECT l.pid FROM pg_locks l JOIN services s ON s.id = $1
 WHERE l.locktype = 'advisory' AND l.granted
   AND ((l.classid::bigint << 32) | l.objid::bigint) = s.lock_key
"""


def rabbitmqctl(*args: str) -> str:
    return subprocess.run(
        ["rabbitmqctl", *args], capture_output=True, text=True, timeout=120, check=True
    ).stdout


def parse_faults(text: str | None, *, broker_restart: bool = False) -> dict[str, float]:
    """``kill,freeze`` or ``kill=2,freeze=0.5`` (names with weights) into weights; None or ""
    means every fault at its default weight, ``broker_restart`` only when asked for; ``none``
    means no fault at all (a run that only measures the kinds)."""
    if text == "none":
        return {k: FAULTS[k] for k in OPT_IN} if broker_restart else {}
    if not text:
        weights = {k: w for k, w in FAULTS.items() if k not in OPT_IN}
    else:
        weights = {}
        for part in text.split(","):
            name, _, weight = part.strip().partition("=")
            if name not in FAULTS:
                raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
            try:
                weights[name] = float(weight) if weight else FAULTS[name]
            except ValueError:
                raise ValueError(f"the weight of {name} must be a number, not {weight!r}") from None
            if weights[name] < 0:
                raise ValueError(f"the weight of {name} must not be negative")
    if broker_restart:
        for name in OPT_IN:
            weights.setdefault(name, FAULTS[name])
    if not any(weights.values()):
        raise ValueError("no fault has a weight above zero")
    return weights


@dataclass(frozen=True)
class Planned:
    """One fault of the schedule: when (seconds from the start), what, aimed where."""

    at: float
    fault: str
    #: The service slot for service faults.
    slot: int = 0
    #: Seconds, for faults that last.
    length: float = 0.0
    #: Churn: a number in [0, 1) per observer to delete (which one, among those live then), and
    #: how many to create.
    picks: tuple[float, ...] = ()
    creates: int = 0

    def describe(self, slots: list[str] | None = None) -> str:
        where = f" {slots[self.slot] if slots else f's{self.slot + 1}'}" if self.slot_fault else ""
        what = f"{self.fault}{where}"
        if self.length:
            what += f" for {self.length}s"
        if self.fault == "churn":
            what += f" (delete {len(self.picks)}, create {self.creates})"
        return what

    @property
    def slot_fault(self) -> bool:
        return self.fault in SERVICE_FAULTS


def plan(
    seed: int, seconds: float, weights: dict[str, float], *, every: float = 0.9, slots: int = 3
) -> list[Planned]:
    """The schedule: faults drawn by weight, ``every`` seconds apart on average (uniformly
    between a third of it and five thirds), until ``seconds``."""
    rng = random.Random(seed)
    names = sorted(weights)
    out: list[Planned] = []
    if not names:
        return out
    at = rng.uniform(every / 3, every * 5 / 3)
    while at < seconds:
        fault = rng.choices(names, weights=[weights[n] for n in names])[0]
        lo_hi = LENGTHS.get(fault)
        length = round(rng.uniform(*lo_hi), 2) if lo_hi else 0.0
        picks: tuple[float, ...] = ()
        creates = 0
        if fault == "churn":
            picks = tuple(rng.random() for _ in range(rng.randint(1, 3)))
            creates = len(picks)
        out.append(Planned(round(at, 2), fault, rng.randrange(slots), length, picks, creates))
        at += rng.uniform(every / 3, every * 5 / 3)
    return out


@dataclass(frozen=True)
class ObserverSpec:
    """Observers to create: ``count`` of ``kind`` with ``params``."""

    kind: str
    params: dict[str, Any]
    count: int = 1


@dataclass
class Slot:
    """A service slot: the process in it now, behind its own proxies."""

    name: str
    proc: Proc | None = None
    db: Proxy | None = None
    mq: Proxy | None = None
    #: Why a fault cannot be aimed at it now (frozen, restarting, draining), or None.
    busy: str | None = None
    #: The process's clock hook, and the suspended seconds its monotonic clock has not counted.
    hook: Path | None = None
    lag: float = 0.0


@dataclass
class FaultEvent:
    """A fault as applied: its offset from the schedule's start, its description, whether it
    was skipped."""

    at: float
    what: str
    skipped: str | None = None


class Answer:
    """A manager's HTTP answer, and whether it came to a call tried more than once."""

    def __init__(self, response: httpx.Response, *, retried: bool) -> None:
        self.response, self.retried = response, retried
        self.status_code, self.text = response.status_code, response.text

    def json(self) -> Any:
        return self.response.json()


@dataclass
class Campaign:
    """Runs ``schedule`` against ``cluster``. ``say`` prints a line as it happens."""

    cluster: FaultCluster
    seed: int
    schedule: list[Planned]
    observers: list[ObserverSpec]
    services: int = 3
    worker_count: int = 40
    say: Callable[[str], None] = print
    slots: list[Slot] = field(default_factory=list)
    managers: list[Proc] = field(default_factory=list)
    #: Every observer created, with its kind.
    kinds: dict[uuid.UUID, str] = field(default_factory=dict)
    #: Observers created and not deleted, in creation order, with their kind.
    live: dict[uuid.UUID, str] = field(default_factory=dict)
    #: Deleted observers, with the epoch their row had when the delete was accepted: a copy of
    #: a later epoch was taken after it.
    deleted: dict[uuid.UUID, int] = field(default_factory=dict)
    events: list[FaultEvent] = field(default_factory=list)
    #: How many of each fault were applied (not skipped).
    done: Counter[str] = field(default_factory=Counter)
    broker_down: bool = False
    #: The broker's memory watermark before this run raised an alarm (None: no alarm raised).
    watermark: str | None = None
    #: Seconds a create or delete is tried again while managers answer 5xx or nothing.
    api_patience: float = 30.0
    #: Creates and deletes the managers did not accept (each a finding, like an exit).
    api_failures: list[str] = field(default_factory=list)
    #: Every fault applied, with its span and target, for the availability judge.
    faults: list[Fault] = field(default_factory=list)
    #: Observer -> wall time its create was answered; its delete was sent, and answered.
    created_at: dict[uuid.UUID, float] = field(default_factory=dict)
    delete_sent: dict[uuid.UUID, float] = field(default_factory=dict)
    deleted_at: dict[uuid.UUID, float] = field(default_factory=dict)
    _created: int = 0
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def __post_init__(self) -> None:
        #: A separate stream for what the schedule leaves open (which manager answers).
        self.rng = random.Random(self.seed ^ 0x5EED)
        self.t0 = time.monotonic()
        self.wall0 = time.time()
        #: When the schedule began, seconds after ``t0``: planned offsets count from here.
        self.began = 0.0
        #: Every service process ever started: pid -> slot name.
        self.processes: dict[int, str] = {}
        #: Per process, when it was stopped by ``freeze`` or ``suspend`` (wall time): it could
        #: not run then.
        self.paused: dict[int, list[tuple[float, float]]] = {}
        #: Processes this campaign ended (their exit is no finding).
        self.ended: set[int] = set()
        #: Per service process, from when it was seen ready to when it stopped taking work
        #: (killed, stopped, drained, exited; wall time): when no service took work at all,
        #: a gap waits for one (``availability.Lives.takers``).
        self.takers: dict[int, list[float]] = {}
        #: Processes that exited without being asked: a crash is the orchestrator's defect.
        self.exits: list[str] = []
        #: The processes' clock hooks (made by ``start``).
        self._hooks: tempfile.TemporaryDirectory[str] | None = None

    def fault_began(
        self,
        name: str,
        *,
        length: float = 0.0,
        pid: int | None = None,
        observer: str | None = None,
    ) -> Fault:
        """Record a fault beginning now, lasting ``length`` unless its follow-up says when it
        ended (``Fault.end``)."""
        now = time.time()
        fault = Fault(name, now, now + length, pid, observer)
        self.faults.append(fault)
        return fault

    def note(self, what: str, *, skipped: str | None = None) -> None:
        """Print and keep ``what``, at its offset from the schedule's start (as planned)."""
        at = time.monotonic() - self.t0 - self.began
        self.events.append(FaultEvent(round(at, 2), what, skipped))
        self.say(f"{at:7.2f}s {what}" + (f" (skipped: {skipped})" if skipped else ""))

    # ------------------------------------------------------------------ the cluster
    async def start(self) -> None:
        self.t0, self.wall0 = time.monotonic(), time.time()
        # A process started while the broker or the database is away waits for it at start.
        self.cluster.env.setdefault("ORCH_WAIT", "60")
        self._hooks = tempfile.TemporaryDirectory(prefix="orch-verify-clocks-")
        for _ in range(2):
            self.managers.append(await self.cluster.start_manager())
        for i in range(self.services):
            slot = Slot(f"s{i + 1}")
            self.slots.append(slot)
            await self._fill(slot)
        for spec in self.observers:
            for _ in range(spec.count):
                await self._create(spec)

    async def _fill(self, slot: Slot) -> None:
        """Start a new process in ``slot``, behind new proxies."""
        slot.busy = "starting"
        slot.db = await self.cluster.proxy(self.cluster.env["ORCH_DATABASE_URL"])
        slot.mq = await self.cluster.proxy(self.cluster.env["ORCH_AMQP_URL"])
        known = len(self.cluster.procs)
        assert self._hooks is not None, "start() makes the clock hooks' directory"
        slot.hook, slot.lag = Path(self._hooks.name) / f"{slot.name}-{known}.clock", 0.0
        try:
            slot.proc = await self.cluster.start_behind(
                slot.name, self.worker_count, slot.db, slot.mq, ORCH_CLOCK_HOOK=slot.hook
            )
        except Exception as exc:
            # Seeing it start can fail (the broker is being restarted) while the process goes
            # on: it is the slot's process all the same.
            spawned = [p for p in self.cluster.procs[known:] if p.name == slot.name and p.alive]
            if not spawned:
                raise
            slot.proc = spawned[-1]
            self.note(f"{slot.name} (pid {slot.proc.pid}) started, not seen ready: {exc!r:.200}")
        self.processes[slot.proc.pid] = slot.name
        self.takers[slot.proc.pid] = [time.time(), float("inf")]
        slot.busy = None

    def _stops_taking(self, proc: Proc) -> None:
        """From now, this service process takes no work (killed, stopped, draining, gone)."""
        window = self.takers.get(proc.pid)
        if window is not None and window[1] == float("inf"):
            window[1] = time.time()

    async def _api(self) -> httpx.AsyncClient:
        """A client of a live manager (waiting while the leader's replacement starts)."""

        async def alive() -> list[Proc]:
            self.check_exits()
            return [m for m in self.managers if m.alive]

        managers = await wait_for(alive, timeout=60, what="a live manager", every=0.1)
        return httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.rng.choice(managers).port}",
            timeout=30,
            headers=self.cluster.auth_headers,
        )

    async def _create(self, spec: ObserverSpec) -> None:
        self._created += 1
        name = f"verify-{self._created}"
        body = {"name": name, "kind": spec.kind, "params": spec.params}
        r = await self._call("POST", "/observers", json=body)
        if r is not None and r.status_code == 409 and r.retried:
            r = await self._adopt(name)  # an attempt the lost answer was to had created it
        if r is None or r.status_code != 201:
            self._api_failed(f"creating {spec.kind} {name}", r)
            return
        oid = uuid.UUID(r.json()["id"])
        self.live[oid] = self.kinds[oid] = spec.kind
        self.created_at[oid] = time.time()

    async def _delete(self, oid: uuid.UUID) -> None:
        sent = time.time()
        r = await self._call("DELETE", f"/observers/{oid}")
        if r is None or r.status_code != 202:
            self._api_failed(f"deleting {oid}", r)
            return
        self.live.pop(oid)
        self.deleted[oid] = int(r.json()["epoch"])
        self.deleted_at[oid] = time.time()
        self.delete_sent[oid] = sent

    async def _call(self, method: str, path: str, **kwargs: Any) -> Answer | None:
        """One call to a live manager, tried again (on another, maybe) while the answer is a 5xx
        or none: a manager killed, or one whose leader was, mid-request. None: no answer."""
        deadline = time.monotonic() + self.api_patience
        tries = 0
        while True:
            tries += 1
            try:
                async with await self._api() as api:
                    r = await api.request(method, path, **kwargs)
                if r.status_code < 500 or time.monotonic() > deadline:
                    return Answer(r, retried=tries > 1)
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    return None
            await asyncio.sleep(min(0.5, 0.05 * tries))

    async def _adopt(self, name: str) -> Answer | None:
        """The observer named ``name``, as a create's 201 would have given it."""
        r = await self._call("GET", "/observers", params={"name": name})
        if r is None or r.status_code != 200:
            return r
        for item in r.json()["items"]:
            if item["name"] == name:
                return Answer(httpx.Response(201, json=item), retried=True)
        return r

    def _api_failed(self, what: str, r: Answer | None) -> None:
        """A create or delete the managers did not accept: a finding of its own (the verdict
        names it), never the run's end."""
        answer = "no answer" if r is None else f"{r.status_code} {r.text[:200]}"
        failure = f"{what}: {answer} (tried for {self.api_patience:.0f}s)"
        self.api_failures.append(failure)
        self.note(f"API FAILED: {failure}")

    def _later(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.note(f"a fault's follow-up failed: {exc!r}")

    # ------------------------------------------------------------------ the faults
    async def run(self, seconds: float) -> None:
        """Apply the schedule over ``seconds``, its offsets counted from now (the cluster is
        up)."""
        self.began = time.monotonic() - self.t0
        self.say(f"cluster up in {self.began:.1f}s; faults from now")
        for planned in self.schedule:
            await self._until(planned.at)
            await self.apply(planned)
        await self._until(seconds)

    async def _until(self, offset: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + self.began + offset - time.monotonic()))

    async def apply(self, p: Planned) -> None:
        self.check_exits()
        before = len(self.events)
        await self._apply(p)
        if any(e.skipped is None for e in self.events[before:]):
            self.done[p.fault] += 1

    async def _apply(self, p: Planned) -> None:
        if p.fault == "leader":
            await self._kill_leader()
        elif p.fault == "churn":
            await self._churn(p)
        elif p.fault == "broker_restart":
            if self.broker_down:
                self.note(p.describe(), skipped="the broker is down already")
                return
            self.note(p.describe())
            self.broker_down = True
            fault = self.fault_began("broker_restart", length=p.length)
            await asyncio.to_thread(rabbitmqctl, "stop_app")
            self._later(self._restart_broker(p.length, fault))
        elif p.fault == "alarm":
            if self.broker_down or self.watermark is not None:
                self.note(p.describe(), skipped="the broker is down or alarmed already")
                return
            self.note(p.describe())
            self.watermark = await asyncio.to_thread(rabbitmqctl, "eval", WATERMARK)
            fault = self.fault_began("alarm", length=p.length)
            await asyncio.to_thread(rabbitmqctl, "set_vm_memory_high_watermark", "0.000001")
            self._later(self._end_alarm(p.length, fault))
        elif p.fault == "queue_deleted":
            if self.broker_down:
                self.note(p.describe(), skipped="the broker is down")
                return
            try:
                await asyncio.wait_for(self._delete_work_queue(), 5)
            except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as exc:
                self.note(p.describe(), skipped=f"the broker did not answer: {exc!r:.100}")
                return
            self.fault_began("queue_deleted")
            self.note(p.describe())
        else:
            slot = self.slots[p.slot]
            if slot.busy or slot.proc is None or not slot.proc.alive:
                self.note(p.describe(), skipped=slot.busy or "no process")
                return
            await self._service_fault(p, slot)

    async def _service_fault(self, p: Planned, slot: Slot) -> None:
        proc, db, mq = slot.proc, slot.db, slot.mq
        assert proc is not None
        assert db is not None
        assert mq is not None
        what = f"{p.describe([s.name for s in self.slots])} (pid {proc.pid})"
        if p.fault == "lease_kill":
            sid = await self.cluster.service_id(proc)
            backend = await self.cluster.q(LEASE_BACKEND, sid, one=True)
            if backend is None:
                self.note(what, skipped="no lease session found")
                return
            self.note(what)
            self.fault_began("lease_kill", pid=proc.pid)
            await self.cluster.q("SELECT pg_terminate_backend($1)", backend)
            return
        self.note(what)
        lasting = p.fault in ("db_blip", "isolate", "drain")
        fault = self.fault_began(p.fault, pid=proc.pid, length=p.length if lasting else 0.0)
        if p.fault in ("kill", "crash_blip"):
            self._end(proc, signal.SIGKILL)
            self._later(self._refill(slot))
            if p.fault == "crash_blip":
                self._later(self._blip_next(slot))
        elif p.fault == "term":
            self._end(proc, signal.SIGTERM)
            self._later(self._refill(slot))
        elif p.fault in ("freeze", "suspend"):
            proc.signal(signal.SIGSTOP)
            slot.busy = "frozen"
            self._later(self._thaw(slot, p.length, fault, suspend=p.fault == "suspend"))
        elif p.fault == "drain":
            sid = await self.cluster.service_id(proc)
            self._stops_taking(proc)
            async with await self._api() as api:
                await api.post(f"/services/{sid}/drain")
            slot.busy = "draining"
            self._later(self._retire(slot, p.length))
        elif p.fault == "db_blip":
            self._later(db.blip(p.length))
        elif p.fault == "db_reset":
            db.reset()
        elif p.fault == "broker_close":
            mq.reset()
        elif p.fault == "amqp_partition":
            mq.cut()
            self._later(self._heal_link(mq, p.length, fault))
        elif p.fault == "db_partition":
            db.cut()
            self._later(self._heal_link(db, p.length, fault))
        elif p.fault == "isolate":
            self._later(db.blip(p.length))
            self._later(mq.blip(p.length))
        elif p.fault == "slow_link":
            db.slow(*SLOW_CHUNK)
            self._later(self._heal_slow(db, p.length, fault))
        elif p.fault == "row_lock":
            sid = await self.cluster.service_id(proc)
            self._later(self._lock_a_row(sid, p.length, fault))
        else:
            raise AssertionError(f"unknown fault {p.fault}")

    async def _refill(self, slot: Slot) -> None:
        slot.busy = "restarting"
        proc = slot.proc
        if proc is not None:
            await asyncio.to_thread(proc.popen.wait)
        await self._fill(slot)

    async def _thaw(self, slot: Slot, after: float, fault: Fault, *, suspend: bool) -> None:
        await asyncio.sleep(after)
        since = fault.start
        if slot.proc is not None:
            if suspend and slot.hook is not None:
                # Written while the process is stopped: it wakes with the lag already there.
                slot.lag += time.time() - since
                set_suspend_lag(slot.hook, slot.lag)
            slot.proc.signal(signal.SIGCONT)
            fault.end = time.time()
            self.paused.setdefault(slot.proc.pid, []).append((since, fault.end))
        slot.busy = None

    async def _retire(self, slot: Slot, after: float) -> None:
        await asyncio.sleep(after)
        if slot.proc is not None:
            self.note(f"SIGTERM drained {slot.name} (pid {slot.proc.pid})")
            self._end(slot.proc, signal.SIGTERM)
        await self._refill(slot)

    async def _heal_link(self, proxy: Proxy, after: float, fault: Fault | None = None) -> None:
        await asyncio.sleep(after)
        proxy.heal()
        if fault is not None:
            fault.end = time.time()

    async def _heal_slow(self, proxy: Proxy, after: float, fault: Fault | None = None) -> None:
        await asyncio.sleep(after)
        proxy.slow(0.0, 0.0)
        if fault is not None:
            fault.end = time.time()

    async def _lock_a_row(self, service_id: uuid.UUID, seconds: float, fault: Fault) -> None:
        """Hold one of the service's observer rows locked, on a connection of its own."""
        conn = await asyncpg.connect(asyncpg_dsn(self.cluster.env["ORCH_DATABASE_URL"]))
        try:
            async with conn.transaction():
                locked = await conn.fetchval(ROW_LOCK, service_id)
                fault.observer = None if locked is None else str(locked)
                fault.start = time.time()
                await asyncio.sleep(seconds)
        finally:
            await conn.close()
            fault.end = time.time()

    async def _blip_next(self, dead: Slot) -> None:
        """The crash's follow-up: the next slot's database link reset, refused 0.5 s and slow."""
        await asyncio.sleep(0.4)
        at = self.slots.index(dead)
        others = [self.slots[(at + i) % len(self.slots)] for i in range(1, len(self.slots))]
        other = next((s for s in others if s.db and s.proc and s.proc.alive and not s.busy), None)
        if other is None or other.db is None or other.proc is None:
            self.note("crash_blip: no other service to blip", skipped="no other service up")
            return
        self.note(f"crash_blip: blip {other.name} (pid {other.proc.pid})")
        fault = self.fault_began("db_blip", pid=other.proc.pid, length=3.5)
        other.db.slow(0.15, 0.15)
        await other.db.blip(0.5)
        await self._heal_slow(other.db, 3.0, fault)

    async def _delete_work_queue(self) -> None:
        connection = await aio_pika.connect(self.cluster.env["ORCH_AMQP_URL"])
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(Topology(self.cluster.env["ORCH_PREFIX"]).work_queue)

    async def _end_alarm(self, after: float, fault: Fault) -> None:
        await asyncio.sleep(after)
        await self.end_alarm()
        fault.end = time.time()

    async def end_alarm(self) -> None:
        """Put the broker's memory watermark back if this run raised an alarm (also when the
        run fails)."""
        if self.watermark is None:
            return
        was = self.watermark.strip()
        # {relative, 0.4} or {absolute, N} or a bare float, as the broker reports it.
        if was.startswith("{absolute,"):
            args = ["set_vm_memory_high_watermark", "absolute", was.split(",")[1].strip(" }")]
        else:
            args = ["set_vm_memory_high_watermark", was.removeprefix("{relative,").strip(" }")]
        await asyncio.to_thread(rabbitmqctl, *args)
        self.watermark = None
        self.note("broker alarm cleared")

    async def _restart_broker(self, after: float, fault: Fault) -> None:
        await asyncio.sleep(after)
        await self.start_broker()
        fault.end = time.time()

    async def start_broker(self) -> None:
        """Start the broker if this run stopped it (also when the run fails)."""
        if self.broker_down:
            await asyncio.to_thread(rabbitmqctl, "start_app")
            self.broker_down = False
            self.note("broker started")

    async def _kill_leader(self) -> None:
        if sum(m.alive for m in self.managers) < 2:
            # The fault is "the leader dies and the other takes over": with the last
            # replacement still starting there is no other.
            self.note("leader", skipped="the other manager is not up yet")
            return
        for m in self.managers:
            if not m.alive:
                continue
            async with httpx.AsyncClient(timeout=5, headers=self.cluster.auth_headers) as c:
                try:
                    leads = (await c.get(f"http://127.0.0.1:{m.port}/leader")).json()
                except httpx.HTTPError:
                    continue
            if leads.get("this_replica_leads"):
                self.note(f"leader: SIGKILL the leading manager (pid {m.pid})")
                self._end(m, signal.SIGKILL)
                fault = self.fault_began("leader")
                self.managers.remove(m)
                self._later(self._new_manager())
                self._later(self._led_again(fault))
                return
        self.note("leader", skipped="no manager leads now")

    async def _led_again(self, fault: Fault) -> None:
        """The leader fault ends when another manager leads."""

        async def leads() -> bool:
            for m in [m for m in self.managers if m.alive]:
                async with httpx.AsyncClient(timeout=2, headers=self.cluster.auth_headers) as c:
                    try:
                        answer = (await c.get(f"http://127.0.0.1:{m.port}/leader")).json()
                    except (httpx.HTTPError, ValueError):
                        continue
                if answer.get("this_replica_leads"):
                    return True
            return False

        with contextlib.suppress(TimeoutError):
            await wait_for(leads, timeout=60, what="a manager leading again", every=0.1)
        fault.end = time.time()

    async def _new_manager(self) -> None:
        for attempt in range(1, 4):
            try:
                self.managers.append(await self.cluster.start_manager())
                return
            except (RuntimeError, TimeoutError) as exc:
                self.note(f"a replacement manager did not start (attempt {attempt}): {exc!r:.300}")
        raise RuntimeError("no replacement manager started in three attempts")

    async def _churn(self, p: Planned) -> None:
        order = list(self.live)
        doomed = []
        for pick in p.picks:
            if order:
                doomed.append(order.pop(int(pick * len(order))))
        for oid in doomed:
            await self._delete(oid)
        first = self._created
        for i in range(p.creates):  # the specs in turn
            await self._create(self.observers[(first + i) % len(self.observers)])
        self.note(
            f"{p.describe()}: deleted {', '.join(str(o)[:8] for o in doomed) or 'none'}; "
            f"{len(self.live)} live"
        )

    # ------------------------------------------------------------------ healing
    def _end(self, proc: Proc, sig: int) -> None:
        """Signal ``proc`` to end: its exit is this campaign's doing."""
        self.ended.add(proc.pid)
        self._stops_taking(proc)
        proc.signal(sig)

    def check_exits(self) -> None:
        """Note every process that exited without being asked (a crash, an exit on a bug: the
        orchestrator's defect, never a fault of this campaign) and start another in its place,
        as a process supervisor would."""
        for m in list(self.managers):
            if not m.alive and m.pid not in self.ended:
                self.managers.remove(m)
                self._exited(m)
                self._later(self._new_manager())
        for slot in self.slots:
            proc = slot.proc
            if proc is None or slot.busy is not None or proc.alive or proc.pid in self.ended:
                continue
            self._exited(proc)
            self._later(self._refill(slot))

    def _exited(self, proc: Proc) -> None:
        self.ended.add(proc.pid)
        self._stops_taking(proc)
        last = proc.tail(1).strip()[:300]
        what = f"{proc.name} (pid {proc.pid}) exited with code {proc.popen.returncode}: {last}"
        self.exits.append(what)
        self.note(f"EXITED ON ITS OWN: {what}")

    async def heal(self) -> None:
        """Let every lasting fault end and every slot hold a running process."""
        self.check_exits()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.start_broker()
        await self.end_alarm()
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.signal(signal.SIGCONT)
            for proxy in (slot.db, slot.mq):
                if proxy is not None:
                    proxy.heal()
                    proxy.accept()
        self.note(f"healed; faults: {dict(self.done)}")

    async def close(self) -> None:
        """Whatever happened: every lasting fault's task ended, frozen processes resumed (the
        cluster's stop needs them), the broker started again (loudly when it cannot be)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for slot in self.slots:
            if slot.proc is not None:
                slot.proc.signal(signal.SIGCONT)
        if self._hooks is not None:
            self._hooks.cleanup()
        try:
            await self.start_broker()
        except (OSError, subprocess.SubprocessError) as exc:
            self.say(f"THE BROKER COULD NOT BE STARTED AGAIN: {exc!r}; run rabbitmqctl start_app")
            raise
        finally:
            try:
                await self.end_alarm()
            except (OSError, subprocess.SubprocessError) as exc:
                self.say(
                    f"THE BROKER'S MEMORY ALARM COULD NOT BE CLEARED: {exc!r}; run "
                    f"rabbitmqctl set_vm_memory_high_watermark {self.watermark}"
                )

    def alive_pids(self) -> set[int]:
        """Every service process alive now (a slot's, or one whose start was not seen)."""
        names = {s.name for s in self.slots}
        return {p.pid for p in self.cluster.procs if p.name in names and p.alive}
