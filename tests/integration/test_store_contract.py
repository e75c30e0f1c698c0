"""One contract, two stores: the in-memory store the unit tests drive the service core with, and
the PostgreSQL store the services run on, through the same cases. A unit test through the fakes
means something only while the fake answers as the real store does."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import asyncpg
import pytest

from observer_service.outputs import checkpoint_json
from observer_service.ports import (
    LOCKED,
    Checkpoint,
    ControlFacts,
    Copy,
    Holding,
    StartRequest,
    Store,
    TakeResult,
    Written,
)
from observer_service.retry import landed, while_leased
from observer_service.store import PgStore
from observer_service.take import Decision, Departed
from observer_service.taking import take_many
from orch.cluster import wait_for
from orch_contracts.errors import RowLocked
from orch_contracts.kinds import RestartPolicy
from orch_contracts.messages import StartMessage
from orch_contracts.settings import asyncpg_dsn
from orch_contracts.statuses import ObserverStatus as S
from tests.support.fakes import FakeService, InMemoryStore

T = TypeVar("T")


class World(Protocol):
    """A store for service ``me`` and the rows around it, however they are kept."""

    @property
    def store(self) -> Store: ...

    async def observer(
        self, *, status: S = S.CREATED, holder: uuid.UUID | None = None, epoch: int = 0
    ) -> StartMessage: ...

    async def service(self, *, live: bool = True, lock_free: bool = False) -> uuid.UUID: ...

    async def row(self, observer_id: uuid.UUID) -> tuple[S, uuid.UUID | None, int]: ...

    async def new_session(self, service_id: uuid.UUID) -> None:
        """The service comes back on a new lease session: its row names a new lock key."""

    async def checkpoint(self, observer_id: uuid.UUID) -> Any: ...

    async def outbox(self, observer_id: uuid.UUID) -> list[tuple[int, int, list[Any]]]:
        """The observer's commits of outputs not yet confirmed: (seq, epoch, records)."""
        ...

    async def lock(self, observer_id: uuid.UUID) -> None:
        """Another transaction locks the row (``SELECT … FOR UPDATE``) until ``unlock``."""

    async def unlock(self) -> None: ...

    async def drain(self, draining: bool) -> None:
        """The API marks this service's row draining (or not)."""

    async def record_handoff(self, observer_id: uuid.UUID, to: uuid.UUID) -> None:
        """The leader records a move of this observer (``observers.handoff_to``)."""


class FakeWorld:
    def __init__(self) -> None:
        self.store = InMemoryStore(uuid.uuid4())

    async def observer(
        self, *, status: S = S.CREATED, holder: uuid.UUID | None = None, epoch: int = 0
    ) -> StartMessage:
        return self.store.add("ticker", status=status, service_id=holder, epoch=epoch).start

    async def service(self, *, live: bool = True, lock_free: bool = False) -> uuid.UUID:
        sid = uuid.uuid4()
        self.store.services[sid] = FakeService(
            live=live, lock_free=lock_free, remaining=60.0 if live else -1.0
        )
        return sid

    async def new_session(self, service_id: uuid.UUID) -> None:
        self.store.services[service_id].key += 1

    async def row(self, observer_id: uuid.UUID) -> tuple[S, uuid.UUID | None, int]:
        r = self.store.rows[observer_id]
        return r.status, r.service_id, r.epoch

    async def lock(self, observer_id: uuid.UUID) -> None:
        self.store.locked.add(observer_id)

    async def unlock(self) -> None:
        self.store.locked.clear()

    async def checkpoint(self, observer_id: uuid.UUID) -> Any:
        return self.store.rows[observer_id].checkpoint

    async def outbox(self, observer_id: uuid.UUID) -> list[tuple[int, int, list[Any]]]:
        return [
            (c.seq, c.epoch, [json.loads(r) for r in c.records])
            for (oid, _), c in sorted(self.store.outputs.items(), key=lambda kv: kv[0][1])
            if oid == observer_id
        ]

    async def drain(self, draining: bool) -> None:
        self.store.draining = draining

    async def record_handoff(self, observer_id: uuid.UUID, to: uuid.UUID) -> None:
        self.store.rows[observer_id].handoff_to = to


class PgWorld:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.store = PgStore(pool, uuid.uuid4())
        self._locks: list[asyncpg.Connection] = []
        self._row_lock: tuple[asyncpg.Connection, Any] | None = None

    async def start(self) -> PgWorld:
        await self._service_row(self.store.me, live=True)
        return self

    async def close(self) -> None:
        await self.unlock()
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

    async def new_session(self, service_id: uuid.UUID) -> None:
        await self.pool.execute(
            "UPDATE services SET lock_key = lock_key + 1 WHERE id = $1", service_id
        )

    async def row(self, observer_id: uuid.UUID) -> tuple[S, uuid.UUID | None, int]:
        r = await self.pool.fetchrow(
            "SELECT status, service_id, epoch FROM observers WHERE id = $1", observer_id
        )
        assert r is not None
        return S(r["status"]), r["service_id"], r["epoch"]

    async def lock(self, observer_id: uuid.UUID) -> None:
        conn = await self.pool.acquire()
        tx = conn.transaction()
        await tx.start()
        self._row_lock = (conn, tx)
        await conn.execute("SELECT 1 FROM observers WHERE id = $1 FOR UPDATE", observer_id)

    async def unlock(self) -> None:
        if self._row_lock is not None:
            conn, tx = self._row_lock
            self._row_lock = None
            await tx.rollback()
            await self.pool.release(conn)

    async def checkpoint(self, observer_id: uuid.UUID) -> Any:
        text = await self.pool.fetchval(
            "SELECT checkpoint FROM observers WHERE id = $1", observer_id
        )
        return None if text is None else json.loads(text)

    async def outbox(self, observer_id: uuid.UUID) -> list[tuple[int, int, list[Any]]]:
        rows = await self.pool.fetch(
            "SELECT seq, epoch, records FROM observer_outputs WHERE observer_id = $1 ORDER BY seq",
            observer_id,
        )
        return [(r["seq"], r["epoch"], json.loads(r["records"])) for r in rows]

    async def drain(self, draining: bool) -> None:
        await self.pool.execute(
            "UPDATE services SET draining = $2 WHERE id = $1", self.store.me, draining
        )

    async def record_handoff(self, observer_id: uuid.UUID, to: uuid.UUID) -> None:
        await self.pool.execute(
            "UPDATE observers SET handoff_to = $2 WHERE id = $1", observer_id, to
        )


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
    (result,) = await take_many(w.store, [req], kw.get("departed") or Departed())
    assert isinstance(result, TakeResult), result
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


async def test_a_stale_dispatch_runs_an_observer_nobody_runs_and_only_that(world: World) -> None:
    """The first start to come takes it, under its own dispatch: the newer one is dropped."""
    start = await world.observer()
    stale = StartMessage(observer_id=start.observer_id, dispatch_id=uuid.uuid4())
    taken = await take(world, stale)
    assert taken.decision is Decision.TAKE
    assert taken.taken is not None
    assert taken.taken.dispatch_id == stale.dispatch_id
    assert await world.row(start.observer_id) == (S.PROCESSING, world.store.me, 1)
    holder = await world.service()
    other = await world.observer(status=S.PROCESSING, holder=holder, epoch=3)
    old = StartMessage(observer_id=other.observer_id, dispatch_id=uuid.uuid4())
    assert (await take(world, old)).decision is Decision.DROP_STALE


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


# ------------------------------------------------- the take's two ports, under the one loop
async def _seen(world: World, start: StartMessage) -> Any:
    seen = await world.store.read_facts([start.observer_id])
    return seen[start.observer_id]


async def test_the_facts_read_reports_each_row_and_its_holder(world: World) -> None:
    holder = await world.service(lock_free=True)
    held = await world.observer(status=S.PROCESSING, holder=holder, epoch=3)
    free = await world.observer()
    missing = uuid.uuid4()
    seen = await world.store.read_facts([held.observer_id, free.observer_id, missing])
    assert set(seen) == {held.observer_id, free.observer_id}
    h, f = seen[held.observer_id], seen[free.observer_id]
    assert (h.status, h.epoch, h.holder, h.dispatch_id) == (
        S.PROCESSING,
        3,
        holder,
        held.dispatch_id,
    )
    assert h.holder_live
    assert h.holder_lock_free
    assert h.holder_key is not None
    assert 0 < h.holder_remaining <= 60, "the holder's lease time left"
    assert (f.status, f.epoch, f.holder, f.holder_live, f.holder_key) == (
        S.CREATED,
        0,
        None,
        False,
        None,
    )
    assert (f.kind, f.params, f.checkpoint) == ("ticker", {}, None)


async def test_a_held_lock_and_an_expired_lease_are_reported(world: World) -> None:
    locked = await world.observer(status=S.PROCESSING, holder=await world.service(), epoch=1)
    gone = await world.observer(status=S.PROCESSING, holder=await world.service(live=False))
    seen = await world.store.read_facts([locked.observer_id, gone.observer_id])
    assert seen[locked.observer_id].holder_live
    assert not seen[locked.observer_id].holder_lock_free
    assert not seen[gone.observer_id].holder_live
    assert not seen[gone.observer_id].holder_lock_free


async def test_a_compare_and_set_lands_on_rows_as_seen(world: World) -> None:
    a, b = await world.observer(), await world.observer(status=S.ON_DELETING)
    sa, sb = await _seen(world, a), await _seen(world, b)
    assert await world.store.compare_and_set(Decision.TAKE, [sa]) == Written(
        {a.observer_id: 1}, frozenset()
    )
    assert await world.row(a.observer_id) == (S.PROCESSING, world.store.me, 1)
    done = await world.store.compare_and_set(Decision.COMPLETE_STOP, [sb])
    assert set(done.epochs) == {b.observer_id}
    assert not done.locked
    assert await world.row(b.observer_id) == (S.DELETED, None, 0)


async def test_a_compare_and_set_skips_a_row_changed_since_it_was_seen(world: World) -> None:
    start = await world.observer()
    seen = await _seen(world, start)
    assert (await take(world, start)).decision is Decision.TAKE  # epoch 1 meanwhile
    assert await world.store.compare_and_set(Decision.TAKE, [seen]) == Written({}, frozenset())
    assert await world.row(start.observer_id) == (S.PROCESSING, world.store.me, 1)


async def test_a_compare_and_set_answers_a_locked_row_as_locked(world: World) -> None:
    free, busy = await world.observer(), await world.observer()
    seen = [await _seen(world, free), await _seen(world, busy)]
    await world.lock(busy.observer_id)
    written = await asyncio.wait_for(world.store.compare_and_set(Decision.TAKE, seen), _UNBLOCKED)
    assert written == Written({free.observer_id: 1}, frozenset({busy.observer_id}))
    assert await world.row(busy.observer_id) == (S.CREATED, None, 0)


async def test_a_takeover_needs_the_holder_still_on_the_key_seen(world: World) -> None:
    holder = await world.service(lock_free=True)
    start = await world.observer(status=S.PROCESSING, holder=holder, epoch=3)
    seen = await _seen(world, start)
    await world.new_session(holder)
    assert await world.store.compare_and_set(Decision.TAKE, [seen]) == Written({}, frozenset())
    assert await world.row(start.observer_id) == (S.PROCESSING, holder, 3)
    again = await _seen(world, start)
    assert await world.store.compare_and_set(Decision.TAKE, [again]) == Written(
        {start.observer_id: 4}, frozenset()
    )


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
    assert await world.store.release_many([stale], "stale") == [None]
    assert await world.store.record_error(stale, "boom", RestartPolicy()) is None
    assert await world.store.release_many([copy], "done") == [S.PROCESSING]
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


async def test_a_control_check_reads_the_flag_and_the_rows_named(world: World) -> None:
    me = world.store.me
    held = await world.observer(status=S.ON_DELETING, holder=me, epoch=3)
    free = await world.observer()
    target = uuid.uuid4()
    await world.record_handoff(held.observer_id, target)
    facts = await world.store.control_facts([held.observer_id, free.observer_id, uuid.uuid4()])
    assert not facts.draining
    assert facts.observers == {
        held.observer_id: Holding(S.ON_DELETING, me, 3, target),
        free.observer_id: Holding(S.CREATED, None, 0, None),
    }
    await world.drain(True)
    assert await world.store.control_facts([]) == ControlFacts(draining=True, observers={})


async def test_a_take_and_a_release_clear_a_recorded_handoff(world: World) -> None:
    start = await world.observer()
    await world.record_handoff(start.observer_id, uuid.uuid4())
    result = await take(world, start)
    assert result.taken is not None
    facts = await world.store.control_facts([start.observer_id])
    assert facts.observers[start.observer_id].handoff_to is None
    target = uuid.uuid4()
    await world.record_handoff(start.observer_id, target)
    assert await world.store.release_many([result.taken.copy], "handed over") == [S.PROCESSING]
    facts = await world.store.control_facts([start.observer_id])
    assert facts.observers[start.observer_id] == Holding(S.PROCESSING, None, 1, None)


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


# ------------------------------------------------------------------ a row locked from outside
#: How long a batch may take beside a row another transaction holds: it must not wait for it.
_UNBLOCKED = 1.0


async def _retried_alone(op: Callable[[], Awaitable[T]]) -> tuple[asyncio.Task[T], list[int]]:
    """``op`` through the retry loop a running copy's write goes through (``landed`` turns a
    skipped row into RowLocked); the list counts its attempts."""
    tries = [0]

    async def attempt() -> T:
        tries[0] += 1
        return await op()

    return asyncio.ensure_future(while_leased(attempt, lambda: True)), tries


async def _retried_at_least(tries: list[int], n: int) -> None:
    async def enough() -> bool:
        return tries[0] >= n

    await wait_for(enough, timeout=5, what=f"{n} attempts of the locked write")


async def test_a_locked_row_neither_stalls_its_checkpoint_batch_nor_looks_fenced(
    world: World,
) -> None:
    """One row locked by another transaction (``SELECT … FOR UPDATE``): the batch's other
    checkpoints land at once, the locked one is LOCKED (not fenced), and once the lock is gone
    its retried write lands."""
    copies = [await _held(world) for _ in range(6)]
    locked = copies[-1]
    await world.lock(locked.observer_id)
    items = [Checkpoint(*c, json.dumps({"n": i})) for i, c in enumerate(copies)]
    answers = await asyncio.wait_for(world.store.checkpoint_many(items), _UNBLOCKED)
    assert answers == [True] * 5 + [LOCKED]
    for i, c in enumerate(copies[:-1]):
        assert await world.checkpoint(c.observer_id) == {"n": i}
    assert await world.checkpoint(locked.observer_id) is None

    async def write() -> bool:
        return landed((await world.store.checkpoint_many([items[-1]]))[0])

    task, tries = await _retried_alone(write)
    try:
        await _retried_at_least(tries, 2)
        assert not task.done(), "the locked row's write ended while it was still locked"
        await world.unlock()
        assert await asyncio.wait_for(task, 2) is True
    finally:
        task.cancel()
    assert await world.checkpoint(locked.observer_id) == {"n": 5}


async def test_a_locked_row_neither_stalls_a_release_nor_a_take(world: World) -> None:
    """The other batched writes the same way: a release and a take of a locked row are LOCKED,
    the rest of their batches lands at once; a restart record fails RowLocked at once."""
    kept, locked = await _held(world), await _held(world)
    await world.lock(locked.observer_id)
    answers = await asyncio.wait_for(
        world.store.release_many([kept, locked], "stopped"), _UNBLOCKED
    )
    assert answers == [S.PROCESSING, LOCKED]
    with pytest.raises(RowLocked):
        await asyncio.wait_for(world.store.record_error(locked, "boom", RestartPolicy()), 1)
    await world.unlock()
    assert await world.store.release_many([locked], "stopped") == [S.PROCESSING]

    free, busy = await world.observer(), await world.observer()
    await world.lock(busy.observer_id)
    reqs = [StartRequest(s, redelivered=False, running_here=False) for s in (free, busy)]
    results = await asyncio.wait_for(take_many(world.store, reqs, Departed()), _UNBLOCKED)
    assert isinstance(results[0], TakeResult)
    assert results[0].decision is Decision.TAKE
    assert results[1] is LOCKED
    assert (await world.row(busy.observer_id))[1] is None
    await world.unlock()
    assert (await take(world, busy)).decision is Decision.TAKE


async def test_a_commit_gives_its_records_the_next_seqs_once_even_when_retried(
    world: World,
) -> None:
    """Records land with the state in one write, from the seq after the last committed; the
    same commit again (its answer was lost) lands once; a stale copy's records never land;
    a commit out of step is refused; a new copy learns the last seq from its take."""
    start = await world.observer()
    taken = (await take(world, start)).taken
    assert taken is not None
    copy = taken.copy
    first = Checkpoint(*copy, '{"n": 2}', ('{"n": 1}', '{"n": 2}'), first_seq=1)
    assert await world.store.checkpoint_many([first]) == [True]
    assert await world.store.checkpoint_many([first]) == [True]  # retried: lands once
    stale = Checkpoint(copy.observer_id, copy.epoch - 1, None, ('{"n": 9}',), first_seq=3)
    ahead = Checkpoint(*copy, None, ('{"n": 9}',), first_seq=7)
    assert await world.store.checkpoint_many([stale, ahead]) == [False, False]
    assert await world.outbox(copy.observer_id) == [(1, copy.epoch, [{"n": 1}, {"n": 2}])]
    assert await world.checkpoint(copy.observer_id) == {"n": 2}
    (left,) = await world.store.outputs_backlog([copy.observer_id])
    assert (left.seq, left.last_seq, left.epoch) == (1, 2, copy.epoch)
    assert [json.loads(r) for r in left.records] == [{"n": 1}, {"n": 2}]
    await world.store.delete_published([(copy.observer_id, 1)])
    assert await world.outbox(copy.observer_id) == []
    # Once released, the next take resumes from the checkpoint and seq 2 together.
    assert await world.store.release_many([copy], "done") == [S.PROCESSING]
    again = (await take(world, start)).taken
    assert again is not None
    assert (again.epoch, again.output_seq, again.checkpoint) == (copy.epoch + 1, 2, {"n": 2})
