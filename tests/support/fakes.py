"""In-memory stand-ins for the service's database and broker, for unit tests of the core's own
logic (admission, settling, drain, handoff, lease loss) that run in milliseconds.

They follow the real parts' contracts (``ports``) and the same take rule; they are not a model
of PostgreSQL or RabbitMQ. Whatever is claimed about those servers is tested against them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from observer_service.ports import (
    LOCKED,
    Checkpoint,
    ControlFacts,
    Copy,
    ErrorRecord,
    Holding,
    Locked,
    OnControl,
    OnStart,
    Renewal,
    Seen,
    SessionSpec,
    Settling,
    Written,
)
from observer_service.take import Decision
from orch_contracts.clock import Clock
from orch_contracts.errors import BrokerUnavailable, DatabaseUnavailable, RowLocked
from orch_contracts.kinds import RestartPolicy
from orch_contracts.messages import StartMessage
from orch_contracts.outputs import Committed, Output
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.statuses import HELD, LIVE, STOPPED, ObserverStatus
from orch_contracts.tracing import Carrier


class ManualClock(Clock):
    """A clock whose ``now()`` can be moved forward, as a suspend of the machine would."""

    def __init__(self) -> None:
        super().__init__()
        self.skipped = 0.0

    def advance(self, seconds: float) -> None:
        self.skipped += seconds

    def now(self) -> float:
        return super().now() + self.skipped


@dataclass
class Row:
    id: uuid.UUID
    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    status: ObserverStatus = ObserverStatus.CREATED
    dispatch_id: uuid.UUID = field(default_factory=uuid.uuid4)
    service_id: uuid.UUID | None = None
    epoch: int = 0
    checkpoint: Any = None
    restart_policy: dict[str, Any] | None = None
    restart_count: int = 0
    restarted_at: float | None = None
    last_error: str | None = None
    #: The move the leader recorded (``observers.handoff_to``): cleared by every take.
    handoff_to: uuid.UUID | None = None
    #: The epoch of the take whose copy came by a work-queue delivery
    #: (``observers.queued_epoch``).
    queued_epoch: int | None = None
    events: list[str] = field(default_factory=list)
    output_seq: int = 0
    name: str = "fake"
    #: Why nobody runs it (``observers.waiting``): cleared by every take.
    waiting: str | None = None
    #: The service a directed start was sent to (``observers.directed_to``): cleared by every
    #: take; a release hands it the move the leader recorded.
    directed_to: uuid.UUID | None = None
    pool: str = DEFAULT_POOL
    kind_version: str | None = None

    @property
    def start(self) -> StartMessage:
        return StartMessage(observer_id=self.id, dispatch_id=self.dispatch_id)


_service_keys = itertools.count(1_000_000)


@dataclass
class FakeService:
    live: bool = True
    lock_free: bool = False
    #: The lock key of its lease session: a new one for a new session.
    key: int = field(default_factory=lambda: next(_service_keys))
    #: Seconds until its lease expires, as a facts read reports it.
    remaining: float = 0.0


class InMemoryStore:
    """Observer rows in a dict. ``available`` False makes every call raise DatabaseUnavailable;
    ``hold`` (an event) makes each facts read of a take wait until it is set, to open a race on
    purpose; the rows in ``locked`` are locked by another transaction: a batch answers LOCKED
    for them, a single write raises RowLocked. The take loop itself is ``taking.take_many``."""

    def __init__(self, me: uuid.UUID, clock: Clock | None = None) -> None:
        self.me = me
        self.clock = clock or Clock()
        self.rows: dict[uuid.UUID, Row] = {}
        self.services: dict[uuid.UUID, FakeService] = {}
        self.available = True
        self.hold: asyncio.Event | None = None
        #: This many take compare-and-sets commit and then raise, as a lost reply would.
        self.lose_replies = 0
        self.calls: list[str] = []
        self.locked: set[uuid.UUID] = set()
        #: The outbox of outputs: (observer, first seq) -> the commit.
        self.outputs: dict[tuple[uuid.UUID, int], Committed] = {}
        #: Commits other services made and nobody confirmed (``outputs_backlog`` adds them).
        self.left_by_others: dict[tuple[uuid.UUID, int], Committed] = {}
        #: This service's row says draining (what a renewal, and a control check, read).
        self.draining = False

    def add(self, kind: str = "ticker", **fields: Any) -> Row:
        row = Row(id=uuid.uuid4(), kind=kind, **fields)
        self.rows[row.id] = row
        return row

    def _up(self, call: str) -> None:
        self.calls.append(call)
        if not self.available:
            raise DatabaseUnavailable("the fake database is down")

    def _mine(self, row: Row | None, copy: Copy) -> bool:
        return (
            row is not None
            and row.epoch == copy[1]
            and row.service_id == self.me
            and row.status in HELD
        )

    async def read_facts(self, observer_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Seen]:
        if self.hold is not None:
            await self.hold.wait()
        self._up("read_facts")
        out: dict[uuid.UUID, Seen] = {}
        for oid in observer_ids:
            row = self.rows.get(oid)
            if row is None:
                continue
            holder = self.services.get(row.service_id) if row.service_id else None
            other_live = holder is not None and holder.live and row.service_id != self.me
            out[oid] = Seen(
                observer_id=row.id,
                status=row.status,
                dispatch_id=row.dispatch_id,
                epoch=row.epoch,
                holder=row.service_id,
                holder_live=holder is not None and holder.live,
                holder_lock_free=other_live and holder is not None and holder.lock_free,
                holder_key=None if holder is None else holder.key,
                holder_remaining=0.0 if holder is None else holder.remaining,
                name=f"obs-{row.id.hex[:6]}",
                kind=row.kind,
                params=row.params,
                checkpoint=row.checkpoint,
                restart_policy=row.restart_policy,
                pool=row.pool,
                kind_version=row.kind_version,
            )
        return out

    def _as_seen(self, seen: Seen) -> Row | None:
        """The row, if it is still as ``seen`` (and a live holder taken from still names the
        lock key seen): what the compare-and-set's WHERE asks of it."""
        row = self.rows.get(seen.observer_id)
        if row is None:
            return None
        as_now = (
            row.epoch,
            row.dispatch_id,
            row.status,
            row.service_id,
            row.pool,
            row.kind_version,
        )
        if as_now != (
            seen.epoch,
            seen.dispatch_id,
            seen.status,
            seen.holder,
            seen.pool,
            seen.kind_version,
        ):
            return None
        if seen.holder_live and seen.holder not in (None, self.me):
            holder = self.services.get(seen.holder) if seen.holder else None
            if holder is None or holder.key != seen.holder_key:
                return None
        return row

    async def compare_and_set(
        self,
        decision: Decision,
        rows: Sequence[Seen],
        queued: Collection[uuid.UUID] = (),
        dispatches: Mapping[uuid.UUID, uuid.UUID] | None = None,
    ) -> Written:
        self._up("compare_and_set")
        epochs: dict[uuid.UUID, int] = {}
        locked: set[uuid.UUID] = set()
        resumed: dict[uuid.UUID, tuple[Any, int]] = {}
        for seen in {r.observer_id: r for r in rows}.values():
            row = self._as_seen(seen)
            if row is None:
                continue
            if row.id in self.locked:
                locked.add(row.id)
                continue
            if decision is Decision.TAKE:
                row.status, row.service_id = ObserverStatus.PROCESSING, self.me
                row.epoch += 1
                row.handoff_to = row.waiting = None
                row.queued_epoch = row.epoch if row.id in queued else None
                row.dispatch_id = (dispatches or {}).get(row.id, row.dispatch_id)
                row.directed_to = None
                row.events.append("taken")
                resumed[row.id] = (row.checkpoint, row.output_seq)
            elif decision is Decision.COMPLETE_STOP:
                row.status, row.service_id, row.waiting = STOPPED[row.status], None, None
            else:
                raise ValueError(f"{decision} is not a write")
            epochs[row.id] = row.epoch
        if self.lose_replies:
            self.lose_replies -= 1
            raise DatabaseUnavailable("connection lost before the reply")
        return Written(epochs, frozenset(locked), resumed)

    async def checkpoint_many(self, items: Sequence[Checkpoint]) -> list[bool | Locked]:
        self._up("checkpoint_many")
        out: list[bool | Locked] = []
        for c in items:
            row = self.rows.get(c.observer_id)
            ok = self._mine(row, Copy(c.observer_id, c.epoch))
            if ok and c.observer_id in self.locked:
                out.append(LOCKED)
                continue
            if ok and row is not None:
                if row.output_seq not in (c.first_seq - 1, c.first_seq - 1 + len(c.records)):
                    out.append(False)  # out of step: refused like a fence
                    continue
                if c.state_json is not None:
                    row.checkpoint = json.loads(c.state_json)
                if c.records and row.output_seq == c.first_seq - 1:
                    self.outputs[(row.id, c.first_seq)] = Committed(
                        row.id, c.first_seq, c.epoch, row.kind, row.name, 0.0, c.records
                    )
                row.output_seq = c.first_seq - 1 + len(c.records)
            out.append(ok)
        return out

    async def outputs_backlog(self, observer_ids: Sequence[uuid.UUID]) -> list[Committed]:
        self._up("outputs_backlog")
        every = {**self.left_by_others, **self.outputs}
        return sorted(
            (o for (oid, _), o in every.items() if oid in observer_ids),
            key=lambda o: (str(o.observer_id), o.seq),
        )

    async def delete_published(self, commits: Sequence[tuple[uuid.UUID, int]]) -> None:
        self._up("delete_published")
        for key in commits:
            self.outputs.pop(key, None)
            self.left_by_others.pop(key, None)

    async def release_many(
        self, copies: Sequence[Copy], detail: str
    ) -> list[ObserverStatus | Locked | None]:
        self._up("release_many")
        out: list[ObserverStatus | Locked | None] = []
        for copy in copies:
            row = self.rows.get(copy[0])
            if row is None or not self._mine(row, copy):
                out.append(None)
                continue
            if row.id in self.locked:
                out.append(LOCKED)
                continue
            row.status = STOPPED.get(row.status, row.status)
            row.directed_to = row.handoff_to
            row.service_id = row.handoff_to = None
            row.events.append(f"{row.status.value}: {detail}")
            out.append(row.status)
        return out

    async def record_error(
        self, copy: Copy, error: str, policy: RestartPolicy
    ) -> ErrorRecord | None:
        self._up("record_error")
        row = self.rows.get(copy[0])
        if row is None or not self._mine(row, copy):
            return None
        if row.id in self.locked:
            raise RowLocked("the fake row is locked")
        now = self.clock.now()
        fresh = row.restarted_at is None or row.restarted_at < now - policy.reset_after
        n = 1 if fresh else row.restart_count + 1
        failed = row.status is ObserverStatus.PROCESSING and n > policy.max_restarts
        row.restart_count, row.restarted_at, row.last_error = (n - 1 if failed else n), now, error
        if failed:
            row.status, row.service_id = ObserverStatus.FAILED, None
        return ErrorRecord(restarts=row.restart_count, failed=failed)

    async def fail(self, copy: Copy, error: str) -> bool:
        self._up("fail")
        row = self.rows.get(copy[0])
        if row is None or not self._mine(row, copy) or row.status is not ObserverStatus.PROCESSING:
            return False
        row.status, row.service_id, row.last_error = ObserverStatus.FAILED, None, error
        return True

    async def blame(self, observer_id: uuid.UUID, reason: str) -> bool:
        self._up("blame")
        return self.blame_now(observer_id, reason)

    def blame_now(self, observer_id: uuid.UUID, reason: str) -> bool:
        """``ThreadWrites.blame`` from the watchdog thread."""
        if not self.available:
            raise DatabaseUnavailable("the fake database is down")
        row = self.rows.get(observer_id)
        if row is None or row.status not in (ObserverStatus.PROCESSING, ObserverStatus.CREATED):
            return False
        row.status, row.service_id, row.last_error = ObserverStatus.FAILED, None, reason
        return True

    async def pass_on(self, observer_id: uuid.UUID, dispatch_id: uuid.UUID, why: str) -> bool:
        self._up("pass_on")
        row = self.rows.get(observer_id)
        if row is None or row.dispatch_id != dispatch_id or row.status not in LIVE:
            return False
        holder = self.services.get(row.service_id) if row.service_id is not None else None
        if holder is not None and holder.live:
            return False
        row.waiting = why
        return True

    async def reconcile(self, running: set[uuid.UUID]) -> int:
        self._up("reconcile")
        n = 0
        for row in self.rows.values():
            if row.service_id == self.me and row.status in HELD and row.id not in running:
                row.status, row.service_id = STOPPED.get(row.status, row.status), None
                n += 1
        return n

    async def held_count(self) -> int:
        self._up("held_count")
        return sum(1 for r in self.rows.values() if r.service_id == self.me and r.status in HELD)

    async def held_copies(self) -> set[Copy]:
        self._up("held_copies")
        return {
            Copy(r.id, r.epoch)
            for r in self.rows.values()
            if r.service_id == self.me and r.status in HELD
        }

    async def mark_queued(self, marks: Mapping[Copy, bool]) -> set[uuid.UUID]:
        self._up("mark_queued")
        for copy, yes in marks.items():
            row = self.rows.get(copy.observer_id)
            if self._mine(row, copy) and row is not None:
                row.queued_epoch = row.epoch if yes else None
        return set()

    async def control_facts(self, observer_ids: Sequence[uuid.UUID]) -> ControlFacts:
        self._up("control_facts")
        found = (self.rows[i] for i in observer_ids if i in self.rows)
        return ControlFacts(
            draining=self.draining,
            observers={r.id: Holding(r.status, r.service_id, r.epoch, r.handoff_to) for r in found},
        )


# ------------------------------------------------------------------------------------ lease
_keys = itertools.count(1)


class FakeLeaseSession:
    def __init__(self, db: FakeLeaseDatabase, on_end: Callable[[], None]) -> None:
        self.db = db
        self.lock_key = next(_keys)
        self._on_end = on_end
        self._ended = False

    @property
    def ended(self) -> bool:
        return self._ended

    def end(self) -> None:
        """The session ends by itself (pg_terminate_backend, a pooler, a database restart)."""
        if not self._ended:
            self._ended = True
            self._on_end()

    def _up(self) -> None:
        if self._ended:
            raise DatabaseUnavailable("session ended")
        if not self.db.available:
            raise DatabaseUnavailable("the fake database is down")

    async def prepare_join(self) -> None:
        pass

    async def join(self, ttl: float) -> bool:
        self._up()
        self.db.joins.append(self.lock_key)
        self.db.key = self.lock_key
        self.db.expired = False
        return self.db.draining

    async def renew(
        self,
        ttl: float,
        timeout: float,
        *,
        stalled: bool = False,
        taking: Collection[uuid.UUID] = (),
    ) -> Renewal | None:
        self._up()
        self.db.renewals += 1
        self.db.stalled = stalled
        self.db.taking = set(taking)
        if self.db.expired:
            return None
        self.db.key = self.lock_key
        deleting, self.db.deleting = self.db.deleting, []
        store = self.db.store
        directed = (
            []
            if store is None
            else [
                r.start
                for r in store.rows.values()
                if r.directed_to == store.me and r.service_id is None and r.status in LIVE
            ]
        )
        return Renewal(
            deleting=deleting,
            draining=self.db.draining,
            directed=directed,
            database_time=self.db.time(),
            timeline=self.db.timeline,
        )

    async def held(self, timeout: float) -> set[Copy]:
        self._up()
        store = self.db.store
        if store is None:
            return set()
        return {
            Copy(r.id, r.epoch)
            for r in store.rows.values()
            if r.service_id == store.me and r.status in HELD
        }

    async def close(self, *, deleted: bool) -> None:
        self._ended = True
        self.db.left = deleted

    def terminate(self) -> None:
        self._ended = True


class FakeLeaseDatabase:
    """``store``: where ``held`` reads the rows this service holds."""

    def __init__(self, store: InMemoryStore | None = None) -> None:
        self.store = store
        #: The lock key the service's row names (published by each renewal).
        self.key: int | None = None
        self.available = True
        self.expired = False
        self._draining = False
        self.deleting: list[uuid.UUID] = []
        self.joins: list[int] = []
        self.renewals = 0
        #: What the last renewal said: kind code blocked the loop lately.
        self.stalled = False
        #: What the last renewal said: the observers whose take was in flight.
        self.taking: set[uuid.UUID] = set()
        self.left: bool | None = None
        self.sessions: list[FakeLeaseSession] = []
        #: Seconds the database's clock ran ahead of ours (a pause our clocks did not see).
        self.unseen = 0.0
        #: The database's timeline (a failover raises it).
        self.timeline = 1

    def time(self) -> float:
        """The database's clock: ours, plus what ours did not see."""
        return time.monotonic() + self.unseen

    @property
    def draining(self) -> bool:
        """The service row's flag: the store's, where there is one (one row, as in the
        database)."""
        return self._draining if self.store is None else self.store.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        if self.store is None:
            self._draining = value
        else:
            self.store.draining = value

    async def connect(self, on_end: Callable[[], None]) -> FakeLeaseSession:
        if not self.available:
            raise DatabaseUnavailable("the fake database is down")
        session = FakeLeaseSession(self, on_end)
        self.sessions.append(session)
        return session


# ----------------------------------------------------------------------------------- broker
_generations = itertools.count(1)


class FakeDelivery(Settling):
    def __init__(self, body: bytes, session: FakeSession, *, redelivered: bool) -> None:
        self.body = body
        self.redelivered = redelivered
        self.trace: Carrier | None = None
        self._session = session
        #: "ack", "requeue", "reject", or None while unsettled.
        self.outcome: str | None = None

    @property
    def live(self) -> bool:
        return self._session.is_open

    async def _settle(self, how: str) -> bool:
        if not self.live:
            return False
        self.outcome = how
        return True


class FakeSession:
    def __init__(self, broker: FakeBroker, on_start: OnStart, on_control: OnControl) -> None:
        self.broker = broker
        self.generation = next(_generations)
        self.closed = asyncio.Event()
        self.close_reason = "closed_here"
        self.version: tuple[int, ...] = (0,)
        self.consuming = True
        self._on_start = on_start
        self._on_control = on_control

    @property
    def is_open(self) -> bool:
        return not self.closed.is_set()

    async def deliver(self, start: StartMessage, *, redelivered: bool = False) -> FakeDelivery:
        """Hand the service a start message, as the work queue would; returns once handled."""
        delivery = FakeDelivery(start.to_bytes(), self, redelivered=redelivered)
        await self._on_start(delivery)
        return delivery

    async def control(self, body: bytes) -> None:
        await self._on_control(body, None)

    async def stop_consuming(self) -> None:
        self.consuming = False

    async def start_consuming(self) -> None:
        self.consuming = True

    async def close(self) -> None:
        self.closed.set()

    async def send_start(self, start: StartMessage, on: uuid.UUID | None = None) -> None:
        if not self.is_open:
            raise BrokerUnavailable("session closed")
        self.broker.sent.append((start, on))

    async def send_error(self, start: StartMessage) -> None:
        self.broker.errors.append(start)

    async def send_cancel(self, observer_id: uuid.UUID) -> None:
        self.broker.cancels.append(observer_id)

    async def service_present(self, service_id: uuid.UUID) -> bool:
        self.broker.probes.append(service_id)
        return service_id in self.broker.present

    async def publish_outputs(self, commits: Sequence[Committed]) -> None:
        if not self.is_open:
            raise BrokerUnavailable("session closed")
        for c in commits:
            self.broker.outputs.extend(c.outputs())


class FakeBroker:
    def __init__(self) -> None:
        self.sessions: list[FakeSession] = []
        #: Starts published by the service: (start, directed to) — None is the work queue.
        self.sent: list[tuple[StartMessage, uuid.UUID | None]] = []
        self.errors: list[StartMessage] = []
        self.cancels: list[uuid.UUID] = []
        #: Services whose control queue exists.
        self.present: set[uuid.UUID] = set()
        #: Every question "is this service on the broker?" asked, in order.
        self.probes: list[uuid.UUID] = []
        #: Outputs published (each record a message), in order.
        self.outputs: list[Output] = []
        self.opened = asyncio.Event()

    @property
    def session(self) -> FakeSession:
        return self.sessions[-1]

    async def open(self, spec: SessionSpec) -> FakeSession:
        session = FakeSession(self, spec.on_start, spec.on_control)
        session.consuming = spec.consume_work
        self.sessions.append(session)
        self.present.add(spec.service_id)
        self.opened.set()
        return session


class FakeThreadWrites:
    """The watchdog thread's writes, on the in-memory store."""

    def __init__(self, store: InMemoryStore) -> None:
        self.store = store
        self.stalls_marked = 0

    def blame(self, observer_id: uuid.UUID, reason: str) -> bool:
        return self.store.blame_now(observer_id, reason)

    def mark_stalled(self) -> None:
        if not self.store.available:
            raise DatabaseUnavailable("the fake database is down")
        self.stalls_marked += 1
