"""Capacity you can see: the cluster's slots, what runs and what waits, and no observer shown
``processing`` without a live service holding it.

Service ``small`` has 2 slots for 5 recorders: 2 run (their own ticks say which) and 3 are
queued, each saying so, and ``GET /views/totals`` counts 2 slots, 2 running, 0 free, 3 waiting.
``small`` is SIGKILLed: once its lease is gone every observer says why it waits, none looks
held. A service with room joins: all 5 tick, nothing waits.
"""

from __future__ import annotations

import signal
import time
import uuid
from typing import Any

import pytest

from orch_bench.ticklog import read_ticks
from tests.support.cluster import Cluster, wait_for
from tests.support.faults import assert_no_overlap


async def _totals(cluster: Cluster) -> dict[str, Any]:
    async with cluster.api() as api:
        r = await api.get("/views/totals")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def _observers(cluster: Cluster) -> list[dict[str, Any]]:
    async with cluster.api() as api:
        r = await api.get("/observers", params={"limit": 100})
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def _ticking_since(cluster: Cluster, ids: list[uuid.UUID], since: float) -> set[str]:
    wanted = {str(i) for i in ids}
    return {t.observer for t in read_ticks(cluster.tick_dir) if t.at > since} & wanted


async def _ticking_are(
    cluster: Cluster, ids: list[uuid.UUID], since: float, want: set[str]
) -> bool:
    return _ticking_since(cluster, ids, since) == want


@pytest.mark.processes
async def test_capacity_and_waiting_are_shown_and_processing_means_a_live_holder(
    cluster: Cluster,
) -> None:
    await cluster.start_manager()
    small = await cluster.start_service("small", worker_count=2)
    ids = await cluster.create_recorders(5, interval=0.05)

    async def two_run_three_queue() -> dict[str, Any] | None:
        t = await _totals(cluster)
        return t if (t["running"], t["waiting"]) == (2, 3) else None

    totals = await wait_for(two_run_three_queue, timeout=20, what="2 running, 3 waiting")
    assert (totals["services"], totals["slots"], totals["free"]) == (1, 2, 0), totals
    assert sum(totals["by_status"].values()) == 5, totals
    observers = await _observers(cluster)
    held = {o["id"] for o in observers if o["service_id"] and o["waiting"] is None}
    queued = {o["id"] for o in observers if o["waiting"] == "queued for a free slot"}
    assert len(held) == 2, observers
    assert len(queued) == 3, observers
    # The observers' own output agrees: the two held ones tick, the queued ones do not.
    mark = time.time()
    await wait_for(
        lambda: _ticking_are(cluster, ids, mark, held),
        timeout=10,
        what="the two held observers ticking",
    )
    assert not _ticking_since(cluster, ids, mark) & queued

    # Its service dies: once its lease is gone, none of them looks held.
    small.signal(signal.SIGKILL)

    async def all_wait() -> list[dict[str, Any]] | None:
        rows = await _observers(cluster)
        return rows if all(o["waiting"] for o in rows) else None

    rows = await wait_for(all_wait, timeout=cluster.lease_ttl + 10, what="every one waiting")
    assert {o["waiting"] for o in rows} <= {
        "no live service runs kind 'recorder'",
        "its service is gone: it moves to a live one",
    }, rows
    totals = await _totals(cluster)
    assert (totals["services"], totals["slots"], totals["running"]) == (0, 0, 0), totals
    assert totals["waiting"] == 5, totals

    # A service with room joins: every one runs, nothing waits.
    await cluster.start_service("big", worker_count=10)
    await wait_for(lambda: _totals_are(cluster, running=5, waiting=0), timeout=20, what="5 running")
    mark = time.time()
    await wait_for(
        lambda: _ticking_are(cluster, ids, mark, {str(i) for i in ids}),
        timeout=10,
        what="all five ticking",
    )
    assert all(o["waiting"] is None for o in await _observers(cluster))
    assert_no_overlap(cluster.tick_dir)


async def _totals_are(cluster: Cluster, **want: int) -> bool:
    t = await _totals(cluster)
    return all(t[k] == v for k, v in want.items())
