"""Retention against the real database: only old deleted observers and unreferenced dead
services go; a live observer is never touched, whatever its age; histories are capped."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import asyncpg

from orch_contracts.statuses import ObserverStatus
from orch_manager.background import Pruner
from orch_manager.store import ManagerStore

OLD = "interval '30 days'"


async def _observer(conn: asyncpg.Connection, status: str, *, old: bool) -> uuid.UUID:
    oid = uuid.uuid4()
    age = f"now() - {OLD}" if old else "now()"
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id, modified_at, created_at) "
        f"VALUES ($1, $2, 'ticker', $3, $4, {age}, {age})",
        oid,
        f"o-{oid}",
        status,
        uuid.uuid4(),
    )
    await conn.execute(
        "INSERT INTO observer_events (observer_id, event) VALUES ($1, 'created')", oid
    )
    return oid


async def _taken(conn: asyncpg.Connection, oid: uuid.UUID, details: Iterable[int]) -> None:
    """History rows "taken" of one observer, their detail each number in turn."""
    for i in details:
        await conn.execute(
            "INSERT INTO observer_events (observer_id, event, detail) VALUES ($1, 'taken', $2)",
            oid,
            str(i),
        )


async def _service(conn: asyncpg.Connection, *, deleted: bool, old: bool) -> uuid.UUID:
    sid = uuid.uuid4()
    age = f"now() - {OLD}" if old else "now()"
    await conn.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at, is_deleted, "
        f"modified_at) VALUES ($1, 's', 1, 1, now(), $2, {age})",
        sid,
        deleted,
    )
    return sid


async def test_pruning_never_touches_a_live_observer(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    conn, store = db
    keep = {s: await _observer(conn, s.value, old=True) for s in ObserverStatus if s != "deleted"}
    recent_deleted = await _observer(conn, "deleted", old=False)
    old_deleted = await _observer(conn, "deleted", old=True)
    gone_service = await _service(conn, deleted=True, old=True)
    referenced = await _service(conn, deleted=True, old=True)
    await conn.execute(
        "UPDATE observers SET service_id = $1 WHERE id = $2",
        referenced,
        keep[ObserverStatus.PROCESSING],
    )
    live_service = await _service(conn, deleted=False, old=True)

    pruner = Pruner(store, keep=7 * 86_400, keep_services=86_400, max_events=10)
    pruned = await pruner.once()
    assert (pruned.observers, pruned.services) == (1, 1)

    left = {r["id"] for r in await conn.fetch("SELECT id FROM observers")}
    assert left == {*keep.values(), recent_deleted}, "only the old deleted one went"
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM observer_events WHERE observer_id = $1", old_deleted
        )
        == 0
    ), "its history went with it"
    services = {r["id"] for r in await conn.fetch("SELECT id FROM services")}
    assert services == {referenced, live_service}
    assert gone_service not in services


async def test_histories_are_capped_to_the_newest(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    conn, store = db
    oid = await _observer(conn, "processing", old=False)
    await _taken(conn, oid, range(25))
    pruner = Pruner(store, keep=7 * 86_400, keep_services=86_400, max_events=10)
    await pruner.once()
    rows = await conn.fetch(
        "SELECT detail FROM observer_events WHERE observer_id = $1 ORDER BY id", oid
    )
    assert [r["detail"] for r in rows] == [str(i) for i in range(15, 25)]
    assert (await pruner.once()).trimmed == 0, "nothing new to look at"


async def test_a_first_pass_looks_at_the_newest_history_only(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    """A new leader does not read every history row: an observer whose history outgrew the cap
    before its window is trimmed at its next event."""
    conn, store = db
    early = await _observer(conn, "processing", old=False)
    await _taken(conn, early, range(25))
    for _ in range(30):
        await _observer(conn, "processing", old=False)  # one history row each, after
    pruner = Pruner(store, keep=7 * 86_400, keep_services=86_400, max_events=10, first_look=20)
    assert (await pruner.once()).trimmed == 0, "the early history is out of the first look"
    await _taken(conn, early, [25])
    assert (await pruner.once()).trimmed == 1
    n = await conn.fetchval("SELECT count(*) FROM observer_events WHERE observer_id = $1", early)
    assert n == 10
