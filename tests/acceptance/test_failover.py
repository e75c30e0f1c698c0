"""An unplanned failover of the database to an asynchronous standby that lags.

The orchestrator's database is a primary with an asynchronous streaming standby of the test's
own, fed through a proxy that holds the primary's WAL for ``LAG`` seconds
(``tests/support/pg_pair.py``): the common setup, and what most managed databases create by
default. Deletes and creates are acknowledged, the primary is SIGKILLed before they reach the
standby, the standby is promoted. The tail is lost; what must hold is judged from the
observers' own tick logs:

- no two copies of an observer at once;
- no epoch goes back (a promotion raises every fencing token: the epochs carry the timeline);
- an acknowledged delete is final: the manager applies it again, and a deleted observer runs
  no longer than it takes the system to notice;
- the creates the failover lost are reported (``/healthz``), and their copies stop;
- every observer the new primary has runs again; those whose take the failover lost (their
  service was killed just before it) are taken again at an epoch above every earlier one.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from orch_bench.ticklog import overlap_seconds, read_ticks
from tests.conftest import Servers
from tests.support.cluster import Cluster, wait_for
from tests.support.pg_pair import PgPair, missing_binaries

#: Seconds the standby is behind.
LAG = 4.0


@pytest.fixture
async def async_pair() -> AsyncIterator[PgPair]:
    why = missing_binaries()
    if why is not None:
        pytest.skip(why)
    pair = PgPair(synchronous=False, lag=LAG)
    try:
        await pair.start()
        yield pair
    finally:
        pair.close()


@pytest.fixture
async def cluster(
    async_pair: PgPair, servers: Servers, prefix: str, tmp_path: Path
) -> AsyncIterator[Cluster]:
    cluster = Cluster(
        database_url=async_pair.url("orch_failover"),
        amqp_url=servers.amqp_url,
        prefix=prefix,
        workdir=tmp_path,
    )
    try:
        migrate = cluster.spawn("migrate", ["migrate"])
        code = await asyncio.to_thread(migrate.popen.wait, 120)
        assert code == 0, f"orch migrate failed:\n{migrate.tail()}"
        yield cluster
    finally:
        await cluster.stop()


async def _replayed(pair: PgPair, cluster: Cluster) -> None:
    """Wait until the standby replayed everything the primary wrote so far."""
    lsn = await cluster.q("SELECT pg_current_wal_lsn()::text", one=True)
    standby = await asyncpg.connect(pair.dsn(pair.standby_port))
    try:

        async def caught_up() -> bool:
            return bool(
                await standby.fetchval("SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", lsn)
            )

        await wait_for(caught_up, timeout=LAG + 10, what="the standby to replay the primary")
    finally:
        await standby.close()


async def _recorder(cluster: Cluster, name: str) -> uuid.UUID:
    body = await cluster.create(name, "recorder", dir=str(cluster.tick_dir), interval=0.05)
    return uuid.UUID(body["id"])


async def test_an_async_failover_runs_one_copy_keeps_deletes_and_epochs_and_reports_lost_creates(
    async_pair: PgPair, cluster: Cluster
) -> None:
    manager = await cluster.start_manager()
    services = [await cluster.start_service(n, worker_count=20) for n in ("a", "b")]
    kept = await cluster.create_recorders(10)
    doomed = [await _recorder(cluster, f"doomed-{i}") for i in range(2)]
    await cluster.wait_all_running(kept + doomed, timeout=20)
    async with cluster.api() as c:
        shown = (await c.get("/healthz")).json()
    assert shown["database"]["durability"] == "asynchronous", shown
    assert any("asynchronous" in w for w in shown["warnings"]), shown
    await _replayed(async_pair, cluster)

    # Within the standby's lag: b is killed and its observers taken by a, two deletes are
    # answered and carried out, two creates answered.
    acknowledged = time.time()
    on_b = await cluster.q(
        "SELECT id FROM observers WHERE service_id = $1", await cluster.service_id(services[1])
    )
    services[1].signal(signal.SIGKILL)
    moved = [r["id"] for r in on_b if r["id"] in kept]
    await cluster.wait_all_running(moved, timeout=LAG / 2, fresh_after=acknowledged)
    async with cluster.api() as c:
        for oid in doomed:
            r = await c.delete(f"/observers/{oid}")
            assert r.status_code < 300, r.text
    for oid in doomed:
        await cluster.wait_status(oid, "deleted", timeout=LAG / 2)
    late = [await _recorder(cluster, f"late-{i}") for i in range(2)]
    assert time.time() - acknowledged < LAG, "too slow to stay within the standby's lag"
    if cluster.db is not None:  # the test's own pool would hold the dead server's connections
        await cluster.db.close()
        cluster.db = None
    crashed = await async_pair.crash()
    promoted = await async_pair.promote()

    # What the promotion lost, on the new primary.
    rows = {r["id"]: r["status"] for r in await cluster.q("SELECT id, status FROM observers")}
    assert not set(late) & set(rows), "the late creates reached the standby: no tail was lost"
    assert all(rows[o] == "processing" for o in doomed), f"the deletes were not lost: {rows}"

    await cluster.wait_all_running(kept, timeout=30)

    async def deleted_again() -> bool:
        statuses = await cluster.q("SELECT status FROM observers WHERE id = ANY($1)", doomed)
        return all(s["status"] in ("on_deleting", "deleted") for s in statuses)

    await wait_for(deleted_again, timeout=15, what="the lost deletes applied again")

    async def reported() -> list[str]:
        async with cluster.api() as c:
            warnings: list[str] = (await c.get("/healthz")).json()["warnings"]
        return [w for w in warnings if "lost 2 acknowledged creates" in w]

    report = await wait_for(reported, timeout=15, what="the lost creates reported")
    assert all(str(o) in report[0] for o in late), report

    settle = cluster.lease_ttl * 2 + 2.0
    await asyncio.sleep(settle)  # every observer that runs is seen running, the rest stopped
    end = time.time()
    ticks = read_ticks(cluster.tick_dir)
    assert overlap_seconds(ticks) == {}, "two copies of an observer ran at the same time"
    before: dict[str, int] = {}
    for t in ticks:
        if t.at < crashed:
            before[t.observer] = max(before.get(t.observer, 0), t.epoch)
    seen: dict[str, int] = {}
    for t in sorted(ticks, key=lambda t: t.at):
        assert t.epoch >= seen.get(t.observer, 0), f"{t.observer}: its epoch went back"
        seen[t.observer] = t.epoch
    running_at_end = {t.observer for t in ticks if t.at > end - 1.0}
    assert running_at_end == {str(o) for o in kept}, "an observer is not running, or too many"
    gone = {str(o) for o in doomed + late}
    last = max((t.at for t in ticks if t.observer in gone), default=crashed)
    assert last - promoted <= cluster.lease_ttl + 2.0, (
        f"a deleted or lost observer ran {last - promoted:.2f}s after the promotion"
    )
    epochs = {r["id"]: r["epoch"] for r in await cluster.q("SELECT id, epoch FROM observers")}
    for oid in kept:
        assert epochs[oid] >= seen[str(oid)], f"{oid}: the row's epoch is below a copy's"
    taken_after = {
        t.epoch for t in ticks if t.at > promoted and t.epoch > before.get(t.observer, 0)
    }
    assert taken_after, "no observer was taken again after the promotion"
    assert min(taken_after) >= 1 << 32, f"an epoch taken after the promotion: {taken_after}"
    assert manager.alive
    assert services[0].alive
    print(
        f"\nasync failover (lag {LAG:.0f} s): promoted {promoted - crashed:.2f} s after the "
        f"crash; deleted or lost observers last ticked {last - promoted:+.2f} s after it"
    )
