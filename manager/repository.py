"""Every unit of work the manager does in its database, each on a ``store.Tx``: the API's reads
and writes, the outbox, and what the leader's loops read and change. Every state change writes
its broker message to the outbox in the same transaction. The statements are in
``orch_manager.queries``; nothing outside this module runs them."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter

from orch_contracts.errors import Conflict, NameTaken, NotFound, NotLeading
from orch_contracts.messages import (
    CONTROL_MESSAGE,
    CancelMessage,
    DrainMessage,
    HandoffMessage,
    Message,
    StartMessage,
    UndrainMessage,
)
from orch_contracts.names import name_key
from orch_contracts.outputs import Committed
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.routing import BROADCAST, Destination, Route
from orch_contracts.statuses import EDITABLE, STOPPED, STOPPING, Event, ObserverStatus
from orch_contracts.tracing import Carrier, carrier
from orch_manager import queries as q
from orch_manager.auth import ACTOR
from orch_manager.store import Row, Tx

#: The one way the manager turns data into JSON for the database.
to_json = functools.partial(json.dumps, separators=(",", ":"), default=str)

_START: TypeAdapter[StartMessage] = TypeAdapter(StartMessage)


@dataclass(frozen=True)
class Pending:
    """An outbox record committed and not yet confirmed by the broker (``orch_manager.outbox``)."""

    id: int
    to: Destination
    message: Message
    #: The trace context it was written in (``orch_contracts.tracing``), to publish it in.
    trace: Carrier | None = None


def _trace_json(trace: Carrier | None) -> str | None:
    return None if trace is None else to_json(trace)


def parse(
    route: str, service_id: uuid.UUID | None, body: dict[str, Any], pool: str = DEFAULT_POOL
) -> Pending:
    to = Destination(Route(route), service_id, pool)
    message: Message = (
        _START.validate_python(body)
        if to.route in (Route.WORK, Route.ERRORS)
        else CONTROL_MESSAGE.validate_python(body)
    )
    return Pending(0, to, message)


def _like(text_: str) -> str:
    """``text_`` for ILIKE, its wildcards taken literally."""
    return text_.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _row(row: Row) -> dict[str, Any]:
    return dict(row)


async def actions(tx: Tx, by: str | None, limit: int) -> list[Row]:
    """The newest actions asked through the API, newest first: by the token named ``by``, or by
    any token."""
    if by is None:
        return await tx.rows(q.ACTIONS, n=limit)
    return await tx.rows(q.ACTIONS_BY, by=by, n=limit)


async def record_events(
    tx: Tx,
    ids: Sequence[uuid.UUID],
    event: Event,
    detail: str | Sequence[str] | None = None,
) -> None:
    """History rows: one event for each observer, with one detail for all or one each, and the
    API token whose request this is (``ACTOR``; None in the background loops). The one writer
    of history on the manager's side."""
    if not ids:
        return
    actor = ACTOR.get()
    if detail is None or isinstance(detail, str):
        await tx.rows(q.EVENTS, ids=list(ids), event=event.value, detail=detail, actor=actor)
    else:
        await tx.rows(
            q.EVENTS_EACH, ids=list(ids), event=event.value, details=list(detail), actor=actor
        )


# ----------------------------------------------------------------------------------- outbox
async def add_outbox(tx: Tx, messages: Sequence[tuple[Destination, Message]]) -> list[Pending]:
    """Outbox records, each with its own destination, in one statement: the one way in. Each
    keeps the trace context it is written in."""
    if not messages:
        return []
    trace = carrier()
    ids = await tx.values(
        q.OUTBOX_ADD,
        routes=[to.route.value for to, _ in messages],
        services=[to.service_id for to, _ in messages],
        pools=[to.pool for to, _ in messages],
        bodies=[to_json(m.to_json()) for _, m in messages],
        traces=[_trace_json(trace)] * len(messages),
    )
    return [Pending(i, to, m, trace) for i, (to, m) in zip(ids, messages, strict=True)]


async def outbox_due(tx: Tx, *, grace: float, limit: int, skip: list[int]) -> list[Pending]:
    """Records older than ``grace`` seconds, oldest first, but those in ``skip``; locked (and
    skipped by another relay) until the transaction ends."""
    rows = await tx.rows(q.OUTBOX_DUE, g=grace, n=limit, skip=skip)
    return [
        Pending(r.id, p.to, p.message, r.trace)
        for r in rows
        for p in (parse(r.route, r.service_id, r.body, r.pool),)
    ]


async def delete_outbox(tx: Tx, ids: list[int]) -> None:
    await tx.rows(q.OUTBOX_DELETE, ids=ids)


# ---------------------------------------------------------------------------------- outputs
async def outputs_left(tx: Tx, limit: int, grace: float) -> list[Committed]:
    """Commits of outputs no holder will publish (``queries.OUTPUTS_LEFT``)."""
    return [Committed.from_row(r) for r in await tx.rows(q.OUTPUTS_LEFT, n=limit, grace=grace)]


async def delete_outputs(tx: Tx, commits: list[Committed]) -> None:
    await tx.rows(
        q.OUTPUTS_DELETE, ids=[c.observer_id for c in commits], seqs=[c.seq for c in commits]
    )


async def oldest_output(tx: Tx) -> float:
    """Seconds since the oldest commit of outputs not yet confirmed was made (0: none)."""
    return float(await tx.value(q.OUTPUTS_OLDEST) or 0.0)


# -------------------------------------------------------------------------------- observers
@dataclass(frozen=True)
class NewObserver:
    name: str
    kind: str
    params: dict[str, Any]
    restart_policy: dict[str, Any] | None = None
    pool: str = DEFAULT_POOL
    #: The version of its kind it is pinned to (None: any).
    kind_version: str | None = None
    #: The trace context of the request that asks for it (``orch_contracts.tracing``).
    trace: Carrier | None = None
    #: The API token that asks for it (its create is written by another task: a group commit).
    actor: str | None = field(default_factory=ACTOR.get)

    @functools.cached_property
    def key(self) -> str:
        """What it shares with names that look like it (unique among live observers); folded
        once, however often a create asks."""
        return name_key(self.name)


async def create_observers(
    tx: Tx, new: Sequence[NewObserver]
) -> tuple[list[dict[str, Any] | NameTaken], list[Pending]]:
    """Rows, history and outbox records in one statement (one round trip). Each row, in the
    order asked for, or NameTaken (naming the observer that has it) where a live observer
    already has that name or one that looks like it."""
    starts = [StartMessage(observer_id=uuid.uuid4(), dispatch_id=uuid.uuid4()) for _ in new]
    keys = [n.key for n in new]
    rows = await tx.rows(
        q.CREATE_MANY,
        ids=[s.observer_id for s in starts],
        names=[n.name for n in new],
        keys=keys,
        kinds=[n.kind for n in new],
        params=[to_json(n.params) for n in new],
        ds=[s.dispatch_id for s in starts],
        rps=[to_json(n.restart_policy) if n.restart_policy else None for n in new],
        route=Route.WORK.value,
        bodies=[to_json(s.to_json()) for s in starts],
        pools=[n.pool for n in new],
        versions=[n.kind_version for n in new],
        traces=[_trace_json(n.trace) for n in new],
        actors=[n.actor for n in new],
    )
    made = {r.id: _row(r) for r in rows}
    pending = [
        Pending(made[s.observer_id].pop("outbox_id"), Destination.work(n.pool), s, n.trace)
        for s, n in zip(starts, new, strict=True)
        if s.observer_id in made
    ]
    skipped = [k for s, k in zip(starts, keys, strict=True) if s.observer_id not in made]
    holders = {}
    if skipped:  # the observers that hold those names, to name them
        holders = {r.name_key: r for r in await tx.rows(q.NAME_HOLDERS, keys=skipped)}
    out: list[dict[str, Any] | NameTaken] = []
    for s, n, key in zip(starts, new, keys, strict=True):
        row = made.get(s.observer_id)
        if row is not None:
            out.append(row)
        elif (holder := holders.get(key)) is None:  # held without a key (0007), or gone since
            out.append(NameTaken(n.name))
        else:
            out.append(NameTaken(holder.name, observer_id=holder.id, alike=holder.name != n.name))
    return out, pending


async def create_observer(tx: Tx, new: NewObserver) -> tuple[dict[str, Any], Pending]:
    (row,), pending = await create_observers(tx, [new])
    if isinstance(row, NameTaken):
        raise row
    return row, pending[0]


async def get_observer(tx: Tx, observer_id: uuid.UUID) -> dict[str, Any]:
    row = await tx.row(q.GET, id=observer_id)
    if row is None:
        raise NotFound(f"no observer with id {observer_id}")
    return _row(row)


async def list_observers(
    tx: Tx,
    *,
    status: ObserverStatus | None,
    kind: str | None,
    service_id: uuid.UUID | None,
    name: str | None = None,
    include_deleted: bool = True,
    limit: int,
    offset: int,
    pool: str | None = None,
    params: str | None = None,
) -> list[dict[str, Any]]:
    """A page of observers, oldest first; ``name`` matches any part of the name, ``params``
    (JSON) is contained in theirs."""
    rows = await tx.rows(
        q.LIST,
        status=status.value if status else None,
        kind=kind,
        pool=pool,
        params=params,
        sid=service_id,
        name=_like(name) if name else None,
        with_deleted=include_deleted or status is ObserverStatus.DELETED,
        limit=limit,
        offset=offset,
    )
    return [_row(r) for r in rows]


async def select_for_action(
    tx: Tx,
    *,
    ids: list[uuid.UUID] | None,
    status: ObserverStatus | None,
    kind: str | None,
    name_prefix: str | None,
    limit: int,
    pool: str | None = None,
) -> tuple[list[uuid.UUID], bool]:
    """The ids of the observers (not deleted) that match, oldest first, at most ``limit``; and
    whether more match."""
    rows = await tx.rows(
        q.SELECT_FOR_ACTION,
        ids=ids,
        status=status.value if status else None,
        kind=kind,
        pool=pool,
        prefix=_like(name_prefix) if name_prefix else None,
        limit=limit,
    )
    found = [r["id"] for r in rows]
    return found[:limit], len(found) > limit


async def list_events(
    tx: Tx, observer_id: uuid.UUID
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The observer (NotFound if there is none) and its history."""
    observer = await get_observer(tx, observer_id)
    rows = await tx.rows(q.LIST_EVENTS, id=observer_id)
    return observer, [_row(r) for r in rows]


@dataclass(frozen=True)
class Locked:
    """An observer's row, locked until the transaction ends, and whether its holder lives (read
    after the lock was granted: a take that committed meanwhile is seen with its holder)."""

    status: ObserverStatus
    service_id: uuid.UUID | None
    pool: str
    live: bool


async def _lock(tx: Tx, observer_id: uuid.UUID) -> Locked:
    row = await tx.row(q.LOCK, id=observer_id)
    if row is None:
        raise NotFound(f"no observer with id {observer_id}")
    sid = row.service_id
    live = sid is not None and bool(await tx.value(q.HOLDER_LIVE, sid=sid))
    return Locked(ObserverStatus(row.status), sid, row.pool, live)


async def _stop(
    tx: Tx,
    observer_id: uuid.UUID,
    stopping: ObserverStatus,
    refuse: frozenset[ObserverStatus] = frozenset(),
) -> tuple[dict[str, Any], list[Pending]]:
    """Delete or pause: at once when nothing runs it, else ``stopping`` plus a cancel broadcast
    (its holder stops the copy, and the row becomes what its stop makes of it). Repeating it is
    harmless: the broadcast goes again."""
    row = await _lock(tx, observer_id)
    final = STOPPED[stopping]
    messages: list[tuple[Destination, Message]] = []
    if row.status in refuse:
        raise Conflict(f"a {row.status} observer cannot be {final}")
    if row.status == final:
        pass
    elif row.status not in STOPPING and not row.live:
        # Nothing runs it (created, paused, failed, or a holder that is gone).
        await tx.rows(q.STOP_NOW, id=observer_id, status=final.value)
        await record_events(tx, [observer_id], Event(final.value), "was not running")
    else:
        if row.status != stopping:
            await tx.rows(q.SET_STATUS, id=observer_id, status=stopping.value)
            await record_events(tx, [observer_id], _ASKED[stopping])
        messages.append((BROADCAST, CancelMessage(observer_id=observer_id)))
    pending = await add_outbox(tx, messages)
    return await get_observer(tx, observer_id), pending


#: One observer's state change: its row, and the outbox records to publish once committed.
Change = Callable[[Tx, uuid.UUID], Awaitable[tuple[dict[str, Any], list[Pending]]]]

_ASKED = {ObserverStatus.ON_DELETING: Event.DELETING, ObserverStatus.PAUSING: Event.PAUSING}
_NOT_PAUSABLE = frozenset(
    {ObserverStatus.ON_DELETING, ObserverStatus.DELETED, ObserverStatus.FAILED}
)


async def delete_observer(tx: Tx, observer_id: uuid.UUID) -> tuple[dict[str, Any], list[Pending]]:
    """Deleted at once when nothing runs it; on_deleting plus a cancel broadcast otherwise. A
    delete wins over a pause under way."""
    return await _stop(tx, observer_id, ObserverStatus.ON_DELETING)


async def pause_observer(tx: Tx, observer_id: uuid.UUID) -> tuple[dict[str, Any], list[Pending]]:
    """Paused at once when nothing runs it; pausing plus a cancel broadcast otherwise (its
    holder stops it and its checkpoint stays)."""
    return await _stop(tx, observer_id, ObserverStatus.PAUSING, _NOT_PAUSABLE)


@dataclass(frozen=True)
class _Revival:
    only: ObserverStatus
    verb: str
    sql: str
    event: Event


_RESTART = _Revival(ObserverStatus.FAILED, "restarted", q.RESTART, Event.RESTART_REQUESTED)
_RESUME = _Revival(ObserverStatus.PAUSED, "resumed", q.RESUME, Event.RESUMED)


async def _start_anew(
    tx: Tx, observer_id: uuid.UUID, how: _Revival, row: Locked | None = None
) -> tuple[dict[str, Any], list[Pending]]:
    """Created again with a new dispatch id (older start messages become stale), published.
    ``row``: the observer's row, if the caller locked it already."""
    if row is None:
        row = await _lock(tx, observer_id)
    if row.status != how.only:
        later = " (try again once it is paused)" if row.status == ObserverStatus.PAUSING else ""
        raise Conflict(
            f"only a {how.only} observer can be {how.verb}; this one is {row.status}{later}"
        )
    dispatch_id = uuid.uuid4()
    await tx.rows(how.sql, id=observer_id, d=dispatch_id)
    await record_events(tx, [observer_id], how.event)
    start = StartMessage(observer_id=observer_id, dispatch_id=dispatch_id)
    pending = await add_outbox(tx, [(Destination.work(row.pool), start)])
    return await get_observer(tx, observer_id), pending


async def restart_observer(tx: Tx, observer_id: uuid.UUID) -> tuple[dict[str, Any], list[Pending]]:
    """Revive a failed observer with a fresh restart budget and a new dispatch. A running one
    is handed off to its own service: its copy stops as for any handoff (its cleanup runs,
    its last checkpoint is kept) and a new copy starts from that checkpoint, under a new epoch,
    once the old one has stopped (never beside it)."""
    row = await _lock(tx, observer_id)
    if row.status == ObserverStatus.PROCESSING:
        holder = row.service_id
        if holder is None or not row.live:
            raise Conflict(
                "this observer is moving to another service (its holder is gone): it starts "
                "afresh there"
            )
        handoffs, pending = await request_handoffs(
            tx,
            [(observer_id, holder, holder)],
            event=Event.RESTART_REQUESTED,
            detail="running: a new copy on its service, from its checkpoint",
        )
        # Always asked for: the row is locked, processing and held by ``holder``.
        assert handoffs, "a locked row held by a live holder was not marked"
        return await get_observer(tx, observer_id), pending
    if row.status != ObserverStatus.FAILED:
        why = {
            ObserverStatus.CREATED: " (it starts as soon as a service has room)",
            ObserverStatus.PAUSED: " (resume it instead)",
        }.get(row.status, "")
        raise Conflict(
            f"only a failed or running observer can be restarted; this one is {row.status}{why}"
        )
    return await _start_anew(tx, observer_id, _RESTART, row)


async def resume_observer(tx: Tx, observer_id: uuid.UUID) -> tuple[dict[str, Any], list[Pending]]:
    """A paused observer starts again, from its last checkpoint, on some service."""
    return await _start_anew(tx, observer_id, _RESUME)


async def locked_for_edit(tx: Tx, observer_id: uuid.UUID) -> dict[str, Any]:
    """A paused or failed observer, its row locked until the transaction ends (no copy runs it
    and none starts while it stays so): NotFound, or Conflict in any other status."""
    row = await tx.row(q.GET_LOCKED, id=observer_id)
    if row is None:
        raise NotFound(f"no observer with id {observer_id}")
    if row.status not in EDITABLE:
        raise Conflict(
            f"only a paused or failed observer's params can be edited; this one is {row.status} "
            "(pause it, edit it, then resume it)"
        )
    return _row(row)


async def edit_params(tx: Tx, row: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """New params for the observer ``locked_for_edit`` gave as ``row``: its resume or restart
    starts with them. The history names the keys that changed, never their values."""
    before = row["params"] or {}
    await tx.rows(q.EDIT_PARAMS, id=row["id"], params=json.dumps(params))
    keys = sorted(k for k in params.keys() | before.keys() if params.get(k) != before.get(k))
    await record_events(tx, [row["id"]], Event.PARAMS_EDITED, ", ".join(keys) or "unchanged")
    return await get_observer(tx, row["id"])


async def list_services(tx: Tx, *, include_deleted: bool) -> list[dict[str, Any]]:
    rows = await tx.rows(q.LIST_SERVICES, all=include_deleted)
    return [_row(r) for r in rows]


async def service_named(tx: Tx, ref: str) -> uuid.UUID:
    """A service's id, from its id or the name of the one live service that has it."""
    try:
        return uuid.UUID(ref)
    except ValueError:
        pass
    ids = await tx.values(q.LIVE_SERVICES_NAMED, name=ref)
    if not ids:
        raise NotFound(f"no live service is named {ref!r}")
    if len(ids) > 1:
        raise Conflict(f"{len(ids)} live services are named {ref!r}: give one's id")
    return uuid.UUID(str(ids[0]))


async def drain_service(
    tx: Tx, ref: str, *, draining: bool = True
) -> tuple[dict[str, Any], list[Pending]]:
    """Mark a live service (an id, or a live one's name) draining and tell it: it hands its
    observers over and takes none. With ``draining=False``, undo that: it takes work again
    (undraining one that does not drain changes nothing)."""
    service_id = await service_named(tx, ref)
    if await tx.row(q.DRAIN if draining else q.UNDRAIN, id=service_id) is None:
        raise NotFound(f"no live service with id {service_id}")
    message = (DrainMessage if draining else UndrainMessage)(service_id=service_id)
    pending = await add_outbox(tx, [(BROADCAST, message)])
    row = await get_service(tx, service_id)
    assert row is not None  # drained above, in this transaction
    return row, pending


async def get_service(tx: Tx, service_id: uuid.UUID) -> dict[str, Any] | None:
    """One service, live or not."""
    row = await tx.row(q.GET_SERVICE, id=service_id)
    return None if row is None else _row(row)


# ------------------------------------------------------------------- leader election, health
async def leader_claim(tx: Tx, *, renew: bool, name: str, holder: str, ttl: float) -> bool:
    """Take the lease when it has expired (or is ours), or, with ``renew``, extend it while it
    is still ours; whether we hold it now."""
    sql = q.LEADER_RENEW if renew else q.LEADER_ACQUIRE
    return await tx.row(sql, name=name, holder=holder, ttl=ttl) is not None


async def leader_fence(tx: Tx, *, name: str, holder: str, idle: float) -> None:
    """Hold the lease for the rest of this transaction (no successor's takeover lands before
    it ends, nor ``idle`` seconds after this process stops sending anything in it); raises
    NotLeading when it is no longer ours."""
    ms = str(max(1, round(idle * 1000)))
    if await tx.row(q.LEADER_FENCE, name=name, holder=holder, idle=ms) is None:
        raise NotLeading(f"{holder} no longer holds the {name!r} lease")


async def leader_release(tx: Tx, *, name: str, holder: str) -> None:
    await tx.rows(q.LEADER_RELEASE, name=name, holder=holder)


async def current_leader(tx: Tx, name: str) -> dict[str, Any] | None:
    row = await tx.row(q.LEADER, name=name)
    return None if row is None else _row(row)


async def ping(tx: Tx) -> None:
    await tx.value(q.PING)


@dataclass(frozen=True)
class ClusterState:
    """What the metrics show of the cluster (``orch_manager.metrics``)."""

    observers: list[Row]
    services: list[Row]
    outbox_backlog: int
    outbox_age: float | None


async def cluster_state(tx: Tx) -> ClusterState:
    observers = await tx.rows(q.METRICS_OBSERVERS)
    services = await tx.rows(q.METRICS_SERVICES)
    outbox = await tx.row(q.METRICS_OUTBOX)
    assert outbox is not None  # an aggregate: always one row
    return ClusterState(observers, services, outbox[0], outbox[1])


# --------------------------------------------------------------------- leader: the sweeper
async def sweep_expired(tx: Tx) -> list[Row]:
    """Live services whose lease expired, marked deleted: their id and name."""
    return await tx.rows(q.SWEEP_EXPIRED)


async def sessions_ended(tx: Tx) -> list[uuid.UUID]:
    """Services live by their lease whose lease session has ended."""
    return await tx.values(q.SESSION_ENDED)


async def declare_gone(tx: Tx, ids: list[uuid.UUID]) -> list[Row]:
    """These services, marked deleted (their process is gone): their id and name."""
    return await tx.rows(q.DECLARE_GONE, ids=ids) if ids else []


async def orphans(
    tx: Tx,
    grace: float = 0.0,
    patience: float = 0.0,
    progressing: Collection[uuid.UUID] = (),
) -> list[Row]:
    """Observers held by a dead service: their id and status, locked; but not those running
    that came by the work queue to a service proven gone (the broker requeued their
    deliveries) less than ``grace`` seconds ago, or less than ``patience`` seconds ago while
    its observers are still being taken (``progressing``)."""
    dead = await tx.values(q.DEAD_SERVICES)
    if not dead:
        return []
    return await tx.rows(
        q.ORPHANS, dead=dead, grace=grace, patience=patience, progressing=list(progressing)
    )


async def held_by_dead(tx: Tx) -> dict[uuid.UUID, int]:
    """How many live observers each dead service still holds (those holding any)."""
    dead = await tx.values(q.DEAD_SERVICES)
    if not dead:
        return {}
    return {r.service_id: int(r.n) for r in await tx.rows(q.HELD_BY_DEAD, dead=dead)}


async def any_orphan(tx: Tx) -> bool:
    """Whether a dead service still holds a live observer (by index, not locked)."""
    dead = await tx.values(q.DEAD_SERVICES)
    return bool(dead) and bool(await tx.value(q.ANY_ORPHAN, dead=dead))


async def complete_stops(tx: Tx, ids: list[uuid.UUID], why: str) -> None:
    """Deletes and pauses whose copy nobody runs any more: deleted, paused."""
    if not ids:
        return
    rows = await tx.rows(q.COMPLETE_STOPS, ids=ids)
    for status in {r.status for r in rows}:
        done = [r.id for r in rows if r.status == status]
        await record_events(tx, done, Event(status), why)


async def new_dispatches(
    tx: Tx,
    ids: list[uuid.UUID],
    why: str,
    targets: dict[uuid.UUID, uuid.UUID | None] | None = None,
) -> list[StartMessage]:
    """New dispatch ids for these observers (their old messages become stale), recorded, each
    directed to its service in ``targets`` (absent: to its pool's work queue); the start
    message of each that is still live."""
    if not ids:
        return []
    to = targets or {}
    rows = await tx.rows(q.REDISPATCH, ids=ids, targets=[to.get(i) for i in ids])
    # Each with the service it was sent to (none: its pool's work queue).
    await tx.rows(
        q.EVENTS_TO,
        ids=[r.id for r in rows],
        event=Event.REDISPATCHED.value,
        detail=why,
        services=[to.get(r.id) for r in rows],
    )
    return [StartMessage(observer_id=r.id, dispatch_id=r.dispatch_id) for r in rows]


@dataclass(frozen=True)
class Needs:
    """Where an observer may run: services of its pool that run its kind, in the version it is
    pinned to (``version``, None: any)."""

    pool: str
    kind: str
    version: str | None = None


async def needs_of(tx: Tx, ids: list[uuid.UUID]) -> dict[uuid.UUID, Needs]:
    """The pool, kind and pinned version of each of these observers."""
    rows = await tx.rows(q.NEEDS_OF, ids=ids) if ids else []
    return {r.id: Needs(r.pool, r.kind, r.kind_version) for r in rows}


@dataclass(frozen=True)
class Runs:
    """What a service runs: observers of its pool, of the kinds it advertised, each with its
    version (None: a service of an earlier release, which runs every kind but no observer
    pinned to a version: it cannot tell them)."""

    pool: str = DEFAULT_POOL
    kinds: dict[str, str] | None = None

    def can(self, needs: Needs) -> bool:
        if self.pool != needs.pool:
            return False
        if self.kinds is None:
            return needs.version is None
        return needs.kind in self.kinds and needs.version in (None, self.kinds[needs.kind])

    @classmethod
    def of(cls, pool: str, versions: dict[str, str] | None) -> Runs:
        """From a service's row: its pool and the kinds it runs with their versions
        (``queries.versions_of``)."""
        return cls(pool, None if versions is None else dict(versions))


async def kinds_run(tx: Tx, ids: list[uuid.UUID]) -> dict[uuid.UUID, Runs]:
    """The pool of each of these services and the kinds it advertised."""
    rows = await tx.rows(q.KINDS_RUN, ids=ids) if ids else []
    return {r.id: Runs.of(r.pool, r.kinds) for r in rows}


async def holder_kinds(tx: Tx) -> dict[uuid.UUID, dict[str, str] | None]:
    """The kinds each service runs (while its row is kept), with their versions (None: a
    service of a release before adverts)."""
    return {r.id: r.kinds for r in await tx.rows(q.HOLDER_KINDS)}


@dataclass(frozen=True)
class Advert:
    """What one pool's services advertised of one version of one kind: the newest advert, a live
    one first, as the JSON text ``service`` wrote (read by
    ``orch_contracts.adverts.read_advert``)."""

    pool: str
    kind: str
    service: str
    text: str
    live: bool
    created_at: datetime


async def adverts(tx: Tx) -> list[Advert]:
    """Of each kind each pool's services ever advertised (while their rows are kept), the
    advert of the newest service that runs it (a live one first)."""
    return [
        Advert(r.pool, r.name, r.service, r.advert, r.live, r.created_at)
        for r in await tx.rows(q.ADVERTS)
    ]


async def pools(tx: Tx) -> dict[str, bool]:
    """Every pool a service joined (while its row is kept): whether one of its services runs
    every kind (an earlier release)."""
    return {r.pool: bool(r.every) for r in await tx.rows(q.POOLS)}


@dataclass(frozen=True)
class LiveAdvert:
    """One kind a live service advertised (``kind`` None: it advertised none, or, ``every``, it
    is of a release before adverts and runs every kind), its advert as the JSON text it wrote."""

    service: str
    pool: str
    every: bool
    kind: str | None
    text: str | None


async def live_adverts(tx: Tx) -> list[LiveAdvert]:
    """What each live service advertised of its kinds, one row a kind, by service name."""
    return [
        LiveAdvert(r.name, r.pool, bool(r.every), r.kind, r.advert)
        for r in await tx.rows(q.LIVE_ADVERTS)
    ]


@dataclass(frozen=True)
class PoolLoad:
    services: int
    slots: int
    running: int


async def held_by_the_gone(tx: Tx) -> int:
    """Live observers whose service lost its lease (not yet sent to another)."""
    return int(await tx.value(q.HELD_BY_THE_GONE))


async def fold_counts(tx: Tx) -> int:
    """Fold the rows of ``observer_counts`` into one per key; how many rows that dropped."""
    return int(await tx.value(q.FOLD_COUNTS))


async def vacuum_counts(tx: Tx) -> None:
    """Out of a transaction (``ManagerStore.autocommit``)."""
    await tx.execute(q.VACUUM_COUNTS)


async def status_totals(tx: Tx) -> dict[str, int]:
    """Every observer by status."""
    return {r.status: int(r.n) for r in await tx.rows(q.STATUS_TOTALS)}


async def pool_loads(tx: Tx) -> tuple[dict[str, PoolLoad], dict[str, int]]:
    """Each pool's live services, slots and what they run; and its live observers nobody
    holds."""
    loads = {
        r.pool: PoolLoad(int(r.services), int(r.slots), int(r.running))
        for r in await tx.rows(q.POOL_LOADS)
    }
    return loads, {r.pool: int(r.n) for r in await tx.rows(q.UNHELD_BY_POOL)}


async def any_waiting(tx: Tx) -> bool:
    """Whether some live observer nobody holds waits for a service able to run it."""
    return bool(await tx.value(q.ANY_WAITING))


async def waiting(tx: Tx, runs: Collection[Runs]) -> list[uuid.UUID]:
    """Live observers nobody holds that wait for a service able to run them, of the pools and
    kinds some of ``runs`` (what services with room run) run; locked."""
    able = sorted(
        {(r.pool, None, None) for r in runs if r.kinds is None}
        | {(r.pool, k, v) for r in runs if r.kinds is not None for k, v in r.kinds.items()},
        key=lambda p: (p[0], p[1] or "", p[2] or ""),
    )
    if not able:
        return []
    return await tx.values(
        q.WAITING,
        pools=[p for p, _, _ in able],
        kinds=[k for _, k, _ in able],
        versions=[v for _, _, v in able],
    )


async def unexplained(tx: Tx) -> dict[uuid.UUID, str]:
    """Why each waiting observer waits, where its row does not say so yet; locked."""
    return {r.id: r.why for r in await tx.rows(q.UNEXPLAINED)}


async def set_waiting(tx: Tx, why: dict[uuid.UUID, str]) -> None:
    """Why each of these observers still waits."""
    if why:
        await tx.rows(q.SET_WAITING, ids=list(why), whys=list(why.values()))


#: A service back from a lost lease gets no directed start for this many margins (two lease
#: lengths with the default margin of half a lease): it must show that it keeps its lease first.
PROBATION_MARGINS = 4


async def free_slots(tx: Tx, margin: float, *, probation: bool = False) -> dict[uuid.UUID, int]:
    """Free slots of the services whose lease outlives ``margin`` seconds, that take work and
    that keep their lease (not stalled, not back from a lost lease lately). ``probation``:
    those back from a lost lease lately instead (a re-dispatch's last resort)."""
    rows = await tx.rows(q.FREE_SLOTS, m=margin, p=PROBATION_MARGINS * margin, probation=probation)
    return {r.id: int(r.free) for r in rows if r.free > 0}


# ----------------------------------------------------------------------- leader: the audit
async def idle_pools(tx: Tx, grace: float) -> list[str]:
    """The pools of live services, and the default pool, where nothing was taken in the last
    ``grace`` seconds."""
    return await tx.values(q.IDLE_POOLS, g=grace)


async def unheld_stuck(
    tx: Tx, grace: float, pools: list[str], directed: float
) -> dict[uuid.UUID, str]:
    """Live observers of ``pools`` nobody holds, dispatched more than ``grace`` seconds ago, and
    not directed to a live service in the last ``directed`` seconds: their pools."""
    rows = await tx.rows(q.UNHELD_STUCK, g=grace, pools=pools, directed=directed)
    return {r.id: r.pool for r in rows}


async def statuses(tx: Tx, ids: list[uuid.UUID]) -> dict[uuid.UUID, ObserverStatus]:
    """The status of each of ``ids`` that has a row."""
    rows = await tx.rows(q.STATUSES, ids=ids) if ids else []
    return {r.id: ObserverStatus(r.status) for r in rows}


async def params_of(tx: Tx, ids: list[uuid.UUID]) -> dict[uuid.UUID, Any]:
    """The params of each of ``ids`` that has a row."""
    rows = await tx.rows(q.PARAMS_OF, ids=ids) if ids else []
    return {r.id: r.params for r in rows}


async def unsent(tx: Tx, ids: list[uuid.UUID]) -> set[uuid.UUID]:
    """Of ``ids``, those whose start is still in the outbox (not published yet)."""
    return set(await tx.values(q.UNSENT, ids=[str(i) for i in ids])) if ids else set()


# ------------------------------------------------------------------- leader: the rebalance
async def where_moved(tx: Tx, ids: list[uuid.UUID]) -> list[Row]:
    """Where these observers are: id, service_id, in_motion."""
    return await tx.rows(q.WHERE_MOVED, ids=ids)


async def loads(tx: Tx, min_age: float) -> list[Row]:
    """Services taking work, at least ``min_age`` seconds old and as long back from a lost
    lease, not stalled: id, pool, worker_count, running."""
    return await tx.rows(q.LOADS, age=min_age)


async def pick_to_move(
    tx: Tx,
    donor: uuid.UUID,
    *,
    recent: list[uuid.UUID],
    n: int,
    runs: Runs,
    settled: float = 0.0,
) -> list[uuid.UUID]:
    """Up to ``n`` observers running on ``donor``, none of ``recent`` and none started within
    ``settled`` seconds, each one the move's target ``runs`` (its pool, its kinds)."""
    kinds = None if runs.kinds is None else sorted(runs.kinds)
    versions = None if runs.kinds is None else [runs.kinds[k] for k in sorted(runs.kinds)]
    return await tx.values(
        q.PICK_TO_MOVE,
        s=donor,
        recent=recent,
        settled=settled,
        n=n,
        kinds=kinds,
        versions=versions,
        pool=runs.pool,
    )


#: A move the leader asks for: (observer, from service, to service).
Handoff = tuple[uuid.UUID, uuid.UUID, uuid.UUID]


async def request_handoffs(
    tx: Tx,
    handoffs: list[Handoff],
    why: str = "",
    *,
    event: Event = Event.HANDOFF_REQUESTED,
    detail: str | None = None,
) -> tuple[list[Handoff], list[Pending]]:
    """Ask each holder to hand its observer to the target: the move recorded on the row
    (``observers.handoff_to``, what the holder checks before it hands over), its handoff
    message, and a history ``event`` (``why`` before its detail, or ``detail`` instead). Only
    observers still running on their donor are asked for: those handoffs, and their outbox
    records."""
    if not handoffs:
        return [], []
    marked = set(
        await tx.values(
            q.RECORD_HANDOFFS,
            ids=[o for o, _, _ in handoffs],
            froms=[d for _, d, _ in handoffs],
            tos=[t for _, _, t in handoffs],
        )
    )
    handoffs = [h for h in handoffs if h[0] in marked]
    pending = await add_outbox(
        tx,
        [(Destination.service(d), HandoffMessage(observer_id=o, to=t)) for o, d, t in handoffs],
    )
    await record_events(
        tx,
        [o for o, _, _ in handoffs],
        event,
        [f"{why}from {d} to {t}" if detail is None else detail for _, d, t in handoffs],
    )
    return handoffs, pending


async def clear_handoffs(tx: Tx, ids: list[uuid.UUID]) -> None:
    """Forget the recorded moves of these observers (their handoffs did not land in time)."""
    await tx.rows(q.CLEAR_HANDOFFS, ids=ids)


# ------------------------------------------------------------------------------------ moves
@dataclass(frozen=True)
class MoveTo:
    """Where a move sends observers: a pool (None: their own) and a version of their kind to
    pin them to (None: as they are; ``unpin``: none)."""

    pool: str | None = None
    version: str | None = None
    unpin: bool = False

    def __str__(self) -> str:
        parts = [f"pool {self.pool!r}"] if self.pool else []
        if self.unpin:
            parts.append("any version")
        elif self.version:
            parts.append(f"version {self.version!r}")
        return "to " + ", ".join(parts)


async def move_targets(tx: Tx, ids: list[uuid.UUID], to: MoveTo) -> list[Needs]:
    """What the move would ask of the services of each target pool: each kind (and version)."""
    rows = await tx.rows(q.MOVE_TARGETS, ids=ids, pool=to.pool, version=to.version, unpin=to.unpin)
    return [Needs(r.pool, r.kind, r.version) for r in rows]


async def move_observers(
    tx: Tx, ids: list[uuid.UUID], to: MoveTo
) -> tuple[list[Row], list[Pending]]:
    """Move these observers (those not deleted, and not already there): their row says where
    they run now, their history says so, and those nobody holds are dispatched anew, to their
    new pool's queue. Those running are left to the leader's mover, which hands each over to
    a service that can run it there (``manager/moves.py``), at its pace; paused and failed
    ones start there when resumed or restarted."""
    rows = await tx.rows(q.MOVE, ids=ids, pool=to.pool, version=to.version, unpin=to.unpin)
    await record_events(tx, [r.id for r in rows], Event.MOVE_REQUESTED, str(to))
    pool = {r.id: r.pool for r in rows}
    unheld = [
        r.id
        for r in rows
        if r.service_id is None and r.status in (ObserverStatus.CREATED, ObserverStatus.PROCESSING)
    ]
    starts = await new_dispatches(tx, unheld, "moved")
    pending = await add_outbox(tx, [(Destination.work(pool[s.observer_id]), s) for s in starts])
    return rows, pending


async def moving(tx: Tx, limit: int) -> list[Row]:
    """Observers asked to move that the mover has not seen where they may run yet."""
    if await tx.value(q.FIRST_MOVING) is None:
        return []
    return await tx.rows(q.MOVING, n=limit)


async def moved(tx: Tx, ids: list[uuid.UUID]) -> None:
    """These need the mover no more (they run where they may, or nothing runs them)."""
    if ids:
        await tx.rows(q.MOVED, ids=ids)


# ---------------------------------------------------------------------- leader: retention
@dataclass(frozen=True)
class Pruned:
    observers: int
    services: int
    trimmed: int
    #: The newest history row when it ran.
    newest_event: int


async def prune(
    tx: Tx,
    *,
    keep: float,
    keep_services: float,
    max_events: int,
    batch: int,
    seen_events: int | None,
    first_look: int,
) -> Pruned:
    """Deleted observers older than ``keep`` seconds, dead services older than
    ``keep_services``, and history beyond ``max_events`` per observer among those written
    since history row ``seen_events`` (None: among the newest ``first_look``); at most
    ``batch`` of each."""
    observers = await tx.rows(q.PRUNE_OBSERVERS, keep=keep, n=batch)
    services = await tx.rows(q.PRUNE_SERVICES, keep=keep_services, n=batch)
    newest: int = await tx.value(q.NEWEST_EVENT)
    if seen_events is None:
        seen_events = max(0, newest - first_look)
    heavy = (
        await tx.rows(q.HEAVY_HISTORIES, after=seen_events, newest=newest, cap=max_events)
        if newest > seen_events  # an idle cluster writes no history
        else []
    )
    for row in heavy:
        await tx.rows(q.TRIM_HISTORY, o=row.observer_id, cap=max_events)
    return Pruned(len(observers), len(services), len(heavy), newest)


# -------------------------------------------------------------------------- console views
async def view_observers(
    tx: Tx, *, order: str, filters: dict[str, Any], **page: Any
) -> tuple[list[Row], dict[str, int]]:
    """A page of the console's table (sorted by ``order``, an SQL ORDER BY list), and how many
    observers match ``filters`` in each status."""
    rows = await tx.rows(q.VIEW_OBSERVERS.replace("{order}", order), **filters, **page)
    if any(v is not None for v in filters.values()):
        totals = {r.status: int(r.n) for r in await tx.rows(q.VIEW_TOTALS, **filters)}
    else:
        totals = await status_totals(tx)  # from the counts, not from every observer
    return rows, totals


async def activity(
    tx: Tx, *, minutes: int, service_id: uuid.UUID | None
) -> tuple[datetime, list[Row]]:
    """Events per minute of the last ``minutes`` (from the history): the first minute, and
    its rows (minute, event, n)."""
    since: datetime = await tx.value(q.ACTIVITY_SINCE, m=minutes)
    return since, await tx.rows(q.ACTIVITY, since=since, sid=service_id)
