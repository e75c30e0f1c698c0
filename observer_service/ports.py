"""What the service core needs from the outside world, as protocols, and the values it trades.

``store.PgStore``/``store.PgLeaseDatabase`` and ``broker.AmqpBroker`` are the real parts;
the tests' ``tests/support/fakes.py`` has in-memory ones for unit tests of the core's own logic.
Every claim about how PostgreSQL or RabbitMQ behave is tested against the real servers.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple, Protocol

from observer_service.take import Decision
from orch_contracts.kinds import RestartPolicy
from orch_contracts.messages import StartMessage
from orch_contracts.outputs import Committed
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.statuses import ObserverStatus
from orch_contracts.tracing import Carrier


class Locked(Enum):
    """A batched write skipped a row another transaction had locked, so that the rest of the
    batch need not wait: not written, and not fenced either. The caller writes it again."""

    ROW = "row locked"


#: What a batched write answers for an item whose row it skipped as locked.
LOCKED = Locked.ROW


class Copy(NamedTuple):
    """One copy of an observer: the observer and the epoch it was taken with."""

    observer_id: uuid.UUID
    epoch: int


@dataclass(frozen=True)
class StartRequest:
    """A start message to decide on."""

    start: StartMessage
    redelivered: bool
    #: A copy of this observer runs here (and is not being stopped).
    running_here: bool
    #: A slot is held for it: a take may run it. Without one, TAKE is answered NO_ROOM.
    room: bool = True
    #: It came by a work-queue delivery (held unacked while the copy runs), not directed.
    queued: bool = False

    @property
    def observer_id(self) -> uuid.UUID:
        return self.start.observer_id


@dataclass(frozen=True, slots=True)
class Taken:
    observer_id: uuid.UUID
    name: str
    kind: str
    params: dict[str, Any]
    checkpoint: Any
    restart_policy: dict[str, Any] | None
    epoch: int
    dispatch_id: uuid.UUID
    #: The last seq committed of its outputs when it was taken (the next is one more).
    output_seq: int = 0

    @property
    def copy(self) -> Copy:
        return Copy(self.observer_id, self.epoch)

    @property
    def start(self) -> StartMessage:
        return StartMessage(observer_id=self.observer_id, dispatch_id=self.dispatch_id)


@dataclass(frozen=True)
class TakeResult:
    decision: Decision
    taken: Taken | None = None
    holder: uuid.UUID | None = None
    #: The lock key of the holder's lease session (what a PROBE proves gone).
    holder_key: int | None = None
    #: For WAIT: seconds until the holder's lease expires.
    holder_remaining: float = 0.0
    #: The observer's kind, pool and pinned version, as the facts read saw them (None: no such
    #: observer, or taken; or, for the version, not pinned).
    kind: str | None = None
    pool: str | None = None
    kind_version: str | None = None


@dataclass(frozen=True)
class Seen:
    """An observer row and its holder as one facts read saw them: what the take rule decides
    from, and what a compare-and-set requires the row still to be."""

    observer_id: uuid.UUID
    status: ObserverStatus
    dispatch_id: uuid.UUID
    epoch: int
    holder: uuid.UUID | None
    #: The holder's lease has not expired and it is not deleted.
    holder_live: bool
    #: Another live holder's lease-session lock was free at the read (else False).
    holder_lock_free: bool
    #: The lock key of the holder's lease session.
    holder_key: int | None
    #: Seconds until the holder's lease expires (0 when unknown or none).
    holder_remaining: float
    name: str
    kind: str
    params: dict[str, Any]
    checkpoint: Any
    restart_policy: dict[str, Any] | None
    pool: str = DEFAULT_POOL
    #: The version of its kind it is pinned to (None: any).
    kind_version: str | None = None


@dataclass(frozen=True)
class Written:
    """What a compare-and-set made of the rows it was given: the new epoch of each it wrote,
    and those it found as seen but locked by another transaction. Any other row had changed
    since it was seen (the loop reads it again)."""

    epochs: dict[uuid.UUID, int]
    locked: frozenset[uuid.UUID]
    #: Of each row taken, what the new copy resumes from as the take found it (its checkpoint
    #: and last output seq): the facts read may predate the old holder's last commit.
    resumed: dict[uuid.UUID, tuple[Any, int]] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Checkpoint:
    """One commit of a copy: its state (None: unchanged) and the records it staged since its
    last commit (JSON texts), which get ``first_seq`` onwards. ``first_seq`` is one more than
    the copy's last committed seq: a commit lands only there, and one retried after its answer
    was lost is known by it and lands once."""

    observer_id: uuid.UUID
    epoch: int
    state_json: str | None
    records: tuple[str, ...] = ()
    first_seq: int = 1


@dataclass(frozen=True)
class ErrorRecord:
    """What the database made of an error of a copy: restarts counted in the current window,
    and whether the budget is spent (the row is ``failed`` then)."""

    restarts: int
    failed: bool


@dataclass(frozen=True)
class Renewal:
    """What a lease renewal learned: own observers being deleted, whether to drain, and the
    starts directed to this service that nobody took (their directed start lost, or not
    published: ``observers.directed_to``)."""

    deleting: list[uuid.UUID]
    draining: bool
    directed: list[StartMessage] = field(default_factory=list)
    #: The database's clock when it renewed (seconds; None: not told).
    database_time: float | None = None
    #: The database's WAL timeline (a failover raises it; None: not told).
    timeline: int | None = None


@dataclass(frozen=True)
class Holding:
    """What a control check reads of one observer row: who holds it, at which epoch, and the
    move the leader recorded for it."""

    status: ObserverStatus
    holder: uuid.UUID | None
    epoch: int
    handoff_to: uuid.UUID | None


@dataclass(frozen=True)
class ControlFacts:
    """What the database says when a control message arrives (``control.py``): whether this
    service's row says draining, and the rows of the observers the messages name."""

    draining: bool
    observers: dict[uuid.UUID, Holding]


class TakeRows(Protocol):
    """The two statements of a take; the loop over them is ``taking.take_many``, one for every
    store. Neither waits for a locked row."""

    me: uuid.UUID

    async def read_facts(self, observer_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Seen]:
        """Each existing observer and its holder, by id; a free holder lock is tried here."""
        ...

    async def compare_and_set(
        self,
        decision: Decision,
        rows: Sequence[Seen],
        queued: Collection[uuid.UUID] = (),
        dispatches: Mapping[uuid.UUID, uuid.UUID] | None = None,
    ) -> Written:
        """Write ``decision`` (one of ``take.WRITES``) to every row still as seen; a take from a
        live holder also needs the holder to still name the lock key seen. ``queued``: takes
        whose start came by a work-queue delivery; ``dispatches``: the dispatch of the start
        each take runs (the row's from then on; by default the row's own)."""
        ...


class Store(TakeRows, Protocol):
    """The service's reads and writes of observer rows. Every write for a running copy is fenced
    by its epoch and holder. Raises DatabaseUnavailable when the database is (RowLocked when a
    row is locked by another transaction); a batch answers LOCKED for a row it skipped as
    locked, and never waits for one."""

    async def checkpoint_many(self, items: Sequence[Checkpoint]) -> list[bool | Locked]: ...

    async def outputs_backlog(self, observer_ids: Sequence[uuid.UUID]) -> list[Committed]:
        """What was committed of these observers and is not confirmed yet (by any service),
        in seq order per observer."""
        ...

    async def delete_published(self, commits: Sequence[tuple[uuid.UUID, int]]) -> None:
        """Forget commits (observer, first seq) whose every record the broker confirmed."""
        ...

    async def release_many(
        self, copies: Sequence[Copy], detail: str
    ) -> list[ObserverStatus | Locked | None]: ...

    async def record_error(
        self, copy: Copy, error: str, policy: RestartPolicy
    ) -> ErrorRecord | None: ...

    async def fail(self, copy: Copy, error: str) -> bool: ...

    async def blame(self, observer_id: uuid.UUID, reason: str) -> bool:
        """Fail the observer whatever copy holds it (it blocked the event loop past the lease:
        not fenced, since this service's lease is gone by then)."""
        ...

    async def pass_on(self, observer_id: uuid.UUID, dispatch_id: uuid.UUID, why: str) -> bool:
        """Leave the observer, whose kind is not installed here, waiting for the leader to send
        it to a service that runs it (only while ``dispatch_id`` is current and no live service
        holds it): whether it was left so."""
        ...

    async def reconcile(self, running: set[uuid.UUID]) -> int: ...

    async def held_count(self) -> int: ...

    async def held_copies(self) -> set[Copy]:
        """The copies the database says this service holds (``queries.HELD_COPIES``)."""
        ...

    async def mark_queued(self, marks: Mapping[Copy, bool]) -> set[uuid.UUID]:
        """Whether each copy holds a live work-queue delivery (``queries.MARK_QUEUED``); the
        observers whose row was locked meanwhile, not written."""
        ...

    async def control_facts(self, observer_ids: Sequence[uuid.UUID]) -> ControlFacts:
        """This service's draining flag and the named observers' rows, with one read by key."""
        ...


class LeaseSession(Protocol):
    """One database session that holds the service's advisory lock for as long as it lives."""

    lock_key: int

    @property
    def ended(self) -> bool: ...

    async def prepare_join(self) -> None:
        """Ready the join, before the lease's clock starts (a slow link's round trip)."""

    async def join(self, ttl: float) -> bool: ...

    async def renew(
        self,
        ttl: float,
        timeout: float,
        *,
        stalled: bool = False,
        taking: Collection[uuid.UUID] = (),
    ) -> Renewal | None:
        """Renew; ``stalled``: kind code blocked the loop lately, keep the service marked;
        ``taking``: the observers being taken here, their start admitted and not waiting for
        room (the leader sends them anew to no one)."""
        ...

    async def held(self, timeout: float) -> set[Copy]:
        """The copies the database says this service holds, read after the last renewal
        committed."""
        ...

    async def close(self, *, deleted: bool) -> None: ...

    def terminate(self) -> None: ...


class LeaseDatabase(Protocol):
    async def connect(self, on_end: Callable[[], None]) -> LeaseSession:
        """A new session with a new lock key; ``on_end`` is called if it ends by itself."""
        ...


class Delivery(Protocol):
    """A start message delivered from the work queue. Once its session is closed the broker
    has requeued it, and settling it does nothing (each call says whether it settled)."""

    body: bytes
    redelivered: bool
    #: The trace context it came with (``orch_contracts.tracing``).
    trace: Carrier | None

    @property
    def live(self) -> bool:
        """Its session is open: settling it still means something."""
        ...

    async def ack(self) -> bool: ...

    async def requeue(self) -> bool: ...

    async def reject(self) -> bool:
        """Dead-letter it."""
        ...


class Settling:
    """How a delivery is settled, once: the real and the fake delivery share it."""

    async def _settle(self, how: str) -> bool:
        raise NotImplementedError

    async def ack(self) -> bool:
        return await self._settle("ack")

    async def requeue(self) -> bool:
        return await self._settle("requeue")

    async def reject(self) -> bool:
        return await self._settle("reject")


class BrokerSession(Protocol):
    generation: int
    closed: asyncio.Event
    #: Why it closed (a short label), once it has.
    close_reason: str
    #: The broker's version, (0,) when unknown.
    version: tuple[int, ...]

    @property
    def is_open(self) -> bool: ...

    async def stop_consuming(self) -> None: ...

    async def start_consuming(self) -> None:
        """Consume the work queue again (after ``stop_consuming``, or a session opened without
        consuming it)."""
        ...

    async def close(self) -> None: ...

    async def send_start(self, start: StartMessage, on: uuid.UUID | None = None) -> None: ...

    async def send_error(self, start: StartMessage) -> None: ...

    async def send_cancel(self, observer_id: uuid.UUID) -> None: ...

    async def service_present(self, service_id: uuid.UUID) -> bool:
        """Whether the service's exclusive control queue exists: its broker connection lives."""
        ...

    async def publish_outputs(self, commits: Sequence[Committed]) -> None:
        """Publish the records of these commits, in order, one message each, and wait for
        every confirm; raises BrokerUnavailable (then any may or may not have been routed)."""
        ...


OnStart = Callable[[Delivery], Awaitable[None]]
#: A control message's body and the trace context it came with (``orch_contracts.tracing``).
OnControl = Callable[[bytes, Carrier | None], Awaitable[None]]


@dataclass(frozen=True)
class SessionSpec:
    """What a service asks of a new broker session."""

    service_id: uuid.UUID
    prefetch: int
    #: Consume the work queue (not while draining).
    consume_work: bool
    on_start: OnStart
    on_control: OnControl


class Broker(Protocol):
    async def open(self, spec: SessionSpec) -> BrokerSession: ...
