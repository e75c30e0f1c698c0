"""One contract, two stores: the in-memory store the unit tests drive the service core with, and
the PostgreSQL store the services run on, through the same cases. A unit test through the fakes
means something only while the fake answers as the real store does."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import asyncpg
import pytest

from contracts.kinds import RestartPolicy
from contracts.messages import StartMessage
from contracts.settings import asyncpg_dsn
from contracts.statuses import ObserverStatus as S
from observer_service.fakes import FakeService, InMemoryStore
from observer_service.intake import checkpoint_json
from observer_service.ports import Checkpoint, Copy, StartRequest, Store, TakeResult
from observer_service.store import PgStore
from observer_service.take import Decision, Departed


class World(Protocol):
    """A store for service ``me`` and the rows around it, however they are kept."""

    @property
    def store(self) -> Store: ...

    async def observer(
        self, *, status: S = S.CREATED, holder: uuid.UUID | None = None, epoch: int = 0
    ) -> StartMessage: ...

    async def service(self, *, live: bool = True, lock_free: bool = False) -> uuid.UUID: ...

    async def row(self, observer_id: uuid.UUID) -> tuple[S, uuid.UUID | None, int]: ...


class FakeWorld:
    def __init__(self) -> None:
        self.store = InMemoryStore(uuid.uuid4())

    async def observer(
        self, *, status: S = S.CREATED, holder: uuid.UUID | None = None, epoch: int = 0
    ) -> StartMessage:
        return self.store.add("ticker", status=status, service_id=holder, epoch=epoch).start

    async def service(self, *, live: bool = True, lock_free: bool = False) -> uuid.UUID:
        sid = uuid.uuid4()
        self.store.services[sid] = FakeService(live=live, lock_free=lock_free)
        return sid

    async def row(self, observer_id: uuid.UUID) -> tuple[S, uuid.UUID | None, int]:
        r = self.store.rows[observer_id]
        return r.status, r.service_id, r.epoch


class PgWorld:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.store = PgStore(pool, uuid.uuid4())
        self._locks: list[asyncpg.Connection] = []

    async def start(self) -> PgWorld:
        await self._service_row(self.store.me, live=True)
        return self

    async def close(self) -> None:
        for conn in self._locks:
            await conn.execute("SELECT pg_advisory_unlock_all()")
            await self.pool.release(conn)

    async def _service_row(self, sid: uuid.UUID, *, live: bool) -> int:
        key = uuid.uuid4().int >> 65
        lease = "1 minute" if live else "-1 second"
        await self.pool.execute(
            "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at) "
            f"VALUES ($1, 's', 10, $2, clock_timestamp() + interval '{lease}')",
            sid,
            key,
        )
        return key

    async def observer(
        self, *, status: S = S.CREATED, holder: uuid.UUID | None = None, epoch: int = 0
    ) -> StartMessage:
        start = StartMessage(observer_id=uuid.uuid4(), dispatch_id=uuid.uuid4())
        await self.pool.execute(
            "INSERT INTO observers (id, name, kind, params, status, dispatch_id, service_id, "
            "epoch) VALUES ($1, $2, 'ticker', '{}', $3, $4, $5, $6)",
            start.observer_id,
            f"o-{start.observer_id}",
            status.value,
            start.dispatch_id,
            holder,
            epoch,
        )
        return start

    async def service(self, *, live: bool = True, lock_free: bool = False) -> uuid.UUID:
        sid = uuid.uuid4()
        key = await self._service_row(sid, live=live)
        if not lock_free:  # its lease session holds its lock
            conn = await self.pool.acquire()
            await conn.execute("SELECT pg_advisory_lock($1)", key)
            self._locks.append(conn)
        return sid

    async def row(self, observer_id: uuid.UUID) -> tuple[S, uuid.UUID | None, int]:
        r = await self.pool.fetchrow(
            "SELECT status, service_id, epoch FROM observers WHERE id = $1", observer_id
        )
        assert r is not None
        return S(r["status"]), r["service_id"], r["epoch"]


@pytest.fixture(params=["memory", "postgresql"])
async def world(request: pytest.FixtureRequest, database_url: str) -> AsyncIterator[World]:
    if request.param == "memory":
        yield FakeWorld()
        return
    pool = await asyncpg.create_pool(asyncpg_dsn(database_url), min_size=1, max_size=6)
    w = await PgWorld(pool).start()
    try:
        yield w
    finally:
        await w.close()
        await pool.close()


async def take(
    w: World, start: StartMessage, *, redelivered: bool = False, room: bool = True, **kw: Any
) -> TakeResult:
    req = StartRequest(start, redelivered=redelivered, running_here=False, room=room)
    (result,) = await w.store.take_many([req], kw.get("departed") or Departed())
    return result


async def test_a_created_observer_is_taken_with_a_new_epoch(world: World) -> None:
    start = await world.observer()
    result = await take(world, start)
    assert result.decision is Decision.TAKE
    assert result.taken is not None
    assert result.taken.epoch == 1
    assert await world.row(start.observer_id) == (S.PROCESSING, world.store.me, 1)


async def test_without_room_a_take_is_not_written(world: World) -> None:
    start = await world.observer()
    assert (await take(world, start, room=False)).decision is Decision.NO_ROOM
    assert await world.row(start.observer_id) == (S.CREATED, None, 0)


async def test_a_stale_dispatch_is_dropped(world: World) -> None:
    start = await world.observer()
    stale = StartMessage(observer_id=start.observer_id, dispatch_id=uuid.uuid4())
    assert (await take(world, stale)).decision is Decision.DROP_STALE


@pytest.mark.parametrize(
    ("redelivered", "lock_free", "expected"),
    [
        (False, False, Decision.DROP_DUPLICATE),
        (True, False, Decision.WAIT),
        (True, True, Decision.PROBE),
    ],
)
async def test_a_live_holder_is_respected(
    world: World, redelivered: bool, lock_free: bool, expected: Decision
) -> None:
    holder = await world.service(lock_free=lock_free)
    start = await world.observer(status=S.PROCESSING, holder=holder, epoch=3)
    assert (await take(world, start, redelivered=redelivered)).decision is expected
    assert await world.row(start.observer_id) == (S.PROCESSING, holder, 3)


async def test_a_holder_proven_gone_is_taken_over(world: World) -> None:
    holder = await world.service(lock_free=True)
    start = await world.observer(status=S.PROCESSING, holder=holder, epoch=3)
    departed = Departed()
    probed = await take(world, start, redelivered=True, departed=departed)
    assert probed.holder_key is not None
    departed.off_broker(probed.holder_key)
    result = await take(world, start, redelivered=True, departed=departed)
    assert result.decision is Decision.TAKE
    assert await world.row(start.observer_id) == (S.PROCESSING, world.store.me, 4)


async def test_a_holder_whose_lease_expired_is_taken_over(world: World) -> None:
    holder = await world.service(live=False)
    start = await world.observer(status=S.PROCESSING, holder=holder, epoch=2)
    assert (await take(world, start)).decision is Decision.TAKE


@pytest.mark.parametrize(("status", "final"), [(S.ON_DELETING, S.DELETED), (S.PAUSING, S.PAUSED)])
async def test_a_stop_nobody_runs_is_completed(world: World, status: S, final: S) -> None:
    start = await world.observer(status=status)
    assert (await take(world, start)).decision is Decision.COMPLETE_STOP
    assert (await world.row(start.observer_id))[0] is final


async def _held(world: World) -> Copy:
    start = await world.observer()
    taken = (await take(world, start)).taken
    assert taken is not None
    return taken.copy


async def test_writes_of_a_stale_copy_are_refused(world: World) -> None:
    copy = await _held(world)
    stale = Copy(copy.observer_id, copy.epoch - 1)
    state = json.dumps({"n": 1})
    checkpoints = [Checkpoint(*stale, state), Checkpoint(*copy, state)]
    assert await world.store.checkpoint_many(checkpoints) == [False, True]
    assert await world.store.let_go_many([stale], "stale") == [None]
    assert await world.store.record_error(stale, "boom", RestartPolicy()) is None
    assert await world.store.let_go_many([copy], "done") == [S.PROCESSING]
    assert await world.row(copy.observer_id) == (S.PROCESSING, None, copy.epoch)


async def test_the_restart_budget_fails_the_row_when_spent(world: World) -> None:
    copy = await _held(world)
    policy = RestartPolicy(max_restarts=1)
    first = await world.store.record_error(copy, "boom", policy)
    assert first is not None
    assert (first.restarts, first.failed) == (1, False)
    second = await world.store.record_error(copy, "boom", policy)
    assert second is not None
    assert second.failed
    assert (await world.row(copy.observer_id))[:2] == (S.FAILED, None)


async def test_reconcile_and_held_count(world: World) -> None:
    kept, dropped = await _held(world), await _held(world)
    assert await world.store.held_count() == 2
    assert await world.store.reconcile({kept.observer_id}) == 1
    assert await world.row(dropped.observer_id) == (S.PROCESSING, None, dropped.epoch)
    assert await world.store.held_count() == 1


async def test_blame_fails_whoever_holds_it_but_never_a_stop(world: World) -> None:
    other = await world.service()
    held = await world.observer(status=S.PROCESSING, holder=other, epoch=5)
    assert await world.store.blame(held.observer_id, "blocked the event loop for 9.0s")
    assert await world.row(held.observer_id) == (S.FAILED, None, 5)
    deleting = await world.observer(status=S.ON_DELETING, holder=other, epoch=1)
    assert not await world.store.blame(deleting.observer_id, "blocked")
    assert (await world.row(deleting.observer_id))[0] is S.ON_DELETING


async def test_what_a_checkpoint_may_hold_is_stored_and_the_rest_is_refused_first(
    world: World,
) -> None:
    # Whatever checkpoint_json lets through, the store takes, in one batch with others.
    a, b = await _held(world), await _held(world)
    odd = {"text": "é \\u0000 \u202e", "big": 2**70, "nested": [None, True, 1.5]}
    items = [Checkpoint(*a, checkpoint_json(odd)), Checkpoint(*b, checkpoint_json({"n": 1}))]
    assert await world.store.checkpoint_many(items) == [True, True]
    # What PostgreSQL's jsonb would refuse never reaches a batch: in one, it would fail the
    # checkpoints of every observer written with it.
    for bad in (float("nan"), {"x": float("inf")}, "nul \x00 inside"):
        with pytest.raises(ValueError, match="a checkpoint cannot hold"):
            checkpoint_json(bad)


async def test_a_state_postgresql_refuses_fails_its_whole_batch(database_url: str) -> None:
    """Why checkpoint_json refuses NaN and NUL before the write: the store cannot."""
    pool = await asyncpg.create_pool(asyncpg_dsn(database_url), min_size=1, max_size=2)
    world = await PgWorld(pool).start()
    try:
        a, b = await _held(world), await _held(world)
        items = [Checkpoint(*a, json.dumps({"n": float("nan")})), Checkpoint(*b, '{"n": 1}')]
        with pytest.raises(Exception):  # noqa: B017, PT011 (asyncpg's own data error)
            await world.store.checkpoint_many(items)
    finally:
        await world.close()
        await pool.close()
