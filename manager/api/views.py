"""What the console reads and does beyond the plain API: who is signed in, a sorted and counted
page of observers (server-side, fast with tens of thousands), one service, activity per minute
from the history, and bulk restart and delete of failed observers.

No route here returns an observer's params (the plain API decides what a token may see of
them); a last error is masked for a read token as ``GET /observers/{id}`` masks it (with the
values of its secret params: the rows with an error bring their params for that alone). Read
routes tell their own time in a ``Server-Timing`` header (``app;dur=…`` ms).
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from orch_contracts.errors import BrokerUnavailable, NotFound, OrchError
from orch_contracts.kinds import KindSpec, RestartPolicy
from orch_contracts.masking import mask
from orch_contracts.statuses import Event, ObserverStatus
from orch_manager import queries as q
from orch_manager import repository as repo
from orch_manager.api.deps import RuntimeDep
from orch_manager.api.observers import (
    KindFilter,
    ParamFilter,
    PoolFilter,
    SeesSecrets,
    StatusFilter,
    param_filter,
    shown,
)
from orch_manager.auth import ADMIN, READ, Authenticator, Credentials, Role, Unauthenticated
from orch_manager.outbox import Pending
from orch_manager.problems import Problem, problem_for, responses, status_of
from orch_manager.schemas import SafeText, ServiceOut

router = APIRouter(tags=["console"])
AUTH = (401, 403)
#: Observers one bulk action takes at most.
MAX_BULK = 1000
_HEXISH = re.compile(r"^[0-9a-fA-F-]{4,36}$")


# ------------------------------------------------------------------------------------ bodies
class WhoAmI(BaseModel):
    name: str = Field(description="the token's name (never the token)")
    role: Role
    auth: bool = Field(description="false when the manager runs without tokens")


class ObserverRow(BaseModel):
    """An observer as the console lists it: no params, its restart budget and backoff."""

    id: uuid.UUID
    name: str
    kind: str
    status: ObserverStatus
    service_id: uuid.UUID | None
    service_name: str | None
    epoch: int
    restart_count: int = Field(description="restarts within the current window")
    max_restarts: int = Field(description="the restart budget of its policy")
    restarted_at: datetime | None
    in_backoff: bool = Field(description="its code raised and it waits to be restarted")
    next_restart_in: float | None = Field(
        description="seconds until the restart at the earliest (a jitter may add to it)"
    )
    last_error: str | None = Field(description="the first 500 characters")
    checkpointed_at: datetime | None
    created_at: datetime
    modified_at: datetime
    started_at: datetime | None
    output_seq: int = Field(
        default=0, description="the last seq committed of what it emitted (0: nothing yet)"
    )
    committed_at: datetime | None = Field(
        default=None, description="when its current copy last committed (progress)"
    )
    waiting: str | None = Field(
        default=None, description="why nobody runs it while it waits for a service able to"
    )
    pool: str = Field(default="default", description="the pool it runs in")
    kind_version: str | None = Field(
        default=None, description="the version of its kind it is pinned to (null: any)"
    )


class ObserverView(BaseModel):
    items: list[ObserverRow]
    total: int = Field(description="observers matching the filters")
    totals: dict[str, int] = Field(description="by status, under every filter but status")
    limit: int
    offset: int
    next_offset: int | None
    sort: str
    order: Literal["asc", "desc"]
    now: datetime | None = Field(default=None, description="the database's clock")


class ClusterTotals(BaseModel):
    """The whole cluster at a glance, whatever a list is filtered on."""

    services: int = Field(description="live services")
    slots: int = Field(description="capacity: the worker_count of the live services taking work")
    running: int = Field(description="used: the observers live services hold")
    free: int = Field(description="slots nobody holds (slots - running, at least 0)")
    waiting: int = Field(
        description="live observers no live service holds: queued for a free slot, waiting "
        "for a service able to run them, or moving from a service that is gone"
    )
    by_status: dict[str, int] = Field(description="every observer by status, deleted included")


class BrokerView(BaseModel):
    """The broker as this manager sees it now."""

    connected: bool = Field(description="the manager's publishing connection is open")
    blocked: bool = Field(
        description="the broker blocks the manager's publishes (a memory or disk alarm): new "
        "starts wait in the outbox, and failover goes through the database"
    )
    ready: int | None = Field(
        description="starts ready in the default pool's work queue, not yet delivered (null: "
        "the broker did not answer)"
    )
    consumers: int | None = Field(
        description="consumers of that queue: one per service taking work (null: not known)"
    )


class ActivityBucket(BaseModel):
    at: datetime = Field(description="the minute's start")
    taken: int
    restarted: int
    failed: int


class Activity(BaseModel):
    since: datetime
    minutes: int
    buckets: list[ActivityBucket] = Field(description="one per minute, oldest first")


class BulkIds(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ids: list[uuid.UUID] = Field(min_length=1, max_length=MAX_BULK)


class BulkItem(BaseModel):
    id: uuid.UUID
    status: int = Field(description="the status the one-observer route would have answered")
    observer_status: ObserverStatus | None = None
    problem: Problem | None = None


class BulkOut(BaseModel):
    done: int
    failed: int
    items: list[BulkItem] = Field(description="one per distinct id, in order")


# ------------------------------------------------------------------------------------ helpers
def _timed(response: Response, started: float) -> None:
    response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"


def _policy(kinds: dict[str, KindSpec], kind: str, override: Any) -> RestartPolicy:
    spec = kinds.get(kind)
    if spec is None:
        return RestartPolicy.model_validate(override) if override else RestartPolicy()
    try:
        return spec.policy(override)
    except ValueError:
        return spec.restart_policy


def backoff(row: dict[str, Any], policy: RestartPolicy, now: datetime) -> tuple[bool, float | None]:
    """Whether an observer waits to be restarted, and for how long at the earliest. The service
    waits ``policy.delay(n)`` after its n-th restart was recorded: the exponential part, plus a
    jitter of up to ``base_delay``."""
    n = int(row["restart_count"])
    at = row["restarted_at"]
    if n < 1 or at is None or row["status"] != ObserverStatus.PROCESSING:
        return False, None
    if at < now - timedelta(seconds=policy.reset_after):
        return False, None
    start = at + timedelta(seconds=policy.nominal_delay(n))
    if now >= start + timedelta(seconds=policy.base_delay):
        return False, None  # restarted by now
    return True, max(0.0, (start - now).total_seconds())


def _order(sort: str, direction: str) -> str:
    """The list's ORDER BY: the column asked for, then the id; a missing value last."""
    nulls = " NULLS LAST" if sort in q.VIEW_NULLABLE else ""
    return f"{q.VIEW_SORTS[sort]} {direction}{nulls}, o.id {direction}"


def _lookup(text_: str | None) -> dict[str, Any]:
    """The lookup box: a whole id, or part of a name (or the start of an id)."""
    if not text_:
        return {"id": None, "q": None, "idp": None}
    text_ = text_.strip()
    try:
        return {"id": uuid.UUID(text_), "q": None, "idp": None}
    except ValueError:
        pass
    like = text_.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    idp = text_.lower() + "%" if _HEXISH.match(text_) else None
    return {"id": None, "q": like, "idp": idp}


# ------------------------------------------------------------------------------------ routes
@router.get(
    "/whoami",
    response_model=WhoAmI,
    operation_id="whoAmI",
    responses=responses(401),
)
async def whoami(request: Request, credentials: Credentials) -> dict[str, Any]:
    """The token this request carries: its name and role (what the console may show)."""
    auth: Authenticator = request.app.state.auth
    if not auth.enabled:
        request.state.who = "anonymous"
        return {"name": "anonymous", "role": Role.ADMIN, "auth": False}
    token = auth.identify(credentials.credentials if credentials else None)
    if token is None:
        raise Unauthenticated("a valid API token is needed (Authorization: Bearer …)")
    request.state.who = token.name
    return {"name": token.name, "role": token.role, "auth": True}


Sort = Literal[
    "name", "kind", "pool", "status", "service", "epoch", "restarts", "checkpoint", "created"
]


@router.get(
    "/views/observers",
    response_model=ObserverView,
    operation_id="viewObservers",
    dependencies=[READ],
    responses=responses(*AUTH, 422, 503),
)
async def view_observers(
    state: RuntimeDep,
    response: Response,
    raw: SeesSecrets,
    status_: StatusFilter = None,
    kind: KindFilter = None,
    pool: PoolFilter = None,
    param: ParamFilter = None,
    service_id: uuid.UUID | None = None,
    q_: Annotated[
        SafeText | None,
        Query(
            alias="q",
            min_length=1,
            max_length=200,
            description="an id, the start of one, or any part of a name",
        ),
    ] = None,
    include_deleted: bool = False,
    sort: Sort = "created",
    order: Literal["asc", "desc"] = "asc",
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
) -> dict[str, Any]:
    """A page of observers, sorted on the server, with the number that match and the totals by
    status. Deleted observers are left out unless asked for (or filtered on)."""
    started = time.perf_counter()
    direction = "DESC" if order == "desc" else "ASC"
    contains = param_filter(param, raw)
    async with state.store.autocommit() as tx:
        rows, totals = await repo.view_observers(
            tx,
            order=_order(sort, direction),
            filters={
                "kind": kind,
                "pool": pool,
                "params": contains,
                "sid": service_id,
                **_lookup(q_),
            },
            status=status_.value if status_ else None,
            deleted=include_deleted,
            limit=limit,
            offset=offset,
        )
    if status_ is not None:
        total = totals.get(status_.value, 0)
    else:
        total = sum(totals.values()) - (0 if include_deleted else totals.get("deleted", 0))
    items = []
    now = None
    kinds = state.all_kinds()
    if not raw:
        await state.know_holders([dict(r) for r in rows])
    for r in rows:
        row = dict(r)
        now = row.pop("now")
        policy = _policy(kinds, row["kind"], row.pop("restart_policy"))
        waiting, left = backoff(row, policy, now)
        row = shown(state, row, raw)  # as GET /observers/{id} shows it to a read token
        del row["params"]  # loaded only to mask the error: never shown here
        error = row["last_error"]
        row["last_error"] = error[:500] if error else error
        items.append(
            {
                **row,
                "max_restarts": policy.max_restarts,
                "in_backoff": waiting,
                "next_restart_in": left,
            }
        )
    _timed(response, started)
    return {
        "items": items,
        "total": total,
        "totals": totals,
        "limit": limit,
        "offset": offset,
        "next_offset": offset + limit if offset + len(items) < total else None,
        "sort": sort,
        "order": order,
        "now": now,
    }


@router.get(
    "/views/services/{service_id}",
    response_model=ServiceOut,
    operation_id="viewService",
    dependencies=[READ],
    responses=responses(*AUTH, 404, 422, 503),
)
async def view_service(
    service_id: uuid.UUID, state: RuntimeDep, response: Response
) -> dict[str, Any]:
    """One service, live or not (``GET /services`` lists the live ones)."""
    started = time.perf_counter()
    async with state.store.autocommit() as tx:
        row = await repo.get_service(tx, service_id)
    if row is None:
        raise NotFound(f"no service with id {service_id}")
    _timed(response, started)
    return row


@router.get(
    "/views/totals",
    response_model=ClusterTotals,
    operation_id="viewTotals",
    dependencies=[READ],
    responses=responses(*AUTH, 503),
)
async def view_totals(state: RuntimeDep, response: Response) -> dict[str, Any]:
    """Capacity, used and waiting across every pool, and the observers by status."""
    started = time.perf_counter()
    async with state.store.autocommit() as tx:
        loads, unheld = await repo.pool_loads(tx)
        waiting = sum(unheld.values()) + await repo.held_by_the_gone(tx)
        by_status = await repo.status_totals(tx)
    slots = sum(p.slots for p in loads.values())
    running = sum(p.running for p in loads.values())
    _timed(response, started)
    return {
        "services": sum(p.services for p in loads.values()),
        "slots": slots,
        "running": running,
        "free": max(0, slots - running),
        "waiting": waiting,
        "by_status": by_status,
    }


@router.get(
    "/views/broker",
    response_model=BrokerView,
    operation_id="viewBroker",
    dependencies=[READ],
    responses=responses(*AUTH),
)
async def view_broker(state: RuntimeDep) -> dict[str, Any]:
    """The broker as this manager sees it: connected, blocking its publishes (an alarm), and
    the default pool's work queue (starts ready, consumers). A broker that does not answer is
    shown so, never an error."""
    publisher = state.publisher
    ready: int | None = None
    consumers: int | None = None
    with contextlib.suppress(BrokerUnavailable):
        ready, consumers = await publisher.work_queue_counts()
    return {
        "connected": publisher.connected,
        "blocked": publisher.blocked,
        "ready": ready,
        "consumers": consumers,
    }


class ActionOut(BaseModel):
    at: datetime
    event: str
    actor: str = Field(description="the name of the API token whose request did it")
    observer_id: uuid.UUID
    observer_name: SafeText
    kind: SafeText
    detail: str | None


@router.get(
    "/views/actions",
    response_model=list[ActionOut],
    operation_id="viewActions",
    dependencies=[READ],
    responses=responses(*AUTH, 422),
)
async def view_actions(
    state: RuntimeDep,
    by: Annotated[
        str | None, Query(max_length=200, description="only this token's actions (its name)")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict[str, Any]]:
    """Who did what: the newest creates, pauses, resumes, restarts, moves and deletes asked
    through the API, each with the name of the token that asked (never its secret), newest
    first; only one token's with ``by``."""
    async with state.store.autocommit() as tx:
        rows = await repo.actions(tx, by, limit)
    return [{**r, "detail": mask(r["detail"]) if r["detail"] else None} for r in rows]


@router.get(
    "/views/activity",
    response_model=Activity,
    operation_id="viewActivity",
    dependencies=[READ],
    responses=responses(*AUTH, 422, 503),
)
async def view_activity(
    state: RuntimeDep,
    response: Response,
    minutes: Annotated[int, Query(ge=1, le=24 * 60)] = 30,
    service_id: uuid.UUID | None = None,
) -> dict[str, Any]:
    """Takes, restarts and failures per minute (from the history), oldest minute first; on one
    service with ``service_id``."""
    started = time.perf_counter()
    async with state.store.autocommit() as tx:
        since, rows = await repo.activity(tx, minutes=minutes, service_id=service_id)
    counts: dict[tuple[datetime, str], int] = {(r.minute, r.event): int(r.n) for r in rows}
    buckets = []
    for i in range(minutes):
        at = since + timedelta(minutes=i)
        buckets.append(
            {
                "at": at,
                "taken": counts.get((at, Event.TAKEN.value), 0),
                "restarted": counts.get((at, Event.RESTARTED.value), 0),
                "failed": counts.get((at, Event.FAILED.value), 0),
            }
        )
    _timed(response, started)
    return {"since": since, "minutes": minutes, "buckets": buckets}


async def _bulk(
    state: RuntimeDep, change: repo.Change, ids: list[uuid.UUID], ok: int
) -> dict[str, Any]:
    """One change for each observer, in one transaction, each under a savepoint of its own: one
    that cannot be changed (gone, or not in the state it needs) fails alone, with the problem
    the one-observer route would have given. Then every broker message in one publish."""
    items: list[dict[str, Any]] = []
    pending: list[Pending] = []
    async with state.store.transaction() as tx:
        for oid in dict.fromkeys(ids):  # each once, in order
            try:
                async with tx.savepoint():
                    row, more = await change(tx, oid)
            except OrchError as exc:
                code = status_of(exc)
                if code == 503:
                    raise
                items.append({"id": oid, "status": code, "problem": problem_for(exc)})
                continue
            pending.extend(more)
            items.append({"id": oid, "status": ok, "observer_status": row["status"]})
    state.outbox.publish_soon(pending)
    done = sum(1 for i in items if "problem" not in i)
    return {"done": done, "failed": len(items) - done, "items": items}


@router.post(
    "/views/observers/restart",
    response_model=BulkOut,
    operation_id="restartObservers",
    dependencies=[ADMIN],
    responses=responses(*AUTH, 422, 503),
)
async def restart_observers(body: BulkIds, state: RuntimeDep) -> dict[str, Any]:
    """Revive failed observers (up to 1,000): each as `POST /observers/{id}/restart` would, in
    one transaction; one that is not failed fails alone (409)."""
    return await _bulk(state, repo.restart_observer, body.ids, 200)


@router.post(
    "/views/observers/delete",
    response_model=BulkOut,
    operation_id="deleteObservers",
    dependencies=[ADMIN],
    responses=responses(*AUTH, 422, 503),
)
async def delete_observers(body: BulkIds, state: RuntimeDep) -> dict[str, Any]:
    """Delete observers (up to 1,000): each as `DELETE /observers/{id}` would, in one
    transaction; one that does not exist fails alone (404)."""
    return await _bulk(state, repo.delete_observer, body.ids, 202)
