"""Every fence in the database, proven necessary: a stale copy plays its writes against the real
PostgreSQL and each is refused, leaving the row as it was. The take's compare-and-set, its
lease-expiry check and the renewal's expiry check are tried the same way."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from observer_service.ports import Checkpoint, Locked, StartRequest, TakeResult, Written
from observer_service.store import PgLeaseDatabase, PgStore, SessionEnded
from observer_service.take import Decision, Departed
from observer_service.taking import take_many
from orch_contracts.kinds import RestartPolicy
from orch_contracts.messages import StartMessage
from orch_contracts.settings import asyncpg_dsn

ROW_FIELDS = "status, service_id, epoch, checkpoint, restart_count, last_error"


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    dsn = asyncpg_dsn(database_url)
    p = await asyncpg.create_pool(dsn, min_size=1, max_size=4)
    try:
        yield p
    finally:
        await p.close()


async def service(pool: asyncpg.Pool, *, lease: str = "1 minute") -> uuid.UUID:
    sid = uuid.uuid4()
    await pool.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at) "
        f"VALUES ($1, 's', 10, $2, clock_timestamp() + interval '{lease}')",
        sid,
        uuid.uuid4().int >> 65,
    )
    return sid


async def observer(pool: asyncpg.Pool) -> StartMessage:
    start = StartMessage(observer_id=uuid.uuid4(), dispatch_id=uuid.uuid4())
    await pool.execute(
        "INSERT INTO observers (id, name, kind, params, status, dispatch_id) "
        "VALUES ($1, $2, 'ticker', '{}', 'created', $3)",
        start.observer_id,
        f"o-{start.observer_id}",
        start.dispatch_id,
    )
    return start


def lease_database(database_url: str) -> PgLeaseDatabase:
    return PgLeaseDatabase(
        asyncpg_dsn(database_url),
        service_id=uuid.uuid4(),
        name="s",
        worker_count=1,
        host="h",
        version="v",
        connect_timeout=5,
    )


async def row_of(pool: asyncpg.Pool, oid: uuid.UUID) -> dict[str, Any]:
    row = await pool.fetchrow(f"SELECT {ROW_FIELDS} FROM observers WHERE id = $1", oid)
    assert row is not None
    return dict(row)


async def take(
    store: PgStore, start: StartMessage, *, redelivered: bool = False, departed: Any = None
) -> Any:
    """One take, retried while its row is skipped as locked (by a concurrent take), as the
    service's intake retries it."""
    req = StartRequest(start, redelivered=redelivered, running_here=False)
    while True:
        (result,) = await take_many(store, [req], departed or Departed())
        if not isinstance(result, Locked):
            return result
        await asyncio.sleep(0.01)


@pytest.fixture
async def stale(pool: asyncpg.Pool) -> tuple[PgStore, StartMessage]:
    """Service A took X twice: epoch 1 is a stale copy of A's, epoch 2 the current one. The
    holder is the same, so only the epoch tells them apart."""
    a = PgStore(pool, await service(pool))
    start = await observer(pool)
    assert (await take(a, start)).taken.epoch == 1
    assert (await take(a, start)).taken.epoch == 2
    await pool.execute(
        "UPDATE observers SET checkpoint = '{\"n\": 2}', restart_count = 1, "
        "restarted_at = clock_timestamp() "
        "WHERE id = $1",
        start.observer_id,
    )
    return a, start


async def test_a_stale_checkpoint_is_refused(pool: asyncpg.Pool, stale: Any) -> None:
    a, start = stale
    oid = start.observer_id
    before = await row_of(pool, oid)
    assert await a.checkpoint_many([Checkpoint(oid, 1, json.dumps({"n": 1}))]) == [False]
    assert await row_of(pool, oid) == before
    # Both epochs in one batch: the stale one never hides the current one's write.
    both = [Checkpoint(oid, 2, json.dumps({"n": 3})), Checkpoint(oid, 1, json.dumps({"n": 0}))]
    assert await a.checkpoint_many(both) == [True, False]
    assert json.loads((await row_of(pool, oid))["checkpoint"]) == {"n": 3}


async def test_a_stale_release_is_refused(pool: asyncpg.Pool, stale: Any) -> None:
    a, start = stale
    before = await row_of(pool, start.observer_id)
    assert await a.release_many([(start.observer_id, 1)], "stale") == [None]
    assert await row_of(pool, start.observer_id) == before


async def test_a_stale_delete_is_refused(pool: asyncpg.Pool, stale: Any) -> None:
    a, start = stale
    await pool.execute(
        "UPDATE observers SET status = 'on_deleting' WHERE id = $1", start.observer_id
    )
    before = await row_of(pool, start.observer_id)
    assert await a.release_many([(start.observer_id, 1)], "stale") == [None]
    assert await row_of(pool, start.observer_id) == before
    assert [s.value if s else None for s in await a.release_many([(start.observer_id, 2)], "")] == [
        "deleted"
    ]


async def test_a_stale_restart_record_is_refused(pool: asyncpg.Pool, stale: Any) -> None:
    a, start = stale
    before = await row_of(pool, start.observer_id)
    policy = RestartPolicy(max_restarts=0)
    assert await a.record_error((start.observer_id, 1), "stale", policy) is None
    assert await row_of(pool, start.observer_id) == before
    record = await a.record_error((start.observer_id, 2), "current", RestartPolicy())
    assert record is not None
    assert (record.restarts, record.failed) == (2, False), "counted within the window"


async def test_a_stale_failure_is_refused(pool: asyncpg.Pool, stale: Any) -> None:
    a, start = stale
    before = await row_of(pool, start.observer_id)
    assert await a.fail((start.observer_id, 1), "stale") is False
    assert await row_of(pool, start.observer_id) == before


async def test_the_restart_window_heals(pool: asyncpg.Pool, stale: Any) -> None:
    a, start = stale
    await pool.execute(
        "UPDATE observers SET restart_count = 5, restarted_at = clock_timestamp() - interval "
        "'2 hours' WHERE id = $1",
        start.observer_id,
    )
    record = await a.record_error((start.observer_id, 2), "rare", RestartPolicy(max_restarts=5))
    assert record is not None
    assert (record.restarts, record.failed) == (1, False)


async def test_a_take_that_lost_the_race_is_refused(pool: asyncpg.Pool) -> None:
    """The compare-and-set: a take decided on a row that changed meanwhile does not land."""
    a = PgStore(pool, await service(pool))
    b = PgStore(pool, await service(pool))
    start = await observer(pool)
    seen = (await a.read_facts([start.observer_id]))[start.observer_id]
    assert (await take(b, start)).decision is Decision.TAKE
    assert await a.compare_and_set(Decision.TAKE, [seen]) == Written({}, frozenset())
    assert (await row_of(pool, start.observer_id))["service_id"] == b.me


async def test_concurrent_takes_have_one_winner(pool: asyncpg.Pool) -> None:
    stores = [PgStore(pool, await service(pool)) for _ in range(4)]
    start = await observer(pool)
    results = await asyncio.gather(*(take(s, start) for s in stores))
    assert [r.decision for r in results].count(Decision.TAKE) == 1
    assert (await row_of(pool, start.observer_id))["epoch"] == 1


async def test_a_holder_whose_lease_expired_is_taken_over(pool: asyncpg.Pool) -> None:
    a = PgStore(pool, await service(pool))
    b = PgStore(pool, await service(pool))
    start = await observer(pool)
    await take(a, start)
    assert (await take(b, start)).decision is Decision.DROP_DUPLICATE, "A's lease is valid"
    await pool.execute(
        "UPDATE services SET lease_expires_at = clock_timestamp() - interval '1 second' "
        "WHERE id = $1",
        a.me,
    )
    assert (await take(b, start)).decision is Decision.TAKE


async def test_a_free_lock_alone_does_not_let_a_holder_be_taken_over(pool: asyncpg.Pool) -> None:
    """A's lease session ended (its lock is free) but its broker connection lives: wait."""
    a = PgStore(pool, await service(pool))
    b = PgStore(pool, await service(pool))
    start = await observer(pool)
    await take(a, start)
    departed = Departed()
    redelivered = await take(b, start, redelivered=True, departed=departed)
    assert redelivered.decision is Decision.PROBE
    departed.off_broker(redelivered.holder_key)  # what B's probe of the broker found
    assert (await take(b, start, redelivered=True, departed=departed)).taken.epoch == 2


async def _holding_lock(pool: asyncpg.Pool, key: int) -> asyncpg.Connection:
    """A connection of ``pool`` that holds the advisory lock ``key`` (release it after)."""
    conn = await pool.acquire()
    await conn.execute("SELECT pg_advisory_lock($1)", key)
    return conn


async def _two_held_one_probed(
    pool: asyncpg.Pool,
) -> tuple[PgStore, PgStore, StartMessage, Departed, int]:
    """A holds two observers and is gone; B's take of the first asked for a proof (PROBE)."""
    a = PgStore(pool, await service(pool))
    b = PgStore(pool, await service(pool))
    x, y = await observer(pool), await observer(pool)
    await take(a, x)
    await take(a, y)
    departed = Departed()
    probed: TakeResult = await take(b, x, redelivered=True, departed=departed)
    assert probed.decision is Decision.PROBE
    assert probed.holder_key is not None
    return a, b, y, departed, probed.holder_key


async def test_one_proof_of_departure_serves_every_start_its_holder_held(
    pool: asyncpg.Pool,
) -> None:
    """Once A's session is proven over and A off the broker, B takes A's other observers
    without asking again, even while something else holds A's old lock key for an instant
    (the manager's sweeper trying it): a key is never used by a new session."""
    _, b, y, departed, key = await _two_held_one_probed(pool)
    departed.off_broker(key)
    busy = await _holding_lock(pool, key)
    try:
        assert (await take(b, y, redelivered=True)).decision is Decision.WAIT, "no proof: wait"
        assert (await take(b, y, redelivered=True, departed=departed)).taken.epoch == 2
    finally:
        await busy.execute("SELECT pg_advisory_unlock_all()")
        await pool.release(busy)


async def test_a_holder_back_on_a_new_session_is_not_covered_by_an_old_proof(
    pool: asyncpg.Pool,
) -> None:
    a, b, y, departed, key = await _two_held_one_probed(pool)
    departed.off_broker(key)
    new_key = key + 1
    await pool.execute("UPDATE services SET lock_key = $2 WHERE id = $1", a.me, new_key)
    session = await _holding_lock(pool, new_key)  # A rejoined: a new session, a new key
    try:
        assert (await take(b, y, redelivered=True, departed=departed)).decision is Decision.WAIT
    finally:
        await session.execute("SELECT pg_advisory_unlock_all()")
        await pool.release(session)


async def test_a_renewal_never_revives_an_expired_lease(database_url: str) -> None:
    dsn = asyncpg_dsn(database_url)
    sid = uuid.uuid4()
    ended: list[bool] = []
    db = PgLeaseDatabase(
        dsn, service_id=sid, name="s", worker_count=1, host="h", version="v", connect_timeout=5
    )
    session = await db.connect(lambda: ended.append(True))
    try:
        await session.join(ttl=60)
        assert await session.renew(60, timeout=5) is not None
        await session.conn.execute(
            "UPDATE services SET lease_expires_at = clock_timestamp() - interval '1 second' "
            "WHERE id = $1",
            sid,
        )
        assert await session.renew(60, timeout=5) is None
        assert (
            await session.conn.fetchval("SELECT is_deleted FROM services WHERE id = $1", sid)
            is False
        )
        await session.conn.execute("UPDATE services SET is_deleted = true WHERE id = $1", sid)
        assert await session.renew(60, timeout=5) is None
    finally:
        await session.close(deleted=False)
    assert ended == [], "a session we closed is not reported as ended"


async def test_a_lease_statement_a_migration_made_stale_ends_the_session(
    database_url: str, pool: asyncpg.Pool
) -> None:
    """The lease's statements are parsed when its session opens. A migration that changes what
    the renewal reads makes them stale ("cached plan must not change result type"): the
    renewal ends the session (the keeper bridges onto a new one, parsed afresh) rather than
    raising a PostgreSQL error that ended the service."""
    ended: list[bool] = []
    db = lease_database(database_url)
    session = await db.connect(lambda: ended.append(True))
    try:
        await session.join(ttl=60)
        assert await session.renew(60, timeout=5) is not None
        await pool.execute(
            "ALTER TABLE services ALTER COLUMN draining DROP DEFAULT, "
            "ALTER COLUMN draining TYPE int USING draining::int"
        )
        with pytest.raises(SessionEnded, match="parsed again"):
            await session.renew(60, timeout=5)
        assert session.ended
        for _ in range(100):  # the driver calls its termination listeners soon after
            if ended:
                break
            await asyncio.sleep(0.01)
        assert ended == [True]
        again = await db.connect(lambda: None)
        try:
            assert await again.renew(60, timeout=5) is not None, "a new session renews"
        finally:
            await again.close(deleted=False)
    finally:
        await session.close(deleted=False)


async def test_a_lease_session_ended_by_the_server_is_reported(
    database_url: str, pool: asyncpg.Pool
) -> None:
    ended = asyncio.Event()
    db = lease_database(database_url)
    session = await db.connect(ended.set)
    await session.join(ttl=60)
    pid = await session.conn.fetchval("SELECT pg_backend_pid()")
    await pool.execute("SELECT pg_terminate_backend($1)", pid)
    await asyncio.wait_for(ended.wait(), 5)
    assert session.ended


async def test_a_new_lease_session_renews_without_type_introspection(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new session's first renewal is its bridge after the old one ended, on a link that may
    be slow: no round trips beyond the statement's own (asyncpg introspects a uuid[] result)."""
    looked_up: list[object] = []
    introspect = asyncpg.Connection._introspect_types

    async def spy(self: asyncpg.Connection, *args: Any, **kwargs: Any) -> Any:
        looked_up.append(args[0] if args else None)
        return await introspect(self, *args, **kwargs)

    monkeypatch.setattr(asyncpg.Connection, "_introspect_types", spy)
    db = lease_database(database_url)
    session = await db.connect(lambda: None)
    try:
        await session.join(ttl=60)
        renewal = await session.renew(ttl=60, timeout=5)
        await session.held(timeout=5)
    finally:
        await session.close(deleted=True)
    assert renewal is not None
    assert renewal.deleting == []
    assert looked_up == [], "the lease session's statements cost a type introspection"


async def test_a_takeover_lands_only_while_the_holder_keeps_the_key_found_free(
    pool: asyncpg.Pool,
) -> None:
    """B found A's lock free and A off the broker, but A came back on a new session (a renewal
    that published a new key) before B's write: B's take does not land. A's look at its rows
    after that renewal therefore sees every take that did."""
    a, b, _, departed, key = await _two_held_one_probed(pool)
    departed.off_broker(key)
    (x,) = await pool.fetch(
        "SELECT observer_id FROM observer_events WHERE service_id = $1 AND event = 'taken' "
        "ORDER BY id LIMIT 1",
        a.me,
    )
    start = StartMessage(
        observer_id=x["observer_id"],
        dispatch_id=await pool.fetchval(
            "SELECT dispatch_id FROM observers WHERE id = $1", x["observer_id"]
        ),
    )
    seen = (await b.read_facts([start.observer_id]))[start.observer_id]
    await pool.execute(
        "UPDATE services SET lock_key = lock_key + 1 WHERE id = $1", a.me
    )  # A's renewal on its new session
    assert await b.compare_and_set(Decision.TAKE, [seen]) == Written({}, frozenset())
    assert (await row_of(pool, start.observer_id))["service_id"] == a.me


async def test_a_holder_on_a_new_session_sees_what_was_taken_meanwhile(
    database_url: str, pool: asyncpg.Pool
) -> None:
    db = lease_database(database_url)
    session = await db.connect(lambda: None)
    try:
        await session.join(ttl=60)
        a = PgStore(pool, db.service_id)
        b = PgStore(pool, await service(pool))
        x, y = await observer(pool), await observer(pool)
        await take(a, x)
        await take(a, y)
        await pool.execute(
            "UPDATE observers SET service_id = $2, epoch = epoch + 1 WHERE id = $1",
            x.observer_id,
            b.me,
        )  # B's take
        assert await session.renew(60, timeout=5) is not None
        assert await session.held(timeout=5) == {(y.observer_id, 1)}
    finally:
        await session.close(deleted=False)
