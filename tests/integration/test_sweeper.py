"""The leader's sweeper against the real database: a service is declared gone only while the
lease session it was seen without is still the one its row names, never after it came back."""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from observer_service import queries as service_queries
from orch.cluster import wait_for
from orch_contracts.pools import DEFAULT_POOL
from orch_contracts.settings import asyncpg_dsn
from orch_manager import repository as repo
from orch_manager.background import Sweeper
from orch_manager.metrics import ManagerMetrics
from orch_manager.store import ManagerStore


class _Broker:
    """The sweeper's view of the broker: nobody is present; ``before_answer`` runs first."""

    def __init__(self) -> None:
        self.before_answer: Callable[[], Awaitable[None]] | None = None

    async def service_present(self, _sid: uuid.UUID) -> bool:
        if self.before_answer is not None:
            await self.before_answer()
        return False


class _Box:
    def publish_soon(self, _pending: Any) -> None:
        return None


async def _held_by_a_live_service(conn: asyncpg.Connection) -> tuple[uuid.UUID, uuid.UUID]:
    sid, oid = uuid.uuid4(), uuid.uuid4()
    await conn.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at) "
        "VALUES ($1, 'a', 10, $2, now() + interval '1 minute')",
        sid,
        secrets.randbits(63),  # nobody holds that lock: its session has ended
    )
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id, service_id, epoch) "
        "VALUES ($1, $2, 'ticker', 'processing', $3, $4, 1)",
        oid,
        f"o-{oid}",
        uuid.uuid4(),
        sid,
    )
    return sid, oid


async def test_a_service_back_on_a_new_session_is_not_declared_gone(
    db: tuple[asyncpg.Connection, ManagerStore], database_url: str
) -> None:
    """Seen without its session and off the broker once; before the second look's verdict it
    rejoins on a new session (a new lock key, held) and runs its observer again. Declaring it
    gone then would hand that observer to another service while it still runs here."""
    conn, store = db
    sid, oid = await _held_by_a_live_service(conn)
    broker = _Broker()
    sweeper = Sweeper(store, _Box(), broker, margin=1.0, metrics=ManagerMetrics())  # type: ignore[arg-type]
    await sweeper.once()
    assert sid in sweeper.suspects, "first look: its lock is free and it is off the broker"
    rejoined = await asyncpg.connect(asyncpg_dsn(database_url))
    try:

        async def rejoin() -> None:  # while the sweeper asks the broker the second time
            key = secrets.randbits(63)
            await rejoined.execute("SELECT pg_advisory_lock($1)", key)
            await rejoined.execute(
                "UPDATE services SET lock_key = $2, lease_expires_at = now() + interval "
                "'1 minute' WHERE id = $1",
                sid,
                key,
            )

        broker.before_answer = rejoin
        await sweeper.once()
        row = await conn.fetchrow("SELECT is_deleted FROM services WHERE id = $1", sid)
        assert row is not None
        assert not row["is_deleted"], "a service back on a new session was declared gone"
        held = await conn.fetchval("SELECT service_id FROM observers WHERE id = $1", oid)
        assert held == sid, "its observer was re-dispatched while it runs it"
    finally:
        await rejoined.close()


async def test_a_service_gone_twice_in_a_row_is_declared_gone(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    conn, store = db
    sid, oid = await _held_by_a_live_service(conn)
    metrics = ManagerMetrics()
    sweeper = Sweeper(store, _Box(), _Broker(), margin=1.0, metrics=metrics)  # type: ignore[arg-type]
    await sweeper.once()
    await sweeper.once()
    assert await conn.fetchval("SELECT is_deleted FROM services WHERE id = $1", sid)
    assert await conn.fetchval("SELECT service_id FROM observers WHERE id = $1", oid) is None
    counted = metrics.registry.get_sample_value(
        "orch_redispatches_total", {"reason": "holder_gone"}
    )
    assert counted == 1, "the re-dispatch was not counted"


def _requeue_sweeper(store: ManagerStore, *, grace: float, patience: float = 60.0) -> Sweeper:
    return Sweeper(
        store,
        _Box(),  # type: ignore[arg-type]
        _Broker(),  # type: ignore[arg-type]
        margin=1.0,
        metrics=ManagerMetrics(),
        requeue_grace=grace,
        requeue_patience=patience,
    )


async def _gone(conn: asyncpg.Connection, sweeper: Sweeper, sid: uuid.UUID) -> Sweeper:
    """Two sweeps: the service (off the broker, its lock free) is proven gone."""
    await sweeper.once()
    await sweeper.once()
    assert await conn.fetchval("SELECT is_deleted FROM services WHERE id = $1", sid)
    return sweeper


async def _holder(conn: asyncpg.Connection, oid: uuid.UUID) -> uuid.UUID | None:
    held: uuid.UUID | None = await conn.fetchval(
        "SELECT service_id FROM observers WHERE id = $1", oid
    )
    return held


async def _redispatched(
    conn: asyncpg.Connection, sweeper: Sweeper, oid: uuid.UUID, what: str
) -> None:
    """Sweep until ``oid`` is re-dispatched (nobody holds it), at most 5 s."""

    async def done() -> bool:
        await sweeper.once()
        return await _holder(conn, oid) is None

    await wait_for(done, timeout=5, what=what)


async def test_of_a_service_proven_gone_only_directed_observers_are_redispatched_at_once(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    """Its connection closed, so the broker requeued the deliveries of the observers that came
    by the work queue: those wait for the requeue (``requeue_grace``), then are re-dispatched
    too; the one that came directed is re-dispatched at once."""
    conn, store = db
    sid, directed = await _held_by_a_live_service(conn)
    queued = uuid.uuid4()
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id, service_id, epoch, "
        "queued_epoch) VALUES ($1, $2, 'ticker', 'processing', $3, $4, 1, 1)",
        queued,
        f"o-{queued}",
        uuid.uuid4(),
        sid,
    )
    sweeper = await _gone(conn, _requeue_sweeper(store, grace=0.5), sid)
    assert await _holder(conn, directed) is None, "the directed one waits for nothing"
    assert await _holder(conn, queued) == sid, "re-dispatched while the requeue carries it"

    await _redispatched(conn, sweeper, queued, "the requeue's grace to end")


async def _queued(conn: asyncpg.Connection, holder: uuid.UUID | None) -> uuid.UUID:
    """An observer running as it came by the work queue (its delivery held), on ``holder``."""
    oid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO observers (id, name, kind, status, dispatch_id, service_id, epoch, "
        "queued_epoch, started_at) VALUES ($1, $2, 'ticker', 'processing', $3, $4, 1, "
        "CASE WHEN $4::uuid IS NULL THEN NULL ELSE 1 END, now())",
        oid,
        f"o-{oid}",
        uuid.uuid4(),
        holder,
    )
    return oid


async def test_queued_observers_wait_while_their_services_requeue_is_worked_through(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    """Past the grace, a gone service's queued observer is still left to the requeue while its
    other observers are being taken (five crashes' requeue took the services 26 s to work
    through; re-dispatching what was not taken after a fixed 5 s re-sent a quarter of it);
    once none was taken for a grace, it is re-dispatched."""
    conn, store = db
    sid, _ = await _held_by_a_live_service(conn)
    queued = await _queued(conn, sid)
    others = [await _queued(conn, sid) for _ in range(20)]
    taker, _ = await _held_by_a_live_service(conn)
    grace = 0.5
    sweeper = await _gone(conn, _requeue_sweeper(store, grace=grace, patience=30.0), sid)
    # Four graces of its requeue being taken, a few observers each grace.
    until = asyncio.get_running_loop().time() + 4 * grace
    while asyncio.get_running_loop().time() < until:
        await conn.execute(
            "UPDATE observers SET service_id = $2, epoch = epoch + 1 WHERE id = $1",
            others.pop(),
            taker,
        )
        await sweeper.once()
        assert await _holder(conn, queued) == sid, "re-dispatched while its requeue is taken"
        await asyncio.sleep(grace / 5)

    await _redispatched(conn, sweeper, queued, "a grace without a take of its observers")


async def test_a_requeue_stuck_at_a_frozen_consumer_waits_no_longer_than_the_grace(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    """The dead service's requeued deliveries went to a consumer that takes nothing (a service
    frozen at the same moment). Its pool goes on taking other observers: the requeue waited for
    that, up to a minute; it waits only while the dead service's own observers are taken."""
    conn, store = db
    sid, _ = await _held_by_a_live_service(conn)
    queued = await _queued(conn, sid)
    busy = await _queued(conn, None)
    grace = 0.5
    sweeper = await _gone(conn, _requeue_sweeper(store, grace=grace, patience=30.0), sid)
    began = asyncio.get_running_loop().time()

    async def done() -> bool:
        await conn.execute("UPDATE observers SET started_at = now() WHERE id = $1", busy)
        await sweeper.once()
        return await _holder(conn, queued) is None

    await wait_for(done, timeout=5, what="the stuck requeue's observer re-dispatched")
    assert asyncio.get_running_loop().time() - began < 4 * grace


async def test_a_service_back_after_it_was_proven_gone_is_not_left_to_a_requeue_later(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    """Proven gone once, a service rejoins under the same id (its own join statement) and runs
    an observer that came by the work queue; then its lease ends while its broker connection
    lives (its database link cut): the broker requeued nothing, and the observer is re-dispatched
    at once. Its row kept when it was proven gone the first time, so the sweeper left the
    observer to a requeue that never came for the grace (chaos seed 4: 2 s past the bound)."""
    conn, store = db
    sid, _ = await _held_by_a_live_service(conn)
    sweeper = await _gone(conn, _requeue_sweeper(store, grace=30.0), sid)
    await conn.execute(
        service_queries.JOIN,
        sid,
        "a",
        10,
        "h",
        1,
        "v",
        None,
        DEFAULT_POOL,
        secrets.randbits(63),
        60,
    )
    queued = await _queued(conn, sid)
    await conn.execute(
        "UPDATE services SET lease_expires_at = clock_timestamp() WHERE id = $1", sid
    )
    await sweeper.once()
    assert await conn.fetchval("SELECT is_deleted FROM services WHERE id = $1", sid)
    assert await _holder(conn, queued) is None, "left to a requeue of an earlier death"


async def test_a_stalled_service_is_not_taken_over_before_its_lease_expires(
    db: tuple[asyncpg.Connection, ManagerStore],
) -> None:
    """Its lock is free and it is off the broker, as after a crash; but its watchdog marked a
    step of kind code blocking its loop, so it cannot have noticed and paused: neither the
    sweeper nor a taker treats it as gone while its lease holds. Its renewal clears the mark."""
    conn, store = db
    sid, oid = await _held_by_a_live_service(conn)
    await conn.execute(service_queries.MARK_STALLED, sid)
    sweeper = Sweeper(store, _Box(), _Broker(), margin=1.0, metrics=ManagerMetrics())  # type: ignore[arg-type]
    await sweeper.once()
    await sweeper.once()
    assert not await conn.fetchval("SELECT is_deleted FROM services WHERE id = $1", sid)
    assert await conn.fetchval("SELECT service_id FROM observers WHERE id = $1", oid) == sid
    facts = await conn.fetchrow(service_queries.FACTS, [oid], uuid.uuid4())
    assert facts is not None
    assert facts["holder_live"]
    assert facts["holder_lock_free"] is False, "a taker would take from a stalled holder"
    key = await conn.fetchval("SELECT lock_key FROM services WHERE id = $1", sid)
    assert (
        await conn.fetchrow(service_queries.RENEW, sid, 60.0, key, True, 1.0, "", None, None)
        is not None
    )
    assert await conn.fetchval("SELECT stalled_since FROM services WHERE id = $1", sid), "kept"
    assert (
        await conn.fetchrow(service_queries.RENEW, sid, 60.0, key, False, 1.0, "", None, None)
        is not None
    )
    assert await conn.fetchval("SELECT stalled_since FROM services WHERE id = $1", sid) is None
    facts = await conn.fetchrow(service_queries.FACTS, [oid], uuid.uuid4())
    assert facts is not None
    assert facts["holder_lock_free"] is True


async def test_a_services_row_locked_by_a_take_never_stalls_the_sweep(
    db: tuple[asyncpg.Connection, ManagerStore], database_url: str
) -> None:
    """A take's FOR SHARE on a dead holder's row (held here by another transaction) is skipped,
    not waited for: the sweep goes on at once, and the next one after it marks the row."""
    conn, store = db
    sid, _ = await _held_by_a_live_service(conn)
    await conn.execute(
        "UPDATE services SET lease_expires_at = clock_timestamp() - interval '1 second' "
        "WHERE id = $1",
        sid,
    )
    taker = await asyncpg.connect(asyncpg_dsn(database_url))
    sweeper = Sweeper(store, _Box(), _Broker(), margin=1.0, metrics=ManagerMetrics())  # type: ignore[arg-type]
    try:
        tx = taker.transaction()
        await tx.start()
        await taker.execute("SELECT 1 FROM services WHERE id = $1 FOR SHARE", sid)
        await asyncio.wait_for(sweeper.once(), 1.0)
        assert not await conn.fetchval("SELECT is_deleted FROM services WHERE id = $1", sid)
        await tx.rollback()
        await asyncio.wait_for(sweeper.once(), 1.0)
        assert await conn.fetchval("SELECT is_deleted FROM services WHERE id = $1", sid)
    finally:
        await taker.close()


async def test_an_idle_sweep_reads_no_service_load_and_probes_nobody(
    db: tuple[asyncpg.Connection, ManagerStore], database_url: str, monkeypatch: Any
) -> None:
    """A sweep that finds no ended session, no observer of a dead service and none waiting
    stops there. It used to count every live service's observers (the free slots) and probe
    each on the broker, four times a second: reads that grew with the observers of the fleet."""
    conn, store = db
    sid, _ = await _held_by_a_live_service(conn)
    session = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        key = secrets.randbits(63)
        await session.execute("SELECT pg_advisory_lock($1)", key)  # its lease session lives
        await conn.execute("UPDATE services SET lock_key = $2 WHERE id = $1", sid, key)
        probes: list[uuid.UUID] = []
        broker = _Broker()

        async def probed() -> None:
            probes.append(sid)

        broker.before_answer = probed
        loads = 0
        free_slots = repo.free_slots

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal loads
            loads += 1
            return await free_slots(*args, **kwargs)

        monkeypatch.setattr(repo, "free_slots", counted)
        sweeper = Sweeper(store, _Box(), broker, margin=1.0, metrics=ManagerMetrics())  # type: ignore[arg-type]
        sweeper.suspects = {uuid.uuid4(): 0.0}
        assert await sweeper.once() == 0
        assert (loads, probes) == (0, []), "an idle sweep read the services' loads or probed"
        assert sweeper.suspects == {}, "a sweep that suspects nobody breaks 'twice in a row'"
    finally:
        await session.close()
