"""The observer counts the triggers keep (``observer_counts``, migration 0015): right after every
kind of write, a checkpoint adds nothing to them, the leader's fold leaves them right while
writes go on, and what reads them (a service's held count, the console's totals, the pools'
loads) reads them."""

from __future__ import annotations

import asyncio
import secrets
import uuid

import asyncpg

from observer_service import queries as service_queries
from orch_contracts.settings import asyncpg_dsn
from orch_manager import repository as repo
from orch_manager.store import ManagerStore
from tests.conftest import COUNTS_WRONG


async def _service(conn: asyncpg.Connection) -> uuid.UUID:
    sid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at) "
        "VALUES ($1, $2, 100, $3, now() + interval '1 minute')",
        sid,
        f"s-{sid}",
        secrets.randbits(63),
    )
    return sid


async def _create(conn: asyncpg.Connection, n: int, kind: str = "ticker") -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(n)]
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id) "
        "SELECT i, 'o-' || i, $2, 'created', gen_random_uuid() FROM unnest($1::uuid[]) AS i",
        ids,
        kind,
    )
    return ids


async def _take(conn: asyncpg.Connection, ids: list[uuid.UUID], sid: uuid.UUID) -> None:
    await conn.execute(
        "UPDATE observers SET status = 'processing', service_id = $2, epoch = epoch + 1 "
        "WHERE id = ANY($1)",
        ids,
        sid,
    )


async def _wrong(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return list(await conn.fetch(COUNTS_WRONG))


async def _rows(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT count(*) FROM observer_counts"))


async def test_the_counts_follow_every_write(db: tuple[asyncpg.Connection, ManagerStore]) -> None:
    conn, store = db
    a, b = await _service(conn), await _service(conn)
    ids = await _create(conn, 30)
    await _create(conn, 5, kind="recorder")
    assert not await _wrong(conn)
    await _take(conn, ids[:20], a)
    await _take(conn, ids[20:25], b)
    await conn.execute("UPDATE observers SET service_id = $2 WHERE id = ANY($1)", ids[:3], b)
    await conn.execute("UPDATE observers SET status = 'on_deleting' WHERE id = $1", ids[3])
    await conn.execute("UPDATE observers SET pool = 'gpu' WHERE id = $1", ids[26])
    await conn.execute("DELETE FROM observers WHERE id = ANY($1)", ids[27:])
    assert not await _wrong(conn)
    held = await conn.fetchval(service_queries.HELD_COUNT, a)
    assert held == 17  # 20 taken, 3 moved to b; the one on_deleting is still held
    assert await conn.fetchval(service_queries.HELD_COUNT, b) == 8
    async with store.autocommit() as tx:
        totals = await repo.status_totals(tx)
        loads, unheld = await repo.pool_loads(tx)
    assert totals == {"created": 7, "processing": 24, "on_deleting": 1}
    assert loads["default"].running == 25  # held: the one on_deleting too
    assert unheld == {"default": 6, "gpu": 1}
    await conn.execute("TRUNCATE observers CASCADE")
    assert not await _wrong(conn)
    assert await conn.fetchval(service_queries.HELD_COUNT, a) == 0


async def test_a_checkpoint_adds_no_count_row(db: tuple[asyncpg.Connection, ManagerStore]) -> None:
    """Checkpoints and renewals are most of a fleet's writes: the trigger is not even called
    for a write that leaves the row's key as it was."""
    conn, store = db
    sid = await _service(conn)
    ids = await _create(conn, 50)
    await _take(conn, ids, sid)
    async with store.transaction() as tx:
        await repo.fold_counts(tx)
    before = await _rows(conn)
    await conn.execute(
        "UPDATE observers SET checkpoint = '{\"n\": 1}', checkpointed_at = now() "
        "WHERE id = ANY($1)",
        ids,
    )
    assert await _rows(conn) == before
    assert before == 1  # one key: processing on sid


async def test_the_fold_keeps_the_counts_right_while_writes_go_on(
    db: tuple[asyncpg.Connection, ManagerStore], database_url: str
) -> None:
    """Writes on other connections commit while the leader folds: none of their rows is lost
    or counted twice, and each fold leaves one row per key."""
    conn, store = db
    services = [await _service(conn) for _ in range(3)]
    ids = await _create(conn, 300)
    writer = await asyncpg.connect(asyncpg_dsn(database_url))
    stop = asyncio.Event()

    async def write() -> None:
        i = 0
        while not stop.is_set():
            chunk = ids[(i * 10) % 300 : (i * 10) % 300 + 10]
            await _take(writer, chunk, services[i % 3])
            i += 1

    async def fold() -> None:
        for _ in range(40):
            async with store.transaction() as tx:
                await repo.fold_counts(tx)
            await asyncio.sleep(0)

    try:
        writing = asyncio.create_task(write())
        await fold()
        stop.set()
        await writing
    finally:
        await writer.close()
    assert not await _wrong(conn)
    async with store.transaction() as tx:
        await repo.fold_counts(tx)
    keys = await conn.fetchval(
        "SELECT count(*) FROM (SELECT DISTINCT status, kind, pool, service_id FROM observers) k"
    )
    assert await _rows(conn) == keys
