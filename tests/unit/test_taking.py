"""The take loop (``taking.take_many``) through the in-memory store: read, decide, compare-and-set,
and read again what changed in between, as it runs on PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection, Mapping, Sequence

from observer_service.ports import LOCKED, Locked, Seen, StartRequest, TakeResult, Written
from observer_service.take import Decision, Departed
from observer_service.taking import ROUNDS, take_many
from orch_contracts.statuses import ObserverStatus as S
from tests.support.fakes import FakeService, InMemoryStore


class Meddling:
    """The store's two ports, with ``meddle`` run after each facts read: another transaction
    that changes rows between a read and the compare-and-set."""

    def __init__(self, store: InMemoryStore, meddle: Callable[[int], None]) -> None:
        self.store = store
        self.me = store.me
        self.meddle = meddle
        self.reads: list[list[uuid.UUID]] = []
        self.writes: list[tuple[Decision, list[uuid.UUID]]] = []

    async def read_facts(self, observer_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, Seen]:
        self.reads.append(list(observer_ids))
        seen = await self.store.read_facts(observer_ids)
        self.meddle(len(self.reads))
        return seen

    async def compare_and_set(
        self,
        decision: Decision,
        rows: Sequence[Seen],
        queued: Collection[uuid.UUID] = (),
        dispatches: Mapping[uuid.UUID, uuid.UUID] | None = None,
    ) -> Written:
        self.writes.append((decision, [r.observer_id for r in rows]))
        return await self.store.compare_and_set(decision, rows, queued, dispatches)


def request(store: InMemoryStore, oid: uuid.UUID, *, redelivered: bool = False) -> StartRequest:
    return StartRequest(store.rows[oid].start, redelivered=redelivered, running_here=False)


def result(answer: TakeResult | Locked) -> TakeResult:
    assert isinstance(answer, TakeResult), answer
    return answer


async def test_a_row_taken_by_another_between_read_and_write_is_decided_again() -> None:
    store = InMemoryStore(uuid.uuid4())
    other = uuid.uuid4()
    store.services[other] = FakeService(live=True, remaining=20.0)
    row = store.add()

    def other_takes(read: int) -> None:
        if read == 1:
            row.status, row.service_id, row.epoch = S.PROCESSING, other, row.epoch + 1

    rows = Meddling(store, other_takes)
    (answer,) = await take_many(rows, [request(store, row.id)], Departed())
    got = result(answer)
    assert got.decision is Decision.DROP_DUPLICATE, "decided again on the row as it is now"
    assert (got.holder, got.holder_remaining) == (other, 20.0)
    assert len(rows.reads) == 2
    assert rows.writes == [(Decision.TAKE, [row.id])]
    assert (row.service_id, row.epoch) == (other, 1), "the write did not land"


async def test_a_row_whose_stop_began_meanwhile_has_its_stop_completed() -> None:
    store = InMemoryStore(uuid.uuid4())
    row = store.add()

    def deleting(read: int) -> None:
        if read == 1:
            row.status = S.ON_DELETING

    rows = Meddling(store, deleting)
    (answer,) = await take_many(rows, [request(store, row.id)], Departed())
    assert result(answer).decision is Decision.COMPLETE_STOP
    assert row.status is S.DELETED
    assert [d for d, _ in rows.writes] == [Decision.TAKE, Decision.COMPLETE_STOP]


async def test_only_the_rows_that_changed_are_read_again() -> None:
    store = InMemoryStore(uuid.uuid4())
    kept, moved = store.add(), store.add()

    def redispatch(read: int) -> None:
        if read == 1:
            moved.epoch += 1  # a sweep or another take bumped it; still free

    rows = Meddling(store, redispatch)
    answers = await take_many(rows, [request(store, kept.id), request(store, moved.id)], Departed())
    assert [result(a).decision for a in answers] == [Decision.TAKE, Decision.TAKE]
    assert rows.reads == [[kept.id, moved.id], [moved.id]]
    epochs = [t.epoch for t in (result(a).taken for a in answers) if t is not None]
    assert epochs == [1, 2]


async def test_a_row_that_changes_before_every_write_is_answered_locked_within_bounds() -> None:
    store = InMemoryStore(uuid.uuid4())
    hot, calm = store.add(), store.add()

    def always(_: int) -> None:
        hot.epoch += 1

    rows = Meddling(store, always)
    answers = await take_many(rows, [request(store, hot.id), request(store, calm.id)], Departed())
    assert answers[0] is LOCKED, "written again alone by the caller"
    assert result(answers[1]).decision is Decision.TAKE
    assert len(rows.reads) == ROUNDS
    assert hot.service_id is None


async def test_a_locked_row_is_locked_and_not_read_again() -> None:
    store = InMemoryStore(uuid.uuid4())
    free, busy = store.add(), store.add()
    store.locked.add(busy.id)
    rows = Meddling(store, lambda _: None)
    answers = await take_many(rows, [request(store, free.id), request(store, busy.id)], Departed())
    assert result(answers[0]).decision is Decision.TAKE
    assert answers[1] is LOCKED
    assert len(rows.reads) == 1


async def test_one_read_and_one_write_per_kind_for_a_mixed_batch() -> None:
    store = InMemoryStore(uuid.uuid4())
    take, stop = store.add(), store.add(status=S.PAUSING)
    failed = store.add(status=S.FAILED)
    rows = Meddling(store, lambda _: None)
    reqs = [request(store, r.id) for r in (take, stop, failed)]
    reqs.append(StartRequest(store.add().start, redelivered=False, running_here=False))
    del store.rows[reqs[-1].observer_id]  # gone before the read
    answers = await take_many(rows, reqs, Departed())
    assert [result(a).decision for a in answers] == [
        Decision.TAKE,
        Decision.COMPLETE_STOP,
        Decision.DROP_FAILED,
        Decision.DROP_MISSING,
    ]
    assert len(rows.reads) == 1
    assert rows.writes == [(Decision.TAKE, [take.id]), (Decision.COMPLETE_STOP, [stop.id])]
    assert stop.status is S.PAUSED


async def test_a_holder_that_came_back_on_a_new_session_keeps_its_row() -> None:
    """A takeover proven for the old session's key does not land once the holder names a new
    one; read again, its lock is held: the redelivery waits."""
    store = InMemoryStore(uuid.uuid4())
    holder = FakeService(live=True, lock_free=True)
    hid = uuid.uuid4()
    store.services[hid] = holder
    row = store.add(status=S.PROCESSING, service_id=hid, epoch=3)
    departed = Departed()
    departed.off_broker(holder.key)

    def back(read: int) -> None:
        if read == 1:
            holder.key += 1
            holder.lock_free = False

    rows = Meddling(store, back)
    (answer,) = await take_many(rows, [request(store, row.id, redelivered=True)], departed)
    assert result(answer).decision is Decision.WAIT
    assert (row.service_id, row.epoch) == (hid, 3)


async def test_a_lock_found_free_is_remembered() -> None:
    store = InMemoryStore(uuid.uuid4())
    holder = FakeService(live=True, lock_free=True)
    hid = uuid.uuid4()
    store.services[hid] = holder
    row = store.add(status=S.PROCESSING, service_id=hid, epoch=1)
    departed = Departed()
    (answer,) = await take_many(store, [request(store, row.id, redelivered=True)], departed)
    assert result(answer).decision is Decision.PROBE
    assert result(answer).holder_key == holder.key
    holder.lock_free = False  # a busy moment: the proof stands
    assert departed.facts(holder.key, lock_free=False) == (True, None)
