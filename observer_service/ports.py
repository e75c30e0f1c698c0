"""What the service core needs from the outside world, as protocols, and the values it trades.

``store.PgStore``/``store.PgLeaseDatabase`` and ``broker.AmqpBroker`` are the real parts;
``fakes`` has in-memory ones for unit tests of the core's own logic. Every claim about how
PostgreSQL or RabbitMQ behave is tested against the real servers.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from contracts.kinds import RestartPolicy
from contracts.messages import StartMessage
from contracts.statuses import ObserverStatus
from observer_service.take import Decision, Departed

Copy = tuple[uuid.UUID, int]  # (observer id, epoch): one copy of an observer


@dataclass(frozen=True)
class StartRequest:
    """A start message to decide on."""

    start: StartMessage
    redelivered: bool
    #: A copy of this observer runs here on a live broker session.
    running_here: bool

    @property
    def observer_id(self) -> uuid.UUID:
        return self.start.observer_id


@dataclass(frozen=True)
class Taken:
    observer_id: uuid.UUID
    name: str
    kind: str
    params: dict[str, Any]
    checkpoint: Any
    restart_policy: dict[str, Any] | None
    epoch: int
    dispatch_id: uuid.UUID

    @property
    def copy(self) -> Copy:
        return (self.observer_id, self.epoch)

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


@dataclass(frozen=True)
class Checkpoint:
    observer_id: uuid.UUID
    epoch: int
    state_json: str


@dataclass(frozen=True)
class ErrorRecord:
    """What the database made of an error of a copy: restarts counted in the current window,
    and whether the budget is spent (the row is ``failed`` then)."""

    restarts: int
    failed: bool


@dataclass(frozen=True)
class Renewal:
    """What a lease renewal learned: own observers being deleted, and whether to drain."""

    deleting: list[uuid.UUID]
    draining: bool


class Store(Protocol):
    """The service's reads and writes of observer rows. Every write for a running copy is fenced
    by its epoch and holder. Raises DatabaseUnavailable when the database is."""

    me: uuid.UUID

    async def take_many(
        self, requests: Sequence[StartRequest], departed: Departed
    ) -> list[TakeResult]: ...

    async def checkpoint_many(self, items: Sequence[Checkpoint]) -> list[bool]: ...

    async def let_go_many(
        self, copies: Sequence[Copy], detail: str
    ) -> list[ObserverStatus | None]: ...

    async def record_error(
        self, copy: Copy, error: str, policy: RestartPolicy
    ) -> ErrorRecord | None: ...

    async def fail(self, copy: Copy, error: str) -> bool: ...

    async def reconcile(self, running: set[uuid.UUID]) -> int: ...

    async def held_count(self) -> int: ...


class LeaseSession(Protocol):
    """One database session that holds the service's advisory lock for as long as it lives."""

    lock_key: int

    @property
    def ended(self) -> bool: ...

    async def join(self, ttl: float) -> bool: ...

    async def renew(self, ttl: float, timeout: float) -> Renewal | None: ...

    async def close(self, *, deleted: bool) -> None: ...

    def terminate(self) -> None: ...


class Witness(Protocol):
    """A broker session that can prove it has been open all along."""

    generation: int

    async def confirm_present(self) -> bool:
        """A round trip on this same connection finding our control queue: the connection (so
        the queue) has been open without a break since it was made. Raises BrokerUnavailable."""
        ...


class LeaseDatabase(Protocol):
    async def connect(self, on_end: Callable[[], None]) -> LeaseSession:
        """A new session with a new lock key; ``on_end`` is called if it ends by itself."""
        ...


class Delivery(Protocol):
    """A start message delivered from the work queue; settling is a no-op once its session
    is closed (the broker has requeued it then)."""

    body: bytes
    redelivered: bool
    generation: int

    async def ack(self) -> None: ...

    async def requeue(self) -> None: ...

    async def reject(self) -> bool:
        """Dead-letter it; False when its session is gone."""
        ...


class Settling:
    """How a delivery is settled, once: the real and the fake delivery share it."""

    async def _settle(self, how: str) -> bool:
        raise NotImplementedError

    async def ack(self) -> None:
        await self._settle("ack")

    async def requeue(self) -> None:
        await self._settle("requeue")

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

    async def close(self) -> None: ...

    async def send_start(self, start: StartMessage, on: uuid.UUID | None = None) -> None: ...

    async def send_error(self, start: StartMessage) -> None: ...

    async def service_present(self, service_id: uuid.UUID) -> bool:
        """Whether the service's exclusive control queue exists: its broker connection lives."""
        ...

    async def confirm_present(self) -> bool: ...


OnStart = Callable[[Delivery], Awaitable[None]]
OnControl = Callable[[bytes], Awaitable[None]]


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
