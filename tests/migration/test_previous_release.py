"""The previous release runs unchanged on this release's schema.

Migrations run before the new release's processes start (``docs/upgrading.md``, *Order*), so
for as long as a roll takes, the old release's managers and services run on a schema migrated
by the new one. Here a database migrated to head by this tree carries a manager and a service of
the previous release (``tests.support.releases``: its git tag checked out, its own packages
imported, its own test kinds), as real processes; observers created through the old manager's
API run there, judged from their own tick logs, and one deleted through it stops.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from orch_bench.ticklog import read_ticks
from orch_migrations import alembic_config
from tests.conftest import Servers
from tests.support.cluster import quiet, wait_for
from tests.support.faults import assert_no_overlap
from tests.support.releases import HEAD, MixedCluster, Release, mixed_cluster, previous_release

#: Observers created one by one, and more in one batch (the old manager's two create paths).
SINGLE, BATCH = 3, 3
#: Their tick interval, seconds: 10 ticks a second each.
INTERVAL = 0.1


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    with previous_release(tmp_path_factory.mktemp("releases")) as release:
        yield release


async def _columns(cluster: MixedCluster) -> set[str]:
    rows = await cluster.q(
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_schema = 'public' AND table_name <> 'alembic_version'"
    )
    return {f"{r['table_name']}.{r['column_name']}" for r in rows}


def _columns_known_to(release: Release) -> set[str]:
    """The columns the release's own models (``contracts/tables.py``) declare."""
    code = (
        "import json\n"
        f"from {release.prefix}contracts.tables import Base\n"
        "print(json.dumps([f'{t.name}.{c.name}' for t in Base.metadata.sorted_tables "
        "for c in t.columns]))"
    )
    return set(json.loads(release.python("-c", code).strip().splitlines()[-1]))


def _ticks_by_observer(tick_dir: Path, after: float) -> dict[str, list[int]]:
    """Per observer, the pids of the processes that wrote its ticks after ``after``."""
    out: dict[str, list[int]] = {}
    for t in read_ticks(tick_dir):
        if t.at > after:
            out.setdefault(t.observer, []).append(t.pid)
    return out


async def test_previous_release_runs_on_this_releases_schema(
    servers: Servers, database_url: str, prefix: str, tmp_path: Path, previous: Release
) -> None:
    """On a database migrated to head by this tree, a v0.1.0 manager and service (their own
    code, shown by where they import it from) start, take observers created through the old
    API one by one and in a batch, run them (each ticks again and again, only in the old
    service, and its checkpoints advance), list them, and stop and delete the one deleted
    through the old API; no two copies of an observer ever ran at once."""
    previous.assert_imported_from_here()
    assert previous.imports()["orch"] != HEAD.imports()["orch"]

    async with mixed_cluster(
        database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix, workdir=tmp_path
    ) as cluster:
        # The schema is this tree's head, which continues the old release's chain and has
        # columns the old release's models do not know.
        script = ScriptDirectory.from_config(alembic_config(database_url))
        assert await cluster.revision() in script.get_heads()
        for old_head in previous.alembic_heads():
            assert script.get_revision(old_head) is not None, f"{old_head} left the chain"
        unknown = await _columns(cluster) - _columns_known_to(previous)
        print(f"columns {previous.name} does not know: {sorted(unknown)}")
        assert unknown, f"the schema has nothing {previous.name} lacks: nothing is proven"

        await cluster.start_manager_of(previous)
        svc = await cluster.start_service_of(previous, "old", worker_count=10)
        sid = await cluster.service_id(svc)
        # An old service advertises no kinds: its row says NULL, read as "runs every kind".
        assert await cluster.q("SELECT kinds FROM services WHERE id = $1", sid, one=True) is None

        started = time.time()
        ids = await cluster.create_recorders(SINGLE, interval=INTERVAL)
        params = {"dir": str(cluster.tick_dir), "interval": INTERVAL}
        batch = [{"name": f"batch-{i}", "kind": "recorder", "params": params} for i in range(BATCH)]
        async with cluster.api() as api:
            r = await api.post("/observers/batch", json={"observers": batch})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["created"] == BATCH, body
            ids += [uuid.UUID(item["observer"]["id"]) for item in body["items"]]
        await cluster.wait_all_running(ids, timeout=15, on={sid})

        # They run: each ticked several times since it was created, in the old service alone.
        async def ticking() -> bool:
            seen = _ticks_by_observer(cluster.tick_dir, started)
            return all(len(seen.get(str(i), [])) >= 5 for i in ids)

        await wait_for(ticking, timeout=10, what="every observer ticking")
        assert {t.pid for t in read_ticks(cluster.tick_dir)} == {svc.pid}
        before = {i: await cluster.checkpoint_count(i) for i in ids}

        async def advanced() -> bool:
            now = {i: await cluster.checkpoint_count(i) for i in ids}
            return all(now[i] > before[i] + 2 for i in ids)

        await wait_for(advanced, timeout=10, what="checkpoints advancing")

        # The old manager reads them back from the newer schema.
        async with cluster.api() as api:
            page = (await api.get("/observers", params={"limit": 100})).json()
            listed = {uuid.UUID(o["id"]): o["status"] for o in page["items"]}
            assert listed == dict.fromkeys(ids, "processing")
            one = (await api.get(f"/observers/{ids[0]}")).json()
            assert one["service_id"] == str(sid)
            assert one["checkpoint"]["count"] > 0

            # A delete through the old API stops the copy; the others go on.
            victim = ids[-1]
            r = await api.delete(f"/observers/{victim}")
            assert r.status_code == 202, r.text
        await cluster.wait_status(victim, "deleted", timeout=10)
        deleted_at = time.time()
        await quiet(1.0, "a copy still running would tick 10 times")
        after = _ticks_by_observer(cluster.tick_dir, deleted_at)
        assert str(victim) not in after, "the deleted observer still ticks"
        assert all(len(after.get(str(i), [])) >= 3 for i in ids[:-1]), after

        assert_no_overlap(cluster.tick_dir)
        # The old service stops gracefully on this schema too: it releases what it ran.
        assert await cluster.stop_gracefully(svc) == 0
        rows = await cluster.q(
            "SELECT status, service_id FROM observers WHERE id = ANY($1)", ids[:-1]
        )
        assert all(r["status"] == "processing" and r["service_id"] is None for r in rows), rows
        assert await cluster.q("SELECT is_deleted FROM services WHERE id = $1", sid, one=True)
        assert cluster.errors() == []
