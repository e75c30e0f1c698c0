"""Moving observers between pools and versions with them running: a canary and its rollback.

Each move is judged from the observers' own tick logs: the moved ones run on a service of
their new pool (or version), resumed from their checkpoint (their count goes on), after a short
gap and never beside their old copy; the others are not touched.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from orch_bench.ticklog import largest_gaps, read_ticks
from tests.support.cluster import Cluster, quiet, wait_for
from tests.support.faults import assert_no_overlap

CANARY = "canary"
#: The longest gap a graceful move may leave in an observer's ticks: its holder stops it at
#: the handoff, the target resumes it at once (no lease to wait for).
GAP_BOUND = 1.5


async def _create(cluster: Cluster, n: int, **extra: Any) -> list[uuid.UUID]:
    ids = []
    async with cluster.api() as api:
        for i in range(n):
            body = {
                "name": f"v-{i}-{uuid.uuid4().hex[:6]}",
                "kind": "versioned",
                "params": {"dir": str(cluster.tick_dir), "interval": 0.05},
                **extra,
            }
            r = await api.post("/observers", json=body)
            assert r.status_code == 201, r.text
            ids.append(uuid.UUID(r.json()["id"]))
    return ids


async def _move(cluster: Cluster, body: dict[str, Any], code: int = 200) -> dict[str, Any]:
    async with cluster.api() as api:
        r = await api.post("/observers/move", json=body)
    assert r.status_code == code, r.text
    answer: dict[str, Any] = r.json()
    return answer


async def _holders(cluster: Cluster, ids: list[uuid.UUID]) -> dict[uuid.UUID, uuid.UUID | None]:
    rows = await cluster.q(
        "SELECT id, service_id FROM observers WHERE id = ANY($1) AND status = 'processing'", ids
    )
    return {r["id"]: r["service_id"] for r in rows}


def _counts(cluster: Cluster, ids: list[uuid.UUID], service: uuid.UUID) -> dict[str, list[int]]:
    """Each observer's tick counts made on ``service``, in order."""
    wanted = {str(i) for i in ids}
    out: dict[str, list[int]] = {}
    for t in read_ticks(cluster.tick_dir):
        if t.observer in wanted and t.service == str(service):
            out.setdefault(t.observer, []).append(t.count)
    return out


async def test_a_canary_moves_a_share_to_another_pool_and_rolls_back(cluster: Cluster) -> None:
    await cluster.start_manager(rebalance="false")
    d = await cluster.start_service("d", worker_count=20)
    c = await cluster.start_service("c", worker_count=20, pool=CANARY)
    d_id, c_id = await cluster.service_id(d, wait=10), await cluster.service_id(c, wait=10)
    ids = await _create(cluster, 10)
    await cluster.wait_all_running(ids, timeout=20, on={d_id})
    await wait_for(
        lambda: _all_ticked_since(cluster, ids, 0), timeout=10, what="every observer ticking"
    )
    started = time.time()

    answer = await _move(
        cluster,
        {"selector": {"kind": "versioned", "pool": "default"}, "percent": 20, "to_pool": CANARY},
    )
    assert (answer["matched"], answer["moved"]) == (10, 2), answer
    moved = [uuid.UUID(i) for i in answer["ids"]]
    assert moved == ids[:2], "the oldest are moved first"
    stay = [i for i in ids if i not in moved]
    await cluster.wait_all_running(moved, timeout=20, on={c_id})
    assert set((await _holders(cluster, stay)).values()) == {d_id}, "only the share moved"

    # Resumed from their checkpoints: the count goes on where it stopped on d.
    async def counted_on_c() -> bool:
        return len(_counts(cluster, moved, c_id)) == len(moved)

    await wait_for(counted_on_c, timeout=10, what="the moved observers ticking on c")
    before, after = _counts(cluster, moved, d_id), _counts(cluster, moved, c_id)
    for oid in map(str, moved):
        assert after[oid][0] > before[oid][-1] - 2, (before[oid][-5:], after[oid][:5])
    rows = await cluster.q(
        "SELECT observer_id, detail FROM observer_events WHERE event = 'move requested'"
    )
    assert {r["observer_id"] for r in rows} == set(moved)
    assert {r["detail"] for r in rows} == {f"to pool '{CANARY}'"}

    # Rollback: moved back the same way.
    back = await _move(cluster, {"selector": {"pool": CANARY}, "to_pool": "default"})
    assert back["moved"] == 2, back
    await cluster.wait_all_running(ids, timeout=20, on={d_id})
    since = time.time()
    await wait_for(
        lambda: _all_ticked_since(cluster, ids, since), timeout=10, what="all ticking again"
    )
    gaps = largest_gaps(read_ticks(cluster.tick_dir), started, time.time())
    worst = max(gaps[str(i)] for i in moved)
    print(f"\nlongest gap of a moved observer: {worst:.3f} s (bound {GAP_BOUND} s)")
    assert worst < GAP_BOUND, gaps
    assert max(gaps[str(i)] for i in stay) < 0.5, "an observer that stayed was disturbed"
    assert_no_overlap(cluster.tick_dir)


async def _all_ticked_since(cluster: Cluster, ids: list[uuid.UUID], since: float) -> bool:
    ticked = {t.observer for t in read_ticks(cluster.tick_dir) if t.at > since}
    return {str(i) for i in ids} <= ticked


@pytest.mark.processes
async def test_observers_pinned_to_a_version_run_only_where_it_is(cluster: Cluster) -> None:
    """Two services of the default pool carry versions 1 and 2 of one kind. Pinning every
    observer to version 2 moves each one on version 1 to the other service; a create pinned
    to a version nobody has, or a move to a pool nobody joined, is a 422 that says what there
    is, and moves nothing."""
    await cluster.start_manager(rebalance="false")
    v1 = await cluster.start_service("v1", worker_count=20, test_kind_version="1")
    v1_id = await cluster.service_id(v1, wait=10)
    ids = await _create(cluster, 6)
    await cluster.wait_all_running(ids, timeout=20, on={v1_id})
    v2 = await cluster.start_service("v2", worker_count=20, test_kind_version="2")
    v2_id = await cluster.service_id(v2, wait=10)
    async with cluster.api() as api:
        kinds = {k["name"]: k for k in (await api.get("/kinds")).json()}
    assert sorted(kinds["versioned"]["versions"]) == ["1", "2"], kinds["versioned"]
    schemas = await cluster.q(
        "SELECT id, kinds->'versioned'->'params_schema'->'properties' ? 'label' AS label "
        "FROM services"
    )
    assert {r["id"]: r["label"] for r in schemas} == {v1_id: False, v2_id: True}
    # A new schema advertised changes nothing for the observers of the old one: they run on.
    await quiet(1.0, "the observers of version 1 would be restarted or failed")
    await cluster.wait_all_running(ids, timeout=5, on={v1_id}, fresh_after=time.time())
    events = await cluster.q(
        "SELECT DISTINCT event FROM observer_events WHERE observer_id = ANY($1)", ids
    )
    assert {r["event"] for r in events} == {"created", "taken"}, [dict(r) for r in events]

    answer = await _move(cluster, {"selector": {"kind": "versioned"}, "to_version": "2"})
    assert answer["moved"] == 6, answer
    await cluster.wait_all_running(ids, timeout=20, on={v2_id})
    again = await _move(
        cluster, {"selector": {"ids": [str(i) for i in ids]}, "to_version": "2"}, 409
    )
    assert "already where a move to version '2' puts them" in again["detail"], again
    nothing = await _move(cluster, {"selector": {"name_prefix": "nobody-"}, "to_version": "2"}, 404)
    assert "pools: default" in nothing["detail"], nothing

    pinned = await _create(cluster, 2, version="2")
    await cluster.wait_all_running(pinned, timeout=20, on={v2_id})
    async with cluster.api() as api:
        r = await api.post(
            "/observers",
            json={
                "name": "v3",
                "kind": "versioned",
                "version": "3",
                "params": {"dir": str(cluster.tick_dir)},
            },
        )
        shown = (await api.get(f"/observers/{pinned[0]}")).json()
    assert r.status_code == 422, r.text
    assert r.json()["detail"].endswith("it has: 1, 2"), r.text
    assert shown["kind_version"] == "2"

    nowhere = await _move(cluster, {"selector": {"kind": "versioned"}, "to_pool": "mars"}, code=422)
    assert "no service has joined pool 'mars'" in nowhere["detail"], nowhere
    no_target = await _move(cluster, {"selector": {"kind": "versioned"}}, code=422)
    assert "to_pool, to_version or any_version" in str(no_target), no_target
    rows = await cluster.q("SELECT DISTINCT pool FROM observers WHERE id = ANY($1)", ids)
    assert [r["pool"] for r in rows] == ["default"], "a refused move moved something"
    assert_no_overlap(cluster.tick_dir)


async def test_a_hundred_observers_move_at_the_pace_set(cluster: Cluster) -> None:
    """100 observers move to another pool with ``ORCH_MOVE_IN_FLIGHT=20``: each stops for well
    under a second, never two copies of one at once, and never more than 20 are between their
    old holder and their new one at any moment (judged from their ticks)."""
    in_flight, n = 20, 100
    await cluster.start_manager(rebalance="false", move_in_flight=str(in_flight))
    d = await cluster.start_service("d", worker_count=n + 20)
    c = await cluster.start_service("c", worker_count=n + 20, pool=CANARY)
    d_id, c_id = await cluster.service_id(d, wait=10), await cluster.service_id(c, wait=10)
    params = {"dir": str(cluster.tick_dir), "interval": 0.1, "checkpoint_every": 5}
    async with cluster.api() as api:
        r = await api.post(
            "/observers/batch",
            json={
                "observers": [
                    {"name": f"many-{i}", "kind": "recorder", "params": params} for i in range(n)
                ]
            },
        )
    assert r.status_code == 200, r.text
    ids = [uuid.UUID(item["observer"]["id"]) for item in r.json()["items"]]
    await cluster.wait_all_running(ids, timeout=30, on={d_id})
    await wait_for(
        lambda: _all_ticked_since(cluster, ids, 0), timeout=10, what="every observer ticking"
    )
    started = time.time()
    answer = await _move(cluster, {"selector": {"pool": "default"}, "to_pool": CANARY})
    assert answer["moved"] == n, answer
    await cluster.wait_all_running(ids, timeout=60, on={c_id})
    moved_in = time.time() - started
    # Every one ticking on after the move (since a moment taken once: "since now" at each
    # check asked for ticks newer than the check itself).
    mark = time.time()
    await wait_for(lambda: _all_ticked_since(cluster, ids, mark), timeout=10, what="all ticking")

    ticks = read_ticks(cluster.tick_dir)
    gaps = largest_gaps(ticks, started, time.time())
    # Each observer's way across: from its last tick on d to its first on c.
    spans = []
    for oid in map(str, ids):
        last_d = max(t.at for t in ticks if t.observer == oid and t.service == str(d_id))
        first_c = min(t.at for t in ticks if t.observer == oid and t.service == str(c_id))
        spans.append((last_d, first_c))
    crossing = max(sum(1 for a, b in spans if a <= at < b) for at, _ in spans)
    worst = max(gaps[str(i)] for i in ids)
    print(
        f"\n{n} moved in {moved_in:.2f} s; longest gap {worst:.3f} s; at most {crossing} "
        f"across at once (in flight {in_flight})"
    )
    assert worst < 1.0, sorted(gaps.values())[-5:]
    assert crossing <= in_flight, crossing
    assert_no_overlap(cluster.tick_dir)
