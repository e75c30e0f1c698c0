"""The database schema: one source for Alembic, the manager and the services."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from orch_contracts.routing import Route
from orch_contracts.statuses import ObserverStatus

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def _now() -> Any:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


class Service(Base):
    """One observer-service process; a new row (and id) for every start."""

    __tablename__ = "services"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    name: Mapped[str] = mapped_column(Text, nullable=False)
    worker_count: Mapped[int] = mapped_column(Integer, nullable=False)
    host: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
    pid: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    version: Mapped[str] = mapped_column(Text, nullable=False, server_default="")
    #: Advisory-lock key held by the service's session for as long as the process lives.
    lock_key: Mapped[int] = mapped_column(BigInteger, nullable=False)
    created_at: Mapped[datetime] = _now()
    modified_at: Mapped[datetime] = _now()
    lease_expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    last_heartbeat_at: Mapped[datetime] = _now()
    is_deleted: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    #: A draining service takes no new observers and hands its own to others.
    draining: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    #: Set by the service's watchdog thread while one step of kind code blocks its event loop,
    #: cleared by its next renewal: such a process cannot notice that its session ended, so no
    #: one takes its observers before its lease expires (the fast takeover waits).
    stalled_since: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: When the service last came back after losing its lease: for a while after, the leader
    #: sends it no directed start and moves nothing to it (it may not keep the new lease either).
    rejoined_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The observers it was taking (their starts admitted) at its last renewal (None: none):
    #: the leader's audit sends none of them anew while the service lives.
    taking: Mapped[list[uuid.UUID] | None] = mapped_column(ARRAY(UUID(as_uuid=True)))
    #: Its resident memory, and its share of one core over its last renewal period, as its
    #: last renewal reported them (None: not yet, or a service of an earlier release).
    rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cpu: Mapped[float | None] = mapped_column(Float)
    #: When the leader's sweeper proved its process gone (its lease session ended and its
    #: broker connection closed): the broker had requeued its deliveries by then.
    gone_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The kinds it runs, as it advertised them when it joined: {name: {"description",
    #: "params_schema", "secret_params", "restart_policy"}}. None: a service of an earlier
    #: release (every kind).
    kinds: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    #: The pool it joined: it runs only observers of that pool.
    pool: Mapped[str] = mapped_column(Text, nullable=False, server_default="default")

    __table_args__ = (
        Index(
            "ix_services_live_lease", "lease_expires_at", postgresql_where=text("NOT is_deleted")
        ),
    )


class Observer(Base):
    """One infinite task: what runs it (kind, params), where (service, epoch), its saved state."""

    __tablename__ = "observers"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    name: Mapped[str] = mapped_column(Text, nullable=False)
    #: What names that look alike share (``orch_contracts.names.name_key``): unique among the live.
    #: None only for a look-alike of an older live observer from before keys existed (0007).
    name_key: Mapped[str | None] = mapped_column(Text)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    params: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default="{}")
    status: Mapped[str] = mapped_column(Text, nullable=False)
    service_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("services.id"), nullable=True
    )
    #: Fencing token: grows by one at every take; writes from an older epoch are refused.
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    #: Id of the one start message that may start this observer; older messages are stale.
    dispatch_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    checkpoint: Mapped[Any | None] = mapped_column(JSONB, nullable=True)
    checkpointed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: Restarts within the current window (see RestartPolicy.reset_after).
    restart_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    #: When the last restart was recorded; the window heals reset_after seconds after it.
    restarted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    #: Optional per-observer restart policy overriding the kind's (JSON of RestartPolicy).
    restart_policy: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = _now()
    modified_at: Mapped[datetime] = _now()
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    dispatched_at: Mapped[datetime] = _now()
    #: The service the leader asked the holder to hand this observer to, written in the same
    #: transaction as the handoff message; cleared by every take. A holder hands over only what
    #: is recorded here: a handoff message alone proves nothing (anyone on the broker can send
    #: one).
    handoff_to: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    #: The last ``seq`` committed among the records it emitted (0: none yet), over all copies.
    output_seq: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    #: When the current copy last committed (a checkpoint or records): progress, as shown.
    committed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The number of the current copy's last commit (reset by every take): a commit retried
    #: after its answer was lost is known by its number and never lands twice.
    commit_no: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default="0")
    #: Why nobody runs it while it waits for a service able to ("no live service runs kind
    #: 'x'"); cleared by the take that starts it.
    waiting: Mapped[str | None] = mapped_column(Text)
    #: The pool it runs in: only services of that pool take it.
    pool: Mapped[str] = mapped_column(Text, nullable=False, server_default="default")
    #: The version of its kind it is pinned to (None: any): only services that advertise that
    #: version take it.
    kind_version: Mapped[str | None] = mapped_column(Text)
    #: When it was asked to move to another pool or version, until the leader finds it on a
    #: service that can run it there (``manager/moves.py``).
    moved_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: The epoch of the take whose copy came by a work-queue delivery, held unacked while it
    #: runs (the broker requeues it when the holder's connection closes); the current copy
    #: came so when it equals ``epoch`` (a directed start leaves it NULL). The sweeper leaves
    #: such observers of a gone holder to the requeue a while.
    queued_epoch: Mapped[int | None] = mapped_column(BigInteger)
    #: The service a directed start was last sent to (a re-dispatch, a handoff), until a take
    #: clears it: its lease renewal reads what nobody took within a renewal interval and takes
    #: it from the database (the start lost with a control queue, or not published in an
    #: alarm).
    directed_to: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))

    __table_args__ = (
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s.value}'" for s in ObserverStatus) + ")",
            name="status_valid",
        ),
        Index(
            "uq_observers_live_name",
            "name",
            unique=True,
            postgresql_where=text("status <> 'deleted'"),
        ),
        Index(
            "uq_observers_live_name_key",
            "name_key",
            unique=True,
            postgresql_where=text("status <> 'deleted'"),
        ),
        Index("ix_observers_service_id", "service_id"),
        Index("ix_observers_status", "status"),
        # The audit asks "was anything taken lately in this pool?" several times a second.
        Index("ix_observers_started_at", "started_at"),
        # The console's list in its default order (oldest first, or newest): a page is read
        # from the index, not sorted out of every observer.
        Index("ix_observers_created_at", "created_at", "id"),
        # What an idle cluster asks every second reads what it looks for, not every observer:
        # the lease renewal, a service's observers being stopped...
        Index(
            "ix_observers_stopping",
            "service_id",
            postgresql_where=text("status IN ('on_deleting', 'pausing')"),
        ),
        # ...and the leader's audit, live observers that nobody holds.
        Index("ix_observers_moving", "moved_at", postgresql_where=text("moved_at IS NOT NULL")),
        # ...a service's renewal, what was directed to it and not taken...
        Index(
            "ix_observers_directed_to",
            "directed_to",
            postgresql_where=text("directed_to IS NOT NULL"),
        ),
        Index(
            "ix_observers_unheld",
            "dispatched_at",
            postgresql_where=text("service_id IS NULL AND status IN ('created', 'processing')"),
        ),
    )


class ObserverOutput(Base):
    """Records an observer emitted, committed together and not yet confirmed by the broker: one
    row per commit, its records holding ``seq`` to ``seq + len(records) - 1``. The service that
    committed them publishes and deletes them; the leader relays what a dead one left."""

    __tablename__ = "observer_outputs"

    observer_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    #: The first record's seq.
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, nullable=False)
    kind: Mapped[str] = mapped_column(Text, nullable=False)
    name: Mapped[str] = mapped_column(Text, nullable=False)
    #: A JSON array of the records, in seq order.
    records: Mapped[Any] = mapped_column(JSONB, nullable=False)
    committed_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")
    )
    #: The service that committed them (it publishes them while its lease lives).
    service_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)

    __table_args__ = (
        Index("ix_observer_outputs_service_id", "service_id"),
        Index("ix_observer_outputs_committed_at", "committed_at"),
    )


class OutboxMessage(Base):
    """A broker message written in the same transaction as the change that needs it."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    #: Where it goes: a ``orch_contracts.routing.Route`` value.
    route: Mapped[str] = mapped_column(Text, nullable=False)
    #: For Route.SERVICE: the service whose control queue it goes to.
    service_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    body: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = _now()
    #: For a start: the observer's pool, whose work queue takes it (also when a directed
    #: start comes back).
    pool: Mapped[str] = mapped_column(Text, nullable=False, server_default="default")
    #: The W3C trace context it was written in (``orch_contracts.tracing``; NULL when tracing is
    #: off): the relay publishes it in that trace.
    trace: Mapped[dict[str, str] | None] = mapped_column(JSONB)

    __table_args__ = (
        Index("ix_outbox_created_at", "created_at"),
        CheckConstraint(
            "route IN (" + ", ".join(f"'{r.value}'" for r in Route) + ")", name="route_valid"
        ),
        CheckConstraint("(route = 'service') = (service_id IS NOT NULL)", name="service_route"),
    )


class ObserverEvent(Base):
    """History of an observer: every take, release, restart, failure and deletion."""

    __tablename__ = "observer_events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    observer_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("observers.id", ondelete="CASCADE"), nullable=False
    )
    at: Mapped[datetime] = _now()
    event: Mapped[str] = mapped_column(Text, nullable=False)
    service_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    epoch: Mapped[int | None] = mapped_column(BigInteger)
    detail: Mapped[str | None] = mapped_column(Text)
    #: The API token whose request wrote it (its name); NULL for the orchestrator's own doing.
    actor: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_observer_events_observer_id", "observer_id", "id"),
        Index(
            "ix_observer_events_actor",
            "actor",
            "id",
            postgresql_where=text("actor IS NOT NULL"),
        ),
    )


#: How many observers there are by status, kind, pool and holder. Its rows are deltas, a key's
#: count the sum of its rows: triggers on ``observers`` add them (migration 0015), the leader
#: folds them into one row per key.
observer_counts = Table(
    "observer_counts",
    Base.metadata,
    Column("status", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("pool", Text, nullable=False),
    Column("service_id", UUID(as_uuid=True)),
    Column("n", BigInteger, nullable=False),
    Index("ix_observer_counts_service_id", "service_id"),
)


class LeaderLease(Base):
    """A named lease for electing one manager to run the background loops."""

    __tablename__ = "leader_leases"
    # ``holder`` a key column: a takeover waits for the old holder's fenced transactions
    # (``FOR KEY SHARE``), a renewal does not (migration 0016).
    __table_args__ = (Index("ix_leader_leases_name_holder", "name", "holder", unique=True),)

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    holder: Mapped[str] = mapped_column(Text, nullable=False)
    acquired_at: Mapped[datetime] = _now()
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
