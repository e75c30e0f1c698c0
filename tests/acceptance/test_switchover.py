"""A planned PostgreSQL switchover under a running cluster.

The orchestrator's database is a primary with a synchronous streaming standby of the test's own
(``tests/support/pg_pair.py``); every process is given a multi-host URL with
``target_session_attrs=read-write``. The primary is stopped cleanly, the standby is checked to
have replayed all of it and is promoted. Judged from the observers' own tick logs and the rows
on the promoted server: each observer ran once at a time, none was lost, nothing committed was
lost, no epoch went backwards.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from orch_bench.ticklog import largest_gaps, overlap_seconds, read_ticks
from tests.conftest import Servers
from tests.support.cluster import Cluster, migrated_cluster, quiet, wait_for
from tests.support.faults import LEASE_BACKEND
from tests.support.pg_pair import PgPair, missing_binaries


@pytest.fixture
async def pg_pair() -> AsyncIterator[PgPair]:
    why = missing_binaries()
    if why is not None:
        pytest.skip(why)
    pair = PgPair()
    try:
        await pair.start()
        yield pair
    finally:
        pair.close()


@pytest.fixture(params=["primary,standby", "standby,primary"])
async def pair_cluster(
    request: pytest.FixtureRequest, pg_pair: PgPair, servers: Servers, prefix: str, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """The cluster's processes on the pair, the database made by ``orch migrate`` through the
    multi-host URL (in either order: ``target_session_attrs`` skips the standby)."""
    url = pg_pair.url("orch_switchover", hosts=request.param)
    async with migrated_cluster(url, servers.amqp_url, prefix, tmp_path) as cluster:
        yield cluster


async def _epochs(cluster: Cluster) -> dict[uuid.UUID, int]:
    return {r["id"]: r["epoch"] for r in await cluster.q("SELECT id, epoch FROM observers")}


@pytest.mark.processes
async def test_switchover_loses_nothing_and_runs_each_observer_once(
    pg_pair: PgPair, pair_cluster: Cluster, record_property: Callable[[str, object], None]
) -> None:
    cluster = pair_cluster
    began = time.monotonic()
    manager = await cluster.start_manager()
    services = [await cluster.start_service(n, worker_count=10) for n in ("a", "b")]
    service_ids = [await cluster.service_id(s) for s in services]
    ids = await cluster.create_recorders(8)
    await cluster.wait_all_running(ids, timeout=20)
    # Two more, committed the moment before the primary stops: a synchronous standby has them.
    for i in range(2):
        body = await cluster.create(
            f"late-{i}", "recorder", dir=str(cluster.tick_dir), interval=0.05
        )
        ids.append(uuid.UUID(body["id"]))
    before = await _epochs(cluster)
    assert set(before) == set(ids)
    # The test's own pool would hold connections to the stopped server.
    if cluster.db is not None:
        await cluster.db.close()
        cluster.db = None

    switch = await pg_pair.switchover()

    assert await cluster.q("SELECT inet_server_port()", one=True) == pg_pair.standby_port
    await cluster.wait_all_running(ids, timeout=30, fresh_after=switch.promoted)
    for sid in service_ids:  # each lease session is on the promoted server now

        async def locked(sid: uuid.UUID = sid) -> bool:
            return bool(await cluster.q(LEASE_BACKEND, sid, one=True))

        await wait_for(locked, timeout=10, what=f"the lease lock of {sid} on the new primary")
    await quiet(2.0, "a copy that kept running through the switchover would tick beside its taker")
    end = time.time()

    after = await _epochs(cluster)
    lost = set(before) - set(after)
    assert not lost, f"observers committed before the switchover are gone: {lost}"
    backwards = {o: (before[o], after[o]) for o in before if after[o] < before[o]}
    assert not backwards, f"epochs went backwards (before, after): {backwards}"

    ticks = read_ticks(cluster.tick_dir)
    assert overlap_seconds(ticks) == {}, "two copies of an observer ran at the same time"
    last_epoch: dict[str, int] = {}
    for t in ticks:
        assert t.epoch >= last_epoch.get(t.observer, 0), f"{t.observer} ticked at an older epoch"
        last_epoch[t.observer] = t.epoch
    ticking_after = {t.observer for t in ticks if t.at > end - 1.0}
    assert ticking_after == {str(i) for i in ids}, "an observer stopped ticking"
    assert manager.alive
    assert all(s.alive for s in services)

    gaps = largest_gaps(ticks, switch.stop_started, end)
    worst = max(gaps.values())
    moved = sum(1 for o in ids if after[o] > before[o])
    record_property("switchover_outage_s", round(switch.outage, 3))
    record_property("switchover_tick_gap_max_s", round(worst, 3))
    stop, promote = switch.stopped - switch.stop_started, switch.promoted - switch.caught_up
    print(
        f"\nswitchover ({cluster.database_url}): database outage {switch.outage:.2f} s (stop "
        f"{stop:.2f} s, promote {promote:.2f} s); tick gap max {worst:.2f} s, "
        f"median {sorted(gaps.values())[len(gaps) // 2]:.2f} s; {moved}/{len(ids)} observers "
        f"taken again with a new epoch; test {time.monotonic() - began:.1f} s"
    )
