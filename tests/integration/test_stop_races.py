"""A delete or a pause that meets a take: the stop must see the copy the take made, whatever
order the two transactions commit in (the source article's "a delete arrives while the observer
is being redistributed")."""

from __future__ import annotations

import asyncio
import secrets
import uuid

import asyncpg
import pytest

from orch.cluster import wait_for
from orch_contracts.settings import asyncpg_dsn
from orch_manager import repository as repo
from orch_manager.store import ManagerStore


async def _service(conn: asyncpg.Connection, *, live: bool) -> uuid.UUID:
    sid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at, is_deleted) "
        "VALUES ($1, $2, 10, $3, now() + make_interval(secs => $4), $5)",
        sid,
        f"s-{sid}",
        secrets.randbits(63),
        60 if live else -60,
        not live,
    )
    return sid


@pytest.mark.parametrize(
    ("stop", "stopping"),
    [(repo.delete_observer, "on_deleting"), (repo.pause_observer, "pausing")],
)
async def test_a_stop_waiting_on_a_take_sees_the_new_holder_and_broadcasts_its_cancel(
    db: tuple[asyncpg.Connection, ManagerStore],
    database_url: str,
    stop: repo.Change,
    stopping: str,
) -> None:
    """Its holder crashed; another service takes it (row locked, not yet committed) while the
    stop comes in and waits for that lock. Once the take commits, the stop must find the new,
    live holder: the row becomes ``stopping`` and a cancel is broadcast. Answered at once as
    "nothing runs it", the new copy ran on (12 s after a delete was acknowledged; a pause then
    resumed beside it: two copies)."""
    conn, store = db
    dead, taker = await _service(conn, live=False), await _service(conn, live=True)
    oid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id, service_id, epoch) "
        "VALUES ($1, $2, 'ticker', 'processing', $3, $4, 1)",
        oid,
        f"o-{oid}",
        uuid.uuid4(),
        dead,
    )
    async with conn.transaction():  # the take, as the service writes it: the row locked
        await conn.execute(
            "UPDATE observers SET service_id = $2, epoch = epoch + 1 WHERE id = $1", oid, taker
        )

        async def stopped() -> tuple[dict[str, object], list[repo.Pending]]:
            async with store.transaction() as tx:
                return await stop(tx, oid)

        waiting = asyncio.create_task(stopped())
        watch = await asyncpg.connect(asyncpg_dsn(database_url))

        async def blocked() -> bool:  # the stop waits for the take's row lock
            return bool(await watch.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted"))

        try:
            await wait_for(blocked, timeout=10, what="the stop waiting for the take's lock")
        finally:
            await watch.close()
        assert not waiting.done()
    row, pending = await asyncio.wait_for(waiting, 10)
    assert row["status"] == stopping
    assert [type(p.message).__name__ for p in pending] == ["CancelMessage"]
    assert row["epoch"] == 2
