"""/observers: create, list, read, history, edit, delete, restart, pause, resume."""

from __future__ import annotations

import contextlib
import json
import math
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from pydantic import ValidationError

from orch_contracts import tracing
from orch_contracts.errors import (
    Conflict,
    InvalidInput,
    NameTaken,
    NotFound,
    OrchError,
    TooLarge,
    Transient,
    split_error,
)
from orch_contracts.kinds import mask_as, mask_text_in, secret_values
from orch_contracts.masking import mask
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.statuses import ObserverStatus
from orch_manager import repository as repo
from orch_manager.api.deps import RuntimeDep
from orch_manager.auth import ADMIN, READ, Authenticator, Credentials, Forbidden, Role
from orch_manager.outbox import Pending
from orch_manager.problems import field_errors, problem_for, problem_of, responses, status_of
from orch_manager.runtime import ManagerRuntime
from orch_manager.schemas import (
    Action,
    KindName,
    ObserverAction,
    ObserverActionOut,
    ObserverBatch,
    ObserverBatchOut,
    ObserverCreate,
    ObserverEdit,
    ObserverEventOut,
    ObserverMove,
    ObserverMoveOut,
    ObserverOut,
    ObserverPage,
    ObserverSelector,
    PoolName,
    SafeText,
    clean_params,
)
from orch_manager.store import Tx

router = APIRouter(prefix="/observers", tags=["observers"])
AUTH = (401, 403)
ONE = (*AUTH, 404, 422, 503)


async def sees_secrets(request: Request, credentials: Credentials) -> bool:
    """Whether the caller may see params as they are: an admin token (or no auth at all, where
    anyone may change anything). A ``read`` token sees secrets masked (``mask_params``)."""
    auth: Authenticator = request.app.state.auth
    if not auth.enabled:
        return True
    token = auth.identify(credentials.credentials if credentials else None)
    return token is not None and token.role is Role.ADMIN


SeesSecrets = Annotated[bool, Depends(sees_secrets)]
#: The list filters ``GET /observers`` and the console's view share.
StatusFilter = Annotated[ObserverStatus | None, Query(alias="status")]
ParamFilter = Annotated[
    str | None,
    Query(
        alias="param",
        min_length=2,
        max_length=1000,
        description="only observers whose params hold this value at this path: `PATH=VALUE`, "
        "the path's keys joined by dots (`symbol=BTC`, `feed.interval=5`); the value as JSON "
        "if it reads as JSON, else as text. Needs an admin token: a read token's search would "
        "tell a secret param's value one guess at a time.",
    ),
]
#: Keys a param path holds at most.
PARAM_DEPTH = 8


def param_filter(given: str | None, raw: bool) -> str | None:
    """``PATH=VALUE`` as the JSON object that ``params @>`` takes (None: no filter). Raises
    Forbidden for a caller who sees params masked, InvalidInput for a malformed one."""
    if given is None:
        return None
    if not raw:
        raise Forbidden(
            "searching by params needs an admin token: a read token sees secret params masked, "
            "and a search would tell their values one guess at a time"
        )
    path, eq, text_ = given.partition("=")
    keys = path.split(".")
    if not eq or not all(keys) or len(keys) > PARAM_DEPTH:
        raise InvalidInput(
            f"param: expected PATH=VALUE with a path of 1 to {PARAM_DEPTH} keys joined by dots "
            "(symbol=BTC, feed.interval=5)"
        )
    value: Any = text_
    with contextlib.suppress(ValueError):  # not JSON (or NaN, which JSON has not): the text
        value = json.loads(text_, parse_constant=_no_constant)
    for key in reversed(keys):
        value = {key: value}
    try:  # what no params hold, and PostgreSQL's JSON refuses: NUL, 1e999 (a 500 before)
        clean_params(value)
    except ValueError as exc:
        raise InvalidInput(f"param: {exc}") from None
    return json.dumps(value)


def _no_constant(name: str) -> Any:
    raise ValueError(name)


KindFilter = Annotated[KindName | None, Query()]
PoolFilter = Annotated[PoolName | None, Query(description="only observers of this pool")]


def shown(state: ManagerRuntime, row: dict[str, Any], raw: bool) -> dict[str, Any]:
    """An observer as the caller may see it: for a ``read`` token its secret params are
    ``***`` (those of its own kind and version, ``ManagerRuntime.secrets_of``; every value
    where nothing tells), and so are, in its last error, its traceback and its checkpoint,
    their values and the passwords and secret query values of URLs. The service masked the
    error so when it wrote it; masking it again here covers an error written before (or by an
    older service). A console view row carries its params only when it has an error
    (``queries.VIEW_OBSERVERS``), for this alone."""
    if row.get("last_error"):
        row = dict(row)
        row["last_error"], row["traceback"] = split_error(row["last_error"])
    if raw:
        return row
    masked = dict(row)
    params = (row["params"] or {}) if "params" in row else None
    if params is not None:
        masked["params"] = mask_as(params, state.secrets_of(row))
    if row.get("last_error") or row.get("checkpoint") is not None:
        # The secret values are looked for only where something could quote them.
        values = secret_values(params, None, masked["params"]) if params else []
        if row.get("last_error"):
            masked["last_error"] = mask(row["last_error"], secrets=values, keep_user=False)
            if row["traceback"]:
                masked["traceback"] = mask(row["traceback"], secrets=values, keep_user=False)
        if row.get("checkpoint") is not None:
            masked["checkpoint"] = mask_text_in(row["checkpoint"], values)
    return masked


async def _new(state: ManagerRuntime, body: ObserverCreate) -> repo.NewObserver:
    """What to insert, once the kind took the params (raises InvalidInput, TooLarge)."""
    spec = await state.kind(body.kind, body.pool, body.version)
    params = spec.validate_params(body.params)
    limit = state.settings.max_params_bytes
    if len(json.dumps(params)) > limit:
        raise TooLarge(f"params are larger than {limit} bytes")
    policy = body.restart_policy.model_dump() if body.restart_policy else None
    return repo.NewObserver(
        body.name, body.kind, params, policy, body.pool, body.version, tracing.carrier()
    )


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=ObserverOut,
    operation_id="createObserver",
    dependencies=[ADMIN],
    responses=responses(*AUTH, 409, 413, 422, 503),
)
async def create_observer(body: ObserverCreate, state: RuntimeDep) -> dict[str, Any]:
    """Start an observer. It is `created` at once and `processing` when a service takes it."""
    # Written with the creates that arrive meanwhile: one statement, one publish (intake.py).
    row = await state.creates.create(await _new(state, body))
    state.journal.made([row])
    return row


@router.post(
    "/batch",
    response_model=ObserverBatchOut,
    operation_id="createObservers",
    dependencies=[ADMIN],
    responses=responses(*AUTH, 413, 422, 503),
)
async def create_observers(body: ObserverBatch, state: RuntimeDep) -> dict[str, Any]:
    """Start up to 1,000 observers in one transaction and one confirmed publish. An item that
    is not valid, or whose name is taken (here or earlier in the batch), fails alone: its
    `problem` says why, in the shape of every error of this API."""
    items: list[dict[str, Any]] = []
    todo: list[tuple[int, repo.NewObserver]] = []
    names: dict[str, str] = {}  # key: the first name with it
    for i, raw in enumerate(body.observers):
        try:
            new = await _new(state, ObserverCreate.model_validate(raw))
            if (first := names.get(new.key)) is not None:
                raise NameTaken(first, alike=first != new.name)
            names[new.key] = new.name
            todo.append((i, new))
        except ValidationError as exc:
            errors = field_errors(exc.errors(), under=("body", "observers", i))
            items.append(_failed(i, 422, "the observer is not valid", errors))
        except OrchError as exc:
            items.append(_refused(i, exc))
    pending: list[Pending] = []
    if todo:
        async with state.store.autocommit() as tx:  # one statement for all of them
            rows, pending = await repo.create_observers(tx, [new for _, new in todo])
        for (i, _), row in zip(todo, rows, strict=True):
            if isinstance(row, NameTaken):
                items.append(_refused(i, row))
            else:
                items.append({"index": i, "status": 201, "observer": row})
                state.journal.made([row])
    await state.outbox.publish_now(pending)
    items.sort(key=lambda item: item["index"])
    return {"created": len(pending), "failed": len(items) - len(pending), "items": items}


_CHANGES: dict[Action, repo.Change] = {
    Action.PAUSE: repo.pause_observer,
    Action.RESUME: repo.resume_observer,
    Action.RESTART: repo.restart_observer,
    Action.DELETE: repo.delete_observer,
}


@router.post(
    "/actions",
    response_model=ObserverActionOut,
    operation_id="actOnObservers",
    dependencies=[ADMIN],
    responses=responses(*AUTH, 413, 422, 503),
)
async def act_on_observers(body: ObserverAction, state: RuntimeDep) -> dict[str, Any]:
    """Pause, resume, restart or delete every observer (not deleted) that the selector takes,
    oldest first, up to `limit`: each as its own call would, in a transaction of its own, one
    that cannot be done (a resume of one not paused: 409) failing alone with its `problem`.
    The cancels they need are published together at the end. Ids asked for that are deleted
    or unknown are items of 404. When the database goes away midway, the answer is 503: what
    was done stays done (repeating the request is harmless)."""
    sel = body.selector
    async with state.store.autocommit() as tx:
        ids, more = await _select(tx, sel, body.limit)
    change = _CHANGES[body.action]
    items: list[dict[str, Any]] = []
    pending: list[Pending] = []
    try:
        for oid in ids:
            try:
                async with state.store.transaction() as tx:
                    row, published = await change(tx, oid)
            except Transient:
                raise  # the database is away: the rest would wait for it one by one (503)
            except OrchError as exc:
                items.append({"id": oid, "status": status_of(exc), "problem": problem_for(exc)})
                continue
            pending += published
            state.journal.changed(oid, body.action.value)
            items.append({"id": oid, "status": 200, "observer": row})  # an admin's: as it is
    finally:  # what was done is published, whatever stopped the rest
        state.outbox.publish_soon(pending)
    taken = set(ids)
    missing = [] if more else [oid for oid in dict.fromkeys(sel.ids or ()) if oid not in taken]
    for oid in missing:
        detail = f"no observer with id {oid} that is not deleted (or it did not match)"
        items.append({"id": oid, "status": 404, "problem": problem_of(404, detail)})
    done = sum(1 for item in items if item["status"] == 200)
    return {
        "matched": len(ids),
        "done": done,
        "failed": len(items) - done,
        "more": more,
        "items": items,
    }


async def _select(tx: Tx, sel: ObserverSelector, limit: int) -> tuple[list[uuid.UUID], bool]:
    """The observers (not deleted) a selector takes, oldest first, at most ``limit``; and
    whether more match."""
    return await repo.select_for_action(
        tx,
        ids=sel.ids,
        status=sel.status,
        kind=sel.kind,
        pool=sel.pool,
        name_prefix=sel.name_prefix,
        limit=limit,
    )


@router.post(
    "/move",
    response_model=ObserverMoveOut,
    operation_id="moveObservers",
    dependencies=[ADMIN],
    responses=responses(*AUTH, 404, 409, 422, 503),
)
async def move_observers(body: ObserverMove, state: RuntimeDep) -> dict[str, Any]:
    """Move the observers (not deleted) that the selector takes, oldest first, up to `limit`,
    and of those the first `percent`: to the pool `to_pool`, pinned to `to_version` of their
    kind (or unpinned with `any_version`). Each running one is handed over gracefully to a
    service that can run it there, resumed from its checkpoint, a bounded number at a time
    (the leader's mover: `ORCH_MOVE_IN_FLIGHT`); one nobody runs is dispatched there at once;
    a paused or failed one starts there when resumed or restarted. Each has a `move requested`
    event in its history. The target must offer each kind moved (in the version pinned): else
    422, naming what it offers, and nothing moves. A selector that takes nothing is a 404, a
    move of observers all already there a 409. Moving them back is a rollback."""
    to = repo.MoveTo(body.to_pool, body.to_version, body.any_version)
    async with state.store.autocommit() as tx:
        ids, more = await _select(tx, body.selector, body.limit)
        selected = len(ids)
        ids = ids[: math.ceil(selected * body.percent / 100)]
        targets = await repo.move_targets(tx, ids, to) if ids else []
    if not ids:
        pools = ", ".join(sorted({DEFAULT_POOL, *state.offered}))
        raise NotFound(f"no observer that is not deleted matches the selector (pools: {pools})")
    for need in targets:  # each kind is offered where it goes, or nothing moves
        await state.kind(need.kind, need.pool, need.version)
    async with state.store.transaction() as tx:
        rows, pending = await repo.move_observers(tx, ids, to)
    state.outbox.publish_soon(pending)
    if not rows:
        raise Conflict(f"the {len(ids)} observers selected are already where a move {to} puts them")
    moved = {r.id for r in rows}
    return {
        "matched": selected,
        "moved": len(moved),
        "more": more,
        "ids": [oid for oid in ids if oid in moved],
    }


@router.api_route("/move", methods=["GET", "DELETE", "PATCH"], include_in_schema=False)
@router.api_route("/batch", methods=["GET", "DELETE", "PATCH"], include_in_schema=False)
@router.api_route("/actions", methods=["GET", "DELETE", "PATCH"], include_in_schema=False)
async def batch_is_post_only() -> None:
    """Without it, ``GET /observers/batch`` would read "batch" as an observer id (422)."""
    raise HTTPException(405)


def _failed(
    index: int, code: int, detail: str, errors: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {"index": index, "status": code, "problem": problem_of(code, detail, errors=errors)}


def _refused(index: int, exc: OrchError) -> dict[str, Any]:
    """A batch item one of the orchestrator's errors refused (its problem's type included)."""
    return {"index": index, "status": status_of(exc), "problem": problem_for(exc)}


@router.get(
    "",
    response_model=ObserverPage,
    operation_id="listObservers",
    dependencies=[READ],
    responses=responses(*AUTH, 422, 503),
)
async def list_observers(
    state: RuntimeDep,
    raw: SeesSecrets,
    status_: StatusFilter = None,
    kind: KindFilter = None,
    pool: PoolFilter = None,
    param: ParamFilter = None,
    service_id: uuid.UUID | None = None,
    name: Annotated[
        SafeText | None,
        Query(min_length=1, max_length=200, description="matches any part of the name"),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    include_deleted: Annotated[
        bool, Query(description="deleted observers too (false: only the others)")
    ] = True,
) -> dict[str, Any]:
    """A page of observers, oldest first; `next_offset` is null on the last page."""
    contains = param_filter(param, raw)
    async with state.store.autocommit() as tx:
        items = await repo.list_observers(
            tx,
            status=status_,
            kind=kind,
            pool=pool,
            params=contains,
            service_id=service_id,
            name=name,
            include_deleted=include_deleted,
            limit=limit,
            offset=offset,
        )
    if not raw:
        await state.know_holders(items)
    return {
        "items": [shown(state, item, raw) for item in items],
        "limit": limit,
        "offset": offset,
        "next_offset": offset + limit if len(items) == limit else None,
    }


@router.get(
    "/{observer_id}",
    response_model=ObserverOut,
    operation_id="getObserver",
    dependencies=[READ],
    responses=responses(*ONE),
)
async def get_observer(
    observer_id: uuid.UUID, state: RuntimeDep, raw: SeesSecrets
) -> dict[str, Any]:
    """One observer: where it runs (service, epoch), its checkpoint, its last error. Secret
    params are `***` unless the token is an admin's."""
    async with state.store.autocommit() as tx:
        row = await repo.get_observer(tx, observer_id)
    if not raw:
        await state.know_holders([row])
    return shown(state, row, raw)


@router.get(
    "/{observer_id}/events",
    response_model=list[ObserverEventOut],
    operation_id="listObserverEvents",
    dependencies=[READ],
    responses=responses(*ONE),
)
async def observer_events(
    observer_id: uuid.UUID, state: RuntimeDep, raw: SeesSecrets
) -> list[dict[str, Any]]:
    """History: every take (with its service and epoch), release, restart, pause, deletion."""
    async with state.store.autocommit() as tx:
        row, events = await repo.list_events(tx, observer_id)
    if raw:
        return events
    await state.know_holders([row])
    params = row["params"] or {}
    values = secret_values(params, None, mask_as(params, state.secrets_of(row)))
    return [
        {
            **e,
            "detail": mask(e["detail"], secrets=values, keep_user=False)
            if e["detail"]
            else e["detail"],
        }
        for e in events
    ]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: ``patch`` applied to ``target`` (a new value; neither is changed)."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


@router.patch(
    "/{observer_id}",
    response_model=ObserverOut,
    operation_id="editObserver",
    dependencies=[ADMIN],
    responses=responses(*ONE, 409, 413),
)
async def edit_observer(observer_id: uuid.UUID, body: ObserverEdit, state: RuntimeDep) -> Any:
    """New params for a `paused` or `failed` observer, merged into its own (a JSON merge
    patch) and validated by its kind as a create's are; its resume or restart starts with them.
    A running observer is refused (409): pause it, edit it, resume it."""
    async with state.store.transaction() as tx:
        row = await repo.locked_for_edit(tx, observer_id)
        spec = await state.kind(row["kind"], row["pool"], row["kind_version"])
        params = spec.validate_params(merge_patch(row["params"] or {}, body.params))
        limit = state.settings.max_params_bytes
        if len(json.dumps(params)) > limit:
            raise TooLarge(f"params are larger than {limit} bytes")
        edited = await repo.edit_params(tx, row, params)
    state.journal.params_edited(edited)
    return shown(state, edited, True)


async def _change(state: RuntimeDep, change: repo.Change, observer_id: uuid.UUID) -> dict[str, Any]:
    """One state change: the row and its outbox records in one transaction, then published."""
    async with state.store.transaction() as tx:
        row, pending = await change(tx, observer_id)
    state.journal.changed(observer_id, _JOURNALED.get(change, ""))
    state.outbox.publish_soon(pending)
    return row


#: The changes a failover that lost them is made good for (``manager/journal.py``).
_JOURNALED: dict[repo.Change, str] = {repo.delete_observer: "delete", repo.pause_observer: "pause"}


def _route(method: str, suffix: str, change: repo.Change, code: int, op: str, doc: str) -> None:
    """One state-change route (admin only)."""

    async def route(observer_id: uuid.UUID, state: RuntimeDep) -> dict[str, Any]:
        return await _change(state, change, observer_id)

    route.__doc__ = doc
    router.add_api_route(
        "/{observer_id}" + suffix,
        route,
        methods=[method],
        name=change.__name__,
        operation_id=op,
        status_code=code,
        response_model=ObserverOut,
        dependencies=[ADMIN],
        responses=responses(*ONE, 409),
    )


_route(
    "DELETE",
    "",
    repo.delete_observer,
    status.HTTP_202_ACCEPTED,
    "deleteObserver",
    """Cancel an observer: `deleted` at once if nothing runs it, else `on_deleting` until its
    service has stopped it. Repeating the call is harmless.""",
)
_route(
    "POST",
    "/restart",
    repo.restart_observer,
    status.HTTP_200_OK,
    "restartObserver",
    """Revive a `failed` observer: it starts again (from its last checkpoint) on some service.
    Restart a `processing` one: its service stops its copy (the kind's cleanup runs, its last
    checkpoint stays) and starts a new one from that checkpoint, never beside the old one. 409
    for an observer in any other status.""",
)
_route(
    "POST",
    "/pause",
    repo.pause_observer,
    status.HTTP_202_ACCEPTED,
    "pauseObserver",
    """Stop an observer and keep it: `paused` at once if nothing runs it, else `pausing` until
    its service has stopped it (its last checkpoint stays). A delete wins over a pause.""",
)
_route(
    "POST",
    "/resume",
    repo.resume_observer,
    status.HTTP_200_OK,
    "resumeObserver",
    "Start a `paused` observer again, from its last checkpoint, on some service.",
)
