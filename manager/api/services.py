"""/services, /kinds, /pools and /leader: what the cluster looks like."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from orch_contracts.errors import AdvertRefused
from orch_contracts.kinds import KindSpec
from orch_manager import repository as repo
from orch_manager.api.deps import RuntimeDep
from orch_manager.auth import ADMIN, READ
from orch_manager.leader import current_leader
from orch_manager.problems import responses
from orch_manager.runtime import advertised_spec
from orch_manager.schemas import KindOut, LeaderOut, PoolOut, ServiceOut

router = APIRouter(tags=["cluster"])
AUTH = (401, 403)
#: A service's id, or the name of the one live service that has it (409 when several do).
ServiceRef = Annotated[
    str,
    Path(
        max_length=200,
        description="a service's id, or the name of the one live service that has it",
    ),
]


@router.get(
    "/services",
    response_model=list[ServiceOut],
    operation_id="listServices",
    dependencies=[READ],
    responses=responses(*AUTH, 422, 503),
)
async def list_services(state: RuntimeDep, include_deleted: bool = False) -> list[dict[str, Any]]:
    """Live services (all of them with `include_deleted`), with what each holds."""
    async with state.store.autocommit() as tx:
        return await repo.list_services(tx, include_deleted=include_deleted)


@router.post(
    "/services/{service_id}/drain",
    status_code=202,
    response_model=ServiceOut,
    operation_id="drainService",
    dependencies=[ADMIN],
    responses=responses(*AUTH, 404, 409, 422, 503),
)
async def drain_service(service_id: ServiceRef, state: RuntimeDep) -> dict[str, Any]:
    """Stop a service taking work and move every observer off it (each resumes elsewhere from
    its checkpoint); afterwards it can be stopped with nothing moving again."""
    async with state.store.transaction() as tx:
        row, pending = await repo.drain_service(tx, service_id)
    state.outbox.publish_soon(pending)
    state.metrics.moves.labels("drain").inc(int(row["running"]))
    return row


@router.post(
    "/services/{service_id}/undrain",
    status_code=202,
    response_model=ServiceOut,
    operation_id="undrainService",
    dependencies=[ADMIN],
    responses=responses(*AUTH, 404, 409, 422, 503),
)
async def undrain_service(service_id: ServiceRef, state: RuntimeDep) -> dict[str, Any]:
    """Undo a drain: the service takes work again (new observers, and moves to it from busier
    services). Undraining a service that does not drain changes nothing."""
    async with state.store.transaction() as tx:
        row, pending = await repo.drain_service(tx, service_id, draining=False)
    state.outbox.publish_soon(pending)
    return row


@router.get(
    "/kinds",
    response_model=list[KindOut],
    operation_id="listKinds",
    dependencies=[READ],
    responses=responses(*AUTH, 503),
)
async def list_kinds(state: RuntimeDep) -> list[dict[str, Any]]:
    """The kinds this cluster runs, with their params' JSON schema, restart policy and the live
    services that run them: those this manager knows, and those the services advertise."""
    async with state.store.autocommit() as tx:
        adverts = await repo.live_adverts(tx)
    kinds: dict[str, dict[str, Any]] = {k.name: _entry(k) for k in state.kinds.values()}
    runs: dict[str, set[str] | None] = {}  # service: the kinds it runs (None: every kind)
    for a in adverts:
        found = runs.setdefault(a.service, None if a.every else set())
        spec = _advertised(a)
        if spec is None or found is None:
            continue
        found.add(spec.name)
        kinds.setdefault(spec.name, _entry(spec))["versions"].append(spec.version)
    pools = {a.service: a.pool for a in adverts}
    for service, found in runs.items():
        for name, kind in kinds.items():
            if found is None or name in found:
                kind["services"].append(service)
                if pools[service] not in kind["pools"]:
                    kind["pools"].append(pools[service])
    for kind in kinds.values():
        kind["versions"] = sorted(set(kind["versions"]))
    return [kinds[name] for name in sorted(kinds)]


def _entry(spec: KindSpec) -> dict[str, Any]:
    """A kind as ``GET /kinds`` lists it: the fields of this release alone (an advert of a
    later or earlier release may carry others)."""
    return {**spec.advert(), "name": spec.name, "services": [], "pools": [], "versions": []}


def _advertised(a: repo.LiveAdvert) -> KindSpec | None:
    """The kind one live service advertised, or None (none, or one that cannot be read:
    ``ManagerRuntime.read_adverts`` logs it)."""
    if a.kind is None or a.text is None:
        return None
    try:
        return advertised_spec(a.kind, a.text)
    except AdvertRefused:
        return None


@router.get(
    "/pools",
    response_model=list[PoolOut],
    operation_id="listPools",
    dependencies=[READ],
    responses=responses(*AUTH, 503),
)
async def list_pools(state: RuntimeDep) -> list[dict[str, Any]]:
    """Every pool with a live service or an observer waiting in it: its live services, their
    slots (those taking work), what they run, the observers nobody holds (queued for a slot,
    or waiting for a service able to run them) and the kinds its live services run."""
    async with state.store.autocommit() as tx:
        loads, unheld = await repo.pool_loads(tx)
        adverts = await repo.live_adverts(tx)
    pools: dict[str, dict[str, Any]] = {}
    for name in sorted({*loads, *unheld}):
        load = loads.get(name)
        pools[name] = {
            "name": name,
            "services": load.services if load else 0,
            "slots": load.slots if load else 0,
            "running": load.running if load else 0,
            "unheld": unheld.get(name, 0),
            "kinds": [],
        }
    for a in adverts:
        entry = pools.get(a.pool)
        if entry is None or entry["kinds"] is None:
            continue
        if a.every:
            entry["kinds"] = None
        elif a.kind is not None:
            entry["kinds"] = sorted({*entry["kinds"], a.kind})
    return list(pools.values())


@router.get(
    "/leader",
    response_model=LeaderOut,
    operation_id="getLeader",
    dependencies=[READ],
    responses=responses(*AUTH, 503),
)
async def leader(state: RuntimeDep) -> dict[str, Any]:
    """Which manager replica runs the background loops, and whether it is this one."""
    row = await current_leader(state.store) or {"holder": None}
    return {
        **row,
        "this_replica": state.leadership.holder,
        "this_replica_leads": state.leadership.is_leader,
    }
