"""A fleet whose services run different kinds, as it is while a new kind rolls out.

Service ``a`` runs the test kinds, ``b`` only the built-in ones. Every start of a test kind that
reaches ``b`` (the work queue is shared) is passed on, never taken there nor failed for it; the
leader sends it to a service that runs the kind. With no such service left the observers wait,
and say why; they run again as soon as one joins. Judged from the observers' own tick logs.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from orch.cluster import quiet
from orch_bench.ticklog import read_ticks
from orch_manager.auth import Role, new_token
from tests.support.cluster import Cluster, wait_for
from tests.support.faults import assert_no_overlap

#: Every test here needs processes of its own (faults, or what one process holds).
pytestmark = pytest.mark.processes

OBSERVERS = 12
#: From a capable service's registration to every waiting observer ticking (the target).
JOIN_BOUND = 1.0


async def _create(cluster: Cluster, n: int = OBSERVERS) -> list[uuid.UUID]:
    ids = []
    for i in range(n):
        body = await cluster.create(
            f"new-kind-{i}", "slow_stop", dir=str(cluster.tick_dir), interval=0.05, stop_after=0
        )
        ids.append(uuid.UUID(body["id"]))
    return ids


async def _running_on(cluster: Cluster) -> dict[uuid.UUID, int]:
    """How many observers each service runs."""
    rows = await cluster.q(
        "SELECT service_id, count(*) AS n FROM observers WHERE status = 'processing' "
        "GROUP BY service_id"
    )
    return {r["service_id"]: r["n"] for r in rows}


def _ticked_after(cluster: Cluster, ids: list[uuid.UUID], after: float) -> set[str]:
    """Which of these observers ticked after ``after`` (epoch seconds), by their tick logs."""
    wanted = {str(i) for i in ids}
    return {t.observer for t in read_ticks(cluster.tick_dir) if t.at > after} & wanted


async def test_a_kind_some_services_lack_runs_only_where_it_is_and_waits_for_it(
    cluster: Cluster,
) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("a", worker_count=20)
    b = await cluster.start_service("b", worker_count=20, kind_modules="")
    a_id, b_id = await cluster.service_id(a), await cluster.service_id(b)
    ids = await _create(cluster)
    await cluster.wait_all_running(ids, timeout=20, on={a_id})

    # Half the starts went to b by the work queue: each was passed on, none taken nor failed.
    await b.wait_log("start message: pass: another pool's, or its kind is not installed here")
    async with cluster.api() as api:
        kinds = {k["name"]: k for k in (await api.get("/kinds")).json()}
        services = {s["name"]: s for s in (await api.get("/services")).json()}
    assert kinds["slow_stop"]["services"] == ["a"], kinds["slow_stop"]
    assert sorted(kinds["ticker"]["services"]) == ["a", "b"]
    assert "slow_stop" in services["a"]["kinds"]
    assert "slow_stop" not in services["b"]["kinds"]

    # The only service that runs the kind dies: its observers wait, saying why; b never takes
    # them, and nothing is failed.
    a.signal(signal.SIGKILL)
    killed_at = time.time()

    async def all_waiting() -> bool:
        rows = await cluster.q(
            "SELECT status, service_id, waiting FROM observers WHERE id = ANY($1)", ids
        )
        return all(
            r["service_id"] is None and r["waiting"] == "no live service runs kind 'slow_stop'"
            for r in rows
        )

    await wait_for(all_waiting, timeout=20, what="every observer waiting, saying why")
    async with cluster.api() as api:
        shown = (await api.get(f"/observers/{ids[0]}")).json()
    assert shown["waiting"] == "no live service runs kind 'slow_stop'", shown
    await quiet(1.0, "b would take or fail an observer whose kind it lacks")
    rows = await cluster.q(
        "SELECT o.status, count(e.*) FILTER (WHERE e.service_id = $2 AND e.event = 'taken') "
        "AS taken_by_b FROM observers o LEFT JOIN observer_events e ON e.observer_id = o.id "
        "WHERE o.id = ANY($1) GROUP BY o.id, o.status",
        ids,
        b_id,
    )
    assert {r["status"] for r in rows} == {"processing"}, [dict(r) for r in rows]
    assert sum(r["taken_by_b"] for r in rows) == 0, "b took an observer of a kind it lacks"
    assert not _ticked_after(cluster, ids, killed_at + 0.5), "a waiting observer ran"

    # A service that runs the kind joins: every waiting observer runs there, at once.
    c = await cluster.start_service("c", worker_count=20)
    c_id = await cluster.service_id(c, wait=10)
    joined = await cluster.q(
        "SELECT extract(epoch FROM created_at) FROM services WHERE id = $1", c_id, one=True
    )

    async def all_ticking() -> bool:
        return _ticked_after(cluster, ids, float(joined)) == {str(i) for i in ids}

    await wait_for(all_ticking, timeout=20, what="every observer ticking on c", every=0.02)
    took = time.time() - float(joined)
    await cluster.wait_all_running(ids, timeout=10, on={c_id})
    print(f"\nall {OBSERVERS} waiting observers ticking {took:.2f} s after c registered")
    assert took < JOIN_BOUND + 1.0, f"{took:.2f} s from c joining to all running"
    assert_no_overlap(cluster.tick_dir)


async def test_a_manager_without_a_kinds_code_checks_creates_against_what_services_advertise(
    cluster: Cluster,
) -> None:
    """The manager runs only the built-in kinds; the test kinds are on service ``a`` alone. A
    create of one is checked against the schema ``a`` advertises (bad params are a 422 that
    says which field), an unknown kind is a 422 that names the kinds there are, and a secret
    the kind declares by its type alone is masked for a read token."""
    read, read_entry = new_token("viewer", Role.READ)
    await cluster.start_manager(
        kind_modules="", api_tokens=f"{cluster.env['ORCH_API_TOKENS']},{read_entry}"
    )
    a = await cluster.start_service("a", worker_count=10)
    await cluster.service_id(a, wait=10)
    good = await cluster.create(
        "advertised", "slow_stop", dir=str(cluster.tick_dir), interval=0.05, stop_after=0
    )
    await cluster.wait_all_running([uuid.UUID(good["id"])], timeout=20)
    async with cluster.api() as api:
        bad = await api.post(
            "/observers",
            json={"name": "bad", "kind": "slow_stop", "params": {"interval": "soon"}},
        )
        unknown = await api.post("/observers", json={"name": "u", "kind": "nope", "params": {}})
        keyed = await api.post(
            "/observers",
            json={"name": "keyed", "kind": "quotes_its_key", "params": {"pin": "73519"}},
        )
        kinds = {k["name"]: k for k in (await api.get("/kinds")).json()}
    assert bad.status_code == 422, bad.text
    assert "interval" in bad.json()["detail"], bad.text
    assert "soon" not in bad.text, "the API echoed what the client sent"
    assert unknown.status_code == 422, unknown.text
    assert "slow_stop" in unknown.json()["detail"], unknown.text
    assert keyed.status_code == 201, keyed.text
    assert kinds["slow_stop"]["params_schema"]["properties"]["interval"]["type"] == "number"
    assert kinds["slow_stop"]["services"] == ["a"]
    headers = {"Authorization": f"Bearer {read}"}
    async with cluster.api() as api:
        shown = await api.get(f"/observers/{keyed.json()['id']}", headers=headers)
    assert shown.json()["params"]["pin"] == "***", shown.text


async def test_rebalance_moves_to_a_service_only_observers_of_kinds_it_runs(
    cluster: Cluster,
) -> None:
    """``a`` runs 6 tickers (built in), then 6 observers of a test kind; ``b``, without the
    test kinds, joins empty. Rebalance evens the load with tickers alone: no observer of the
    test kind is ever asked to move to ``b``."""
    await cluster.start_manager(rebalance="true", rebalance_min_age="1", rebalance_interval="0.3")
    a = await cluster.start_service("a", worker_count=20)
    tickers = [
        uuid.UUID((await cluster.create(f"ticker-{i}", "ticker", interval=0.05))["id"])
        for i in range(6)
    ]
    await cluster.wait_all_running(tickers, timeout=20)
    # Started last, the test kind's observers are the ones a move would pick first.
    ids = await _create(cluster, 6)
    await cluster.wait_all_running(ids, timeout=20)
    b = await cluster.start_service("b", worker_count=20, kind_modules="")
    a_id, b_id = await cluster.service_id(a), await cluster.service_id(b)

    async def even() -> bool:
        return await _running_on(cluster) == {a_id: 6, b_id: 6}

    await wait_for(even, timeout=30, what="6 tickers moved to b")
    moved = await cluster.q(
        "SELECT DISTINCT o.kind FROM observer_events e JOIN observers o ON o.id = e.observer_id "
        "WHERE e.event = 'handoff requested'"
    )
    assert {r["kind"] for r in moved} == {"ticker"}, [dict(r) for r in moved]
    assert_no_overlap(cluster.tick_dir)


async def test_a_service_that_can_take_nothing_does_not_hold_rebalance_up(
    cluster: Cluster,
) -> None:
    """``a`` runs 12 observers of a test kind; ``b`` (no test kinds) and ``c`` (with them) join.
    ``b``, the emptiest, can take none of them: rebalance evens ``a`` and ``c`` out without it
    (planned with ``b``, every round kept moves for it that found nothing, and ``a`` stayed
    twice as loaded as ``c``)."""
    await cluster.start_manager(rebalance="true", rebalance_min_age="1", rebalance_interval="0.3")
    a = await cluster.start_service("a", worker_count=20)
    ids = await _create(cluster)
    await cluster.wait_all_running(ids, timeout=20)
    await cluster.start_service("b", worker_count=20, kind_modules="")
    c = await cluster.start_service("c", worker_count=20)
    a_id, c_id = await cluster.service_id(a), await cluster.service_id(c)

    async def even() -> bool:
        return await _running_on(cluster) == {a_id: 6, c_id: 6}

    await wait_for(even, timeout=45, what="a and c with 6 observers each")
    assert_no_overlap(cluster.tick_dir)
