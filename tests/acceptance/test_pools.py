"""Pools: an observer runs only on services of its pool, whatever happens to them.

Service ``d`` is in the default pool; ``e1``, ``e2`` and ``e3`` join pool ``eu``. Observers
created in ``eu`` run on ``eu`` services alone: a drain hands them to another ``eu`` service,
never to ``d`` (which has room); when no ``eu`` service is left they wait, saying why, and run
again as soon as one joins. The broker carries each pool's starts on a queue of its own, so
``d`` never receives one it must pass on. Judged from the observers' own tick logs and history.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from orch.cluster import quiet
from orch_bench.ticklog import read_ticks
from tests.support.cluster import Cluster, wait_for
from tests.support.faults import assert_no_overlap

POOL = "eu"


async def _create(cluster: Cluster, n: int, pool: str | None, tag: str) -> list[uuid.UUID]:
    ids = []
    async with cluster.api() as api:
        for i in range(n):
            body = {
                "name": f"{tag}-{i}",
                "kind": "recorder",
                "params": {"dir": str(cluster.tick_dir), "interval": 0.05},
            }
            if pool is not None:
                body["pool"] = pool
            r = await api.post("/observers", json=body)
            assert r.status_code == 201, r.text
            assert r.json()["pool"] == (pool or "default")
            ids.append(uuid.UUID(r.json()["id"]))
    return ids


def _ticked_after(cluster: Cluster, ids: list[uuid.UUID], after: float) -> set[str]:
    wanted = {str(i) for i in ids}
    return {t.observer for t in read_ticks(cluster.tick_dir) if t.at > after} & wanted


async def _taken_by(cluster: Cluster, ids: list[uuid.UUID]) -> set[uuid.UUID]:
    """Every service that ever took one of these observers (their history)."""
    rows = await cluster.q(
        "SELECT DISTINCT service_id FROM observer_events WHERE observer_id = ANY($1) "
        "AND event = 'taken'",
        ids,
    )
    return {r["service_id"] for r in rows}


@pytest.mark.processes
async def test_observers_run_only_on_services_of_their_pool(cluster: Cluster) -> None:
    await cluster.start_manager()
    d = await cluster.start_service("d", worker_count=20)
    e1 = await cluster.start_service("e1", worker_count=20, pool=POOL)
    d_id, e1_id = await cluster.service_id(d, wait=10), await cluster.service_id(e1, wait=10)
    eu = await _create(cluster, 8, POOL, "eu")
    home = await _create(cluster, 4, None, "home")
    await cluster.wait_all_running(eu, timeout=20, on={e1_id})
    await cluster.wait_all_running(home, timeout=20, on={d_id})

    async with cluster.api() as api:
        services = {s["name"]: s for s in (await api.get("/services")).json()}
        pools = {p["name"]: p for p in (await api.get("/pools")).json()}
        listed = (await api.get("/observers", params={"pool": POOL})).json()["items"]
        kinds = {k["name"]: k for k in (await api.get("/kinds")).json()}
    assert services["e1"]["pool"] == POOL
    assert services["d"]["pool"] == "default"
    assert (pools[POOL]["running"], pools[POOL]["slots"]) == (8, 20), pools
    assert pools["default"]["running"] == 4, pools
    assert {o["id"] for o in listed} == {str(i) for i in eu}
    assert sorted(kinds["recorder"]["pools"]) == ["default", POOL]

    # A drain hands eu's observers to the other eu service, never to d (which has room).
    e2 = await cluster.start_service("e2", worker_count=20, pool=POOL)
    e2_id = await cluster.service_id(e2, wait=10)
    async with cluster.api() as api:
        assert (await api.post(f"/services/{e1_id}/drain")).status_code == 202
    await cluster.wait_all_running(eu, timeout=20, on={e2_id})

    # The last eu service dies: its observers wait, saying why; d never takes them.
    e2.signal(signal.SIGKILL)
    killed_at = time.time()
    why = f"no live service in pool '{POOL}'"

    async def all_waiting() -> bool | list[tuple[str | None, str | None]]:
        async with cluster.api() as api:
            rows = (await api.get("/observers", params={"pool": POOL})).json()["items"]
        if len(rows) == len(eu) and all(
            r["service_id"] is None and r["waiting"] == why for r in rows
        ):
            return True
        return not rows and [(r["service_id"], r["waiting"]) for r in rows]

    await wait_for(all_waiting, timeout=20, what="every eu observer waiting, saying why")
    await quiet(1.0, "d would take an observer of pool eu")
    assert not _ticked_after(cluster, eu, killed_at + 0.5), "an eu observer ran with no eu service"

    # An eu service joins: every waiting observer runs there.
    e3 = await cluster.start_service("e3", worker_count=20, pool=POOL)
    e3_id = await cluster.service_id(e3, wait=10)
    joined = time.time()

    async def all_ticking() -> bool:
        return _ticked_after(cluster, eu, joined) == {str(i) for i in eu}

    await wait_for(all_ticking, timeout=20, what="every eu observer ticking on e3", every=0.02)
    print(f"\nall {len(eu)} waiting eu observers ticking {time.time() - joined:.2f} s after e3")
    await cluster.wait_all_running(eu, timeout=10, on={e3_id})
    assert await _taken_by(cluster, eu) == {e1_id, e2_id, e3_id}
    assert await _taken_by(cluster, home) == {d_id}
    # The broker carried each pool's starts apart: d never received one it had to pass on.
    assert "pass:" not in (d.log.read_text() if d.log else ""), "d received an eu start"
    assert_no_overlap(cluster.tick_dir)


@pytest.mark.processes
async def test_a_create_names_a_pool_that_offers_its_kind(cluster: Cluster) -> None:
    """A pool nobody joined, a kind the pool's services lack, or a name that cannot be a pool:
    each a 422 that says what there is, never echoing what was sent."""
    await cluster.start_manager()
    e = await cluster.start_service("e", worker_count=5, pool=POOL, kind_modules="")
    await cluster.service_id(e, wait=10)
    async with cluster.api() as api:

        async def create(pool: str, kind: str = "ticker") -> tuple[int, str]:
            params = {"dir": str(cluster.tick_dir)} if kind == "recorder" else {}
            body = {"name": f"x-{uuid.uuid4()}", "kind": kind, "pool": pool, "params": params}
            r = await api.post("/observers", json=body)
            return r.status_code, r.json().get("detail", "") if r.status_code != 201 else ""

        assert await create(POOL) == (201, "")
        code, detail = await create("mars")
        assert code == 422, detail
        assert detail == "no service has joined pool 'mars'; pools: default, eu", detail
        code, detail = await create(POOL, "recorder")
        assert code == 422, detail
        assert detail.startswith("pool 'eu' offers no kind of that name; it offers: "), detail
        assert "ticker" in detail, detail
        assert "recorder" not in detail, "the API echoed the kind asked for"
        code, detail = await create("Not A Pool")
        assert code == 422, detail
        # The manager's own kinds run in the default pool as before pools.
        assert await create("default", "recorder") == (201, "")
