"""The service core's own logic through in-memory fakes: admission, duplicates, settling, drain,
handoff, lease loss, database outages. Milliseconds each; the real servers are tested elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from observer_service.context import ObserverContext
from observer_service.lease import LeaseKeeper, LeaseState
from observer_service.runner import StopReason
from observer_service.service import ObserverService, ServiceConfig
from orch_contracts import heap
from orch_contracts.deadline import LeaseTimings
from orch_contracts.kinds import KindSpec, RestartPolicy
from orch_contracts.messages import CancelMessage, DrainMessage, HandoffMessage
from orch_contracts.statuses import ObserverStatus as S
from tests.support.fakes import (
    FakeBroker,
    FakeLeaseDatabase,
    FakeLeaseSession,
    FakeService,
    FakeThreadWrites,
    InMemoryStore,
    ManualClock,
    Row,
)

TIMINGS = LeaseTimings(ttl=1.0, renew_interval=0.1, margin=0.1)
TICKS: dict[uuid.UUID, int] = {}


async def tick(ctx: ObserverContext) -> None:
    while True:
        TICKS[ctx.observer_id] = TICKS.get(ctx.observer_id, 0) + 1
        await ctx.checkpoint({"n": TICKS[ctx.observer_id]})
        await ctx.sleep(0.01)


async def boom(ctx: ObserverContext) -> None:
    await ctx.sleep(0.001)
    raise RuntimeError("boom")


async def slow_stop(ctx: ObserverContext) -> None:
    try:
        while True:
            await ctx.sleep(0.01)
    finally:
        with contextlib.suppress(BaseException):
            await asyncio.sleep(0.2)


#: Steps of the ``cleans`` kind's cleanup, by observer.
CLEANUP: dict[uuid.UUID, int] = {}


async def cleans(ctx: ObserverContext) -> None:
    """Ticks; once stopped, runs a cleanup of ten steps (a flush, a polite close), each a side
    effect of its own."""
    try:
        while True:
            TICKS[ctx.observer_id] = TICKS.get(ctx.observer_id, 0) + 1
            await ctx.sleep(0.01)
    finally:
        for _ in range(10):
            CLEANUP[ctx.observer_id] = CLEANUP.get(ctx.observer_id, 0) + 1
            with contextlib.suppress(BaseException):
                await asyncio.sleep(0.02)


async def stubborn(ctx: ObserverContext) -> None:
    """Takes 3 s to stop, whatever it is asked."""
    try:
        while True:
            TICKS[ctx.observer_id] = TICKS.get(ctx.observer_id, 0) + 1
            await ctx.sleep(0.01)
    finally:
        until = time.monotonic() + 3
        while time.monotonic() < until:
            with contextlib.suppress(BaseException):
                await asyncio.sleep(0.02)


async def blocks(ctx: ObserverContext) -> None:
    while True:
        await ctx.sleep(0.01)
        time.sleep(float(ctx.params.get("block", 0.15)))  # noqa: ASYNC251 - on purpose


async def out_of_files(ctx: ObserverContext) -> None:
    """Ticks, then meets the process's descriptor limit (through a client library)."""
    TICKS[ctx.observer_id] = TICKS.get(ctx.observer_id, 0) + 1
    await ctx.sleep(0.01)
    try:
        raise OSError(errno.EMFILE, "Too many open files")
    except OSError as exc:
        raise ConnectionError("could not connect") from exc


KINDS = {
    "blocks": KindSpec(
        "blocks",
        blocks,
        restart_policy=RestartPolicy(max_restarts=2, base_delay=0.05, max_delay=0.05),
    ),
    "tick": KindSpec("tick", tick),
    "boom": KindSpec(
        "boom", boom, restart_policy=RestartPolicy(max_restarts=2, base_delay=0.05, max_delay=0.05)
    ),
    "slow": KindSpec("slow", slow_stop),
    "cleans": KindSpec("cleans", cleans),
    "stubborn": KindSpec("stubborn", stubborn),
    "out_of_files": KindSpec("out_of_files", out_of_files),
}


async def until(check: Callable[[], bool | Awaitable[bool]], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {check}")
        await asyncio.sleep(0.005)


@dataclass
class Harness:
    service: ObserverService
    store: InMemoryStore
    broker: FakeBroker
    lease_db: FakeLeaseDatabase
    clock: ManualClock

    @property
    def lease(self) -> LeaseKeeper:
        return self.service.lease

    async def started(self, kind: str = "tick", **fields: Any) -> tuple[Row, Any]:
        """A row of ``kind`` taken and running here, with its delivery."""
        row = self.store.add(kind, **fields)
        delivery = await self.run(row)
        await self.running(row)
        return row, delivery

    async def run(self, row: Row, *, redelivered: bool = False) -> Any:
        delivery = await self.broker.session.deliver(row.start, redelivered=redelivered)
        return delivery

    async def running(self, row: Row) -> None:
        await until(lambda: row.id in self.service.runners and TICKS.get(row.id, 0) > 1)

    async def stopped(self, row: Row) -> None:
        await until(lambda: row.id not in self.service.runners)

    async def take_held(self, row: Row) -> asyncio.Task[Any]:
        """Start a take that waits inside the store until ``store.hold`` is set."""
        self.store.hold = asyncio.Event()
        taking = asyncio.create_task(self.run(row))
        await until(lambda: self.service.admission.in_flight == 1)
        return taking


@contextlib.asynccontextmanager
async def harness(worker_count: int = 10, **config: Any) -> AsyncIterator[Harness]:
    me = uuid.uuid4()
    clock = ManualClock()
    store = InMemoryStore(me, ManualClock())  # the database's clock is not ours
    broker = FakeBroker()
    lease_db = FakeLeaseDatabase(store)
    service = ObserverService(
        service_id=me,
        config=ServiceConfig(name="unit", worker_count=worker_count, shutdown_timeout=1, **config),
        kinds=KINDS,
        store=store,
        broker=broker,
        lease_database=lease_db,
        timings=TIMINGS,
        clock=clock,
        thread_writes=FakeThreadWrites(store),
    )
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(broker.opened.wait(), 2)
    try:
        yield Harness(service, store, broker, lease_db, clock)
    finally:
        service.request_stop()
        await asyncio.wait_for(task, 5)


async def test_a_short_task_that_dies_of_a_bug_stops_the_service_loudly() -> None:
    """Failing an unrunnable start runs in a task of its own; a bug there is not swallowed."""
    me = uuid.uuid4()
    store = InMemoryStore(me, ManualClock())
    broker = FakeBroker()

    async def broken_fail(*_: Any) -> bool:
        raise RuntimeError("a bug in failing an observer")

    store.fail = broken_fail  # type: ignore[method-assign,assignment]
    service = ObserverService(
        service_id=me,
        config=ServiceConfig(name="unit", worker_count=2, shutdown_timeout=1),
        kinds=KINDS,
        store=store,
        broker=broker,
        lease_database=FakeLeaseDatabase(store),
        timings=TIMINGS,
        clock=ManualClock(),
    )
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(broker.opened.wait(), 2)
    # An observer whose restart policy no kind accepts cannot run: it is failed.
    await broker.session.deliver(store.add("tick", restart_policy={"max_restarts": -1}).start)
    assert await asyncio.wait_for(task, 5) == 1


async def test_a_start_for_a_kind_not_installed_here_is_passed_on_never_failed() -> None:
    """A fleet rolls a new kind out to some services first: a start of it that reaches one
    without it is neither taken nor failed there. It is acked and left waiting (with why) for
    the leader, which sends it to a service that runs the kind."""
    async with harness() as h:
        row = h.store.add("not-installed")
        delivery = await h.run(row)
        await until(lambda: delivery.outcome == "ack")
        assert (row.status, row.service_id, row.epoch) == (S.CREATED, None, 0)
        assert row.waiting == "kind 'not-installed' is not installed on service unit"
        assert "failed" not in row.events


# ---------------------------------------------------------------------------- admission
async def test_a_start_is_taken_and_runs_and_checkpoints() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        assert row.status is S.PROCESSING
        assert row.service_id == h.service.id
        assert row.epoch == 1
        assert delivery.outcome is None, "the start message stays unacked while it runs"
        await until(lambda: row.checkpoint is not None)


async def test_capacity_is_never_exceeded() -> None:
    async with harness(worker_count=2) as h:
        rows = [h.store.add("tick") for _ in range(3)]
        # The broker's prefetch would hold the third back; a directed start must not overflow.
        await h.run(rows[0])
        await h.run(rows[1])
        await h.broker.session.control(
            b'{"type":"start","observer_id":"%s","dispatch_id":"%s"}'
            % (str(rows[2].id).encode(), str(rows[2].dispatch_id).encode())
        )
        assert len(h.service.runners) == 2
        assert rows[2].status is S.CREATED
        assert h.broker.sent == [(rows[2].start, None)], "sent back to the work queue"


async def test_a_duplicate_start_is_dropped() -> None:
    async with harness() as h:
        row, _ = await h.started()
        duplicate = await h.run(row)
        assert duplicate.outcome == "ack"
        assert row.epoch == 1
        assert len(h.service.runners) == 1


async def test_a_crashed_holder_is_asked_after_once_for_all_it_held() -> None:
    """Its session ended and it is off the broker: every start it held is taken, and the broker
    is asked once, not once per batch of redeliveries."""
    async with harness() as h:
        gone = uuid.uuid4()
        h.store.services[gone] = FakeService(live=True, lock_free=True)
        rows = [h.store.add("tick", status=S.PROCESSING, service_id=gone) for _ in range(3)]
        for row in rows:
            await h.run(row, redelivered=True)
            await h.running(row)
        assert h.broker.probes == [gone]
        assert [r.epoch for r in rows] == [1, 1, 1]


async def test_a_holder_on_the_broker_is_never_taken_over_before_its_lease_ends() -> None:
    async with harness() as h:
        alive = uuid.uuid4()
        h.store.services[alive] = FakeService(live=True, lock_free=True)
        h.broker.present.add(alive)
        row = h.store.add("tick", status=S.PROCESSING, service_id=alive)
        taking = asyncio.create_task(h.run(row, redelivered=True))
        await until(lambda: len(h.broker.probes) >= 2)  # asked again as it waits
        assert row.service_id == alive
        h.store.services[alive].live = False  # its lease ran out
        await taking
        await h.running(row)


async def test_a_cancel_that_arrives_while_taking_stops_it_at_once() -> None:
    async with harness() as h:
        row = h.store.add("tick")
        taking = await h.take_held(row)
        row.status = S.ON_DELETING  # the API marked it while the take was in flight
        await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        assert h.store.hold is not None
        h.store.hold.set()
        delivery = await taking
        await until(lambda: row.status is S.DELETED)
        assert delivery.outcome == "ack"


# ----------------------------------------------------------------------------- settling
@pytest.mark.parametrize(("asked", "final"), [(S.ON_DELETING, S.DELETED), (S.PAUSING, S.PAUSED)])
async def test_a_delete_or_pause_stops_the_copy_and_acks(asked: S, final: S) -> None:
    async with harness() as h:
        row, delivery = await h.started()
        row.status = asked  # what the API does, before its cancel broadcast
        await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        await until(lambda: delivery.outcome == "ack")
        assert (row.status, row.service_id) == (final, None)
        assert row.checkpoint is not None, "the checkpoint stays"
        assert h.broker.sent == []


async def test_handoff_releases_and_sends_a_directed_start() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        target = uuid.uuid4()
        row.handoff_to = target  # what the leader records with its message
        await h.broker.session.control(HandoffMessage(observer_id=row.id, to=target).to_bytes())
        await until(lambda: delivery.outcome == "ack")
        assert (row.status, row.service_id) == (S.PROCESSING, None)
        assert h.broker.sent == [(row.start, target)]


async def test_drain_releases_and_requeues_and_takes_no_more() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        h.store.draining = True  # what the API writes before its broadcast
        await h.broker.session.control(DrainMessage(service_id=h.service.id).to_bytes())
        await until(lambda: delivery.outcome == "requeue")
        assert row.service_id is None
        assert not h.broker.session.consuming
        late = await h.run(h.store.add("tick"))
        assert late.outcome == "requeue"


@pytest.mark.parametrize("during", ["drain", "handoff", "channel"])
async def test_delete_while_stopping_for_another_reason_ends_deleted(during: str) -> None:
    async with harness() as h:
        row = h.store.add("slow")
        delivery = await h.run(row)
        await until(lambda: row.id in h.service.runners)
        session = h.broker.session
        if during == "drain":
            h.store.draining = True
            await session.control(DrainMessage(service_id=h.service.id).to_bytes())
        elif during == "handoff":
            row.handoff_to = uuid.uuid4()
            await session.control(HandoffMessage(observer_id=row.id, to=row.handoff_to).to_bytes())
        else:
            await session.close()
        if during != "channel":
            await until(lambda: h.service.runners[row.id].stop_reason is not None)
        row.status = S.ON_DELETING
        await session.control(CancelMessage(observer_id=row.id).to_bytes())
        await h.stopped(row)
        assert row.status is S.DELETED
        assert row.service_id is None
        assert h.broker.sent == [], "a deleted observer was sent on"
        if during != "channel":
            assert delivery.outcome == "ack"


async def test_pause_wins_over_a_handoff() -> None:
    async with harness() as h:
        row = h.store.add("slow")
        await h.run(row)
        await until(lambda: row.id in h.service.runners)
        row.handoff_to = uuid.uuid4()
        await h.broker.session.control(
            HandoffMessage(observer_id=row.id, to=row.handoff_to).to_bytes()
        )
        await until(lambda: h.service.runners[row.id].stop_reason is not None)
        row.status = S.PAUSING
        await h.stopped(row)
        assert row.status is S.PAUSED
        assert h.broker.sent == [], "a paused observer was handed on"


async def test_a_start_for_a_paused_observer_is_dropped() -> None:
    async with harness() as h:
        row = h.store.add("tick", status=S.PAUSED)
        delivery = await h.run(row)
        assert delivery.outcome == "ack"
        assert row.id not in h.service.runners


async def test_spent_budget_fails_and_dead_letters() -> None:
    async with harness() as h:
        row = h.store.add("boom")
        delivery = await h.run(row)
        await until(lambda: delivery.outcome == "reject")
        assert row.status is S.FAILED
        assert row.restart_count == 2


async def test_restart_budget_heals_after_its_window() -> None:
    async with harness() as h:
        row = h.store.add("boom", restart_policy={"reset_after": 1})
        delivery = await h.run(row)
        await until(lambda: row.restart_count == 2)
        assert isinstance(h.store.clock, ManualClock)
        h.store.clock.advance(5)  # a long healthy run since the last restart
        await until(lambda: row.restart_count == 1)
        assert row.status is S.PROCESSING
        await until(lambda: delivery.outcome == "reject")


async def test_a_copy_fenced_by_a_newer_epoch_stops_and_acks() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        row.epoch += 1  # another service took it
        await until(lambda: delivery.outcome == "ack")
        assert row.id not in h.service.runners


# ------------------------------------------------------------------ the database goes away
async def test_a_short_database_outage_is_not_the_kinds_error() -> None:
    async with harness() as h:
        row, _ = await h.started()
        h.store.available = False
        await asyncio.sleep(0.15)
        h.store.available = True
        before = TICKS[row.id]
        await until(lambda: TICKS[row.id] > before + 3)
        assert row.restart_count == 0
        assert row.status is S.PROCESSING
        assert row.epoch == 1


async def test_a_failed_settle_is_retried_until_it_lands() -> None:
    async with harness() as h:
        row, delivery = await h.started()
        h.store.available = False
        row.status = S.ON_DELETING
        await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        await asyncio.sleep(0.1)
        assert row.status is S.ON_DELETING
        h.store.available = True
        await until(lambda: row.status is S.DELETED)
        # The start is acked once the write landed: after it, not with it (the race CI met).
        await until(lambda: delivery.outcome is not None)
        assert delivery.outcome == "ack"


async def test_renewal_handling_survives_a_database_outage() -> None:
    async with harness(check_every=0.01) as h:
        h.store.available = False  # the periodic held-count check fails meanwhile
        renewals = h.lease_db.renewals
        await until(lambda: h.lease_db.renewals > renewals + 3)
        h.store.available = True
        await h.started()


async def test_a_copy_whose_row_is_not_ours_is_stopped_even_if_it_never_writes() -> None:
    """A stop answered "nothing runs it" while a take was committing (the race a lock that
    joined the old holder opened): the row says deleted, nobody holds it, and the copy writes
    nothing that a fence could refuse. The periodic check of held rows stops it."""
    async with harness(check_every=0.01) as h:
        row, _ = await h.started("cleans")  # ticks, writes nothing
        row.status, row.service_id = S.DELETED, None  # as the racing delete wrote it
        await until(lambda: row.id not in h.service.runners)


async def test_a_start_meeting_a_copy_whose_row_is_not_ours_stops_it_before_the_new_one() -> None:
    """The same race, then a resume: the row is free again and its new start comes here, where
    the stray copy still runs. The take makes a new epoch; the stray stops first, never two
    copies of it here."""
    async with harness(check_every=3600) as h:  # no periodic check: the start finds it
        row, _ = await h.started("tick")
        stray = h.service.runners[row.id]
        row.status, row.service_id, row.dispatch_id = S.CREATED, None, uuid.uuid4()
        await h.run(row)
        await until(lambda: row.epoch == 2 and h.service.runners[row.id] is not stray)
        assert stray.finished.is_set(), "two copies ran here"
        assert stray.stop_reason is StopReason.SUPERSEDED
        await h.running(row)


async def test_after_a_failover_a_copy_whose_row_went_back_is_stopped_and_released() -> None:
    """The database failed over to a standby that had not replayed the last take: the row
    names this service at the epoch before the copy's. No copy may run on a token the database
    never issued (the next take's may be the same number): the copy stops, its row is released,
    its start goes back to the queue for a take under a new token."""
    async with harness(check_every=3600) as h:  # no periodic check: the failover's
        row, delivery = await h.started("tick")
        assert row.epoch == 1
        row.epoch = 0  # as the standby had it: taken by us before, at the epoch before
        h.lease_db.timeline += 1
        await until(lambda: row.id not in h.service.runners)
        await until(lambda: row.service_id is None)
        await until(lambda: delivery.outcome == "requeue")


# --------------------------------------------------------------------------- the lease
async def test_a_pause_every_local_clock_missed_is_seen_at_the_next_renewal() -> None:
    """Paused with its clocks frozen (a stun, a live migration): no local clock shows the time
    that passed, the deadline still looks valid. The database's clock in the renewal's answer
    does: the lease is given up at once, the copies stop, the service comes back on a new session.
    A drift within the margin is no pause."""
    async with harness() as h:
        row, _ = await h.started()
        renewals = h.lease_db.renewals
        await until(lambda: h.lease_db.renewals > renewals + 1)
        assert not h.lease.fenced
        h.lease_db.unseen += h.lease.timings.margin / 2
        renewals = h.lease_db.renewals
        await until(lambda: h.lease_db.renewals > renewals + 1)
        assert not h.lease.fenced, "a drift within the margin fenced"
        joins = len(h.lease_db.joins)
        h.lease_db.unseen += 10.0
        await until(lambda: row.id not in h.service.runners)
        await until(lambda: len(h.lease_db.joins) > joins)


async def test_an_ended_lease_session_pauses_copies_until_a_new_one_shows_them_ours() -> None:
    """pg_terminate_backend, a pooler, a database restart: the copies pause at once, and go on
    once a renewal on a new session (a new lock key) shows nothing was taken meanwhile."""
    async with harness() as h:
        row, _ = await h.started()
        first = h.lease_db.sessions[-1]
        h.lease_db.available = False  # the new session cannot be had yet
        first.end()
        paused_at = TICKS[row.id]
        await asyncio.sleep(0.1)
        assert TICKS[row.id] <= paused_at + 1, "kind code ran while its session was down"
        h.lease_db.available = True
        await until(lambda: TICKS[row.id] > paused_at + 3)
        assert h.lease_db.key == h.lease_db.sessions[-1].lock_key != first.lock_key
        assert not h.lease.fenced
        assert (row.epoch, row.service_id) == (1, h.service.id)


async def test_a_copy_taken_while_the_lease_session_was_down_never_resumes() -> None:
    """A silent partition from the broker, then the lease session ends: another service took
    one observer meanwhile (its lock was free and its control queue gone). That copy stops
    without running again; the other goes on."""
    async with harness() as h:
        taken, _ = await h.started()
        kept, _ = await h.started()
        h.lease_db.available = False
        h.lease_db.sessions[-1].end()
        await asyncio.sleep(0.05)
        stale = TICKS[taken.id]
        taken.service_id, taken.epoch = uuid.uuid4(), taken.epoch + 1  # the other service's take
        h.lease_db.available = True
        await h.stopped(taken)
        assert TICKS[taken.id] == stale, "the superseded copy ran again"
        before = TICKS[kept.id]
        await until(lambda: TICKS[kept.id] > before + 3)
        assert not h.lease.fenced


async def test_reading_the_lease_is_pure_and_its_own_schedule_fences() -> None:
    async with harness() as h:
        await h.started()
        h.lease_db.available = False
        h.clock.advance(TIMINGS.ttl)  # the deadline passed; no timer of the keeper has run yet
        assert h.lease.state() is LeaseState.LOST
        assert not h.lease.valid()
        assert not h.lease.fenced, "reading the lease fenced"
        await until(lambda: h.lease.fenced)
        h.lease_db.available = True


async def test_a_graceful_stop_never_releases_a_copy_that_has_not_stopped() -> None:
    """Past the shutdown timeout (1 s here) the copy still runs: its row stays held and the
    service leaves unclean (the process exits, and others take it as from a crash)."""
    async with harness() as h:
        row, _ = await h.started("stubborn")
        h.service.request_stop()
        await until(lambda: not h.service.clean, timeout=5)
        assert row.service_id == h.service.id, "a copy still running was released"
        assert row.status is S.PROCESSING


async def test_a_service_whose_kind_blocked_the_loop_keeps_itself_marked_stalled() -> None:
    """Its renewals tell the database, so no taker treats it as gone before its lease expires
    (a next block may start just as it is cut off, before the watchdog's own mark lands)."""
    async with harness(loop_stall=5.0) as h:
        await h.started()
        await until(lambda: h.lease_db.renewals > 1)
        assert not h.lease_db.stalled, "a service whose kinds never blocked is not marked"
        row = h.store.add("blocks", params={"block": 0.15})
        await h.run(row)
        await until(lambda: h.lease_db.stalled)


async def test_the_renewals_report_the_takes_in_flight() -> None:
    """A take that lasts (a slow database link) is reported by every renewal until it lands:
    the leader's audit sends no start of it anew meanwhile."""
    async with harness() as h:
        await h.started()
        row = h.store.add("tick")
        taking = await h.take_held(row)
        renewals = h.lease_db.renewals
        await until(lambda: h.lease_db.renewals > renewals + 1)
        assert h.lease_db.taking == {row.id}
        assert h.store.hold is not None
        h.store.hold.set()
        await taking
        await h.running(row)
        renewals = h.lease_db.renewals
        await until(lambda: h.lease_db.renewals > renewals)
        assert h.lease_db.taking == set()


async def test_a_delete_runs_the_kinds_cleanup_to_its_end() -> None:
    async with harness() as h:
        row, delivery = await h.started("cleans")
        row.status = S.ON_DELETING
        await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        await h.stopped(row)
        assert CLEANUP[row.id] == 10, "a stop asked under a valid lease runs the whole cleanup"
        assert delivery.outcome == "ack"


async def test_a_copy_whose_lease_is_lost_never_runs_its_cleanup() -> None:
    """From the fence on, another service may run the observer: the copy is abandoned, its
    ``finally`` never runs (it would be a second copy's side effect)."""
    async with harness() as h:
        row, _ = await h.started("cleans")
        h.lease_db.available = False  # renewals fail until the deadline passes
        await until(lambda: h.lease.fenced)
        h.lease_db.available = True
        await h.stopped(row)
        assert CLEANUP.get(row.id, 0) == 0, "the cleanup of a copy that lost its lease ran"


async def test_a_cleanup_under_way_stops_where_the_lease_is_lost() -> None:
    async with harness() as h:
        row, _ = await h.started("cleans")
        row.status = S.ON_DELETING
        h.lease_db.available = False
        await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        await until(lambda: CLEANUP.get(row.id, 0) >= 1)
        h.clock.advance(TIMINGS.ttl)  # the deadline passes in the middle of the cleanup
        await until(lambda: h.lease.fenced)
        done = CLEANUP[row.id]
        await asyncio.sleep(0.1)  # five more of its steps would have run by now
        assert CLEANUP[row.id] == done < 10, "the cleanup went on after the lease was lost"
        h.lease_db.available = True
        await h.stopped(row)


async def test_a_superseded_copy_never_runs_its_cleanup() -> None:
    """Taken by another service while the lease session was down: the lease comes back on a
    new session, yet that copy's code never runs again, cleanup included."""
    async with harness() as h:
        taken, _ = await h.started("cleans")
        h.lease_db.available = False
        h.lease_db.sessions[-1].end()
        await asyncio.sleep(0.05)
        taken.service_id, taken.epoch = uuid.uuid4(), taken.epoch + 1  # the other service's take
        h.lease_db.available = True
        await h.stopped(taken)
        assert CLEANUP.get(taken.id, 0) == 0, "the superseded copy's cleanup ran"
        assert not h.lease.fenced


async def test_the_leases_clock_starts_once_the_join_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new session parses the join first: a round trip, a second or more on a slow link. The
    lease's clock starts when the join is sent, after that; started before, the parse ate into
    the deadline the join set, and the first renewal on a slow link outlasted it."""

    async def slow_parse(_: FakeLeaseSession) -> None:
        await asyncio.sleep(0.3)

    since_sent: list[float] = []
    confirmed = LeaseKeeper._confirmed

    def timed(self: LeaseKeeper, sent: float) -> None:
        since_sent.append(self.clock.now() - sent)
        confirmed(self, sent)

    monkeypatch.setattr(FakeLeaseSession, "prepare_join", slow_parse)
    monkeypatch.setattr(LeaseKeeper, "_confirmed", timed)
    async with harness():
        pass
    assert since_sent, "no join"
    assert since_sent[0] < 0.2, f"the lease's clock ran {since_sent[0]:.2f}s before its join"


async def test_a_lease_session_that_cannot_be_replaced_fences_at_the_deadline() -> None:
    async with harness() as h:
        rows = [h.store.add("tick") for _ in range(3)]
        for r in rows:
            await h.run(r)
        for r in rows:
            await h.running(r)
        h.lease_db.available = False  # the lease session cannot be replaced yet
        h.lease_db.sessions[-1].end()
        await h.broker.session.close()  # and the broker connection is gone too
        await until(lambda: h.lease.fenced)
        h.lease_db.available = True
        await until(lambda: not h.service.runners)
        assert all(r.service_id is None for r in rows)
        await until(lambda: len(h.lease_db.joins) == 2)
        assert h.lease_db.joins[0] != h.lease_db.joins[1], "a new lock key"


# ------------------------------------------------------------------------ the broker goes away
async def test_a_closed_broker_session_stops_no_copy_and_its_redelivery_is_adopted() -> None:
    async with harness() as h:
        row, first = await h.started()
        old = h.broker.session
        await old.close()
        await until(lambda: h.broker.session is not old)  # the service reconnects
        before = TICKS[row.id]
        await until(lambda: TICKS[row.id] > before + 3)
        runner = h.service.runners[row.id]
        assert runner.stop_reason is None
        assert row.epoch == 1
        again = await h.run(row, redelivered=True)
        assert again.outcome is None, "the redelivery is held as the copy's start"
        assert h.service.runners[row.id].origin.live
        assert row.epoch == 1, "adopted, not taken again"
        assert first.outcome is None
        duplicate = await h.run(row, redelivered=True)
        assert duplicate.outcome == "ack", "a second one is a duplicate"


async def test_a_copy_that_lost_its_delivery_publishes_its_start_when_it_lets_go() -> None:
    async with harness() as h:
        row, first = await h.started()
        await h.broker.session.close()
        await until(lambda: len(h.broker.sessions) == 2)
        h.service.drain()
        await h.stopped(row)
        assert first.outcome is None
        assert h.broker.sent == [(row.start, None)], "published anew to the work queue"
        assert row.service_id is None


async def test_a_redelivery_whose_holder_goes_on_is_dropped_after_a_short_wait() -> None:
    """The holder lost its broker session and goes on; its lock is held: a duplicate."""
    async with harness() as h:
        holder = uuid.uuid4()
        h.store.services[holder] = FakeService(live=True, lock_free=False)
        row = h.store.add("tick", status=S.PROCESSING, service_id=holder, epoch=3)
        started = time.monotonic()
        delivery = await h.run(row, redelivered=True)
        assert delivery.outcome == "ack"
        assert time.monotonic() - started < TIMINGS.ttl, "waited as long as a lease"
        assert (row.service_id, row.epoch) == (holder, 3)


# ---------------------------------------------------------------- every start is settled
async def test_a_take_that_meets_a_database_error_is_retried_and_runs() -> None:
    async with harness() as h:
        row = h.store.add("tick")
        h.store.available = False
        taking = asyncio.create_task(h.run(row))
        await until(lambda: h.store.calls.count("read_facts") >= 3)
        h.store.available = True
        delivery = await asyncio.wait_for(taking, 2)
        await h.running(row)
        assert delivery.outcome is None


async def test_a_take_whose_reply_was_lost_is_found_by_reading_the_row_again() -> None:
    async with harness() as h:
        row = h.store.add("tick")
        h.store.lose_replies = 1  # the take commits, its reply never comes
        await h.run(row)
        await h.running(row)
        assert row.epoch == 2, "taken again with a new epoch"
        assert row.service_id == h.service.id


async def test_a_take_that_fails_until_the_lease_is_lost_is_requeued() -> None:
    async with harness() as h:
        row = h.store.add("tick")
        h.store.available = False
        h.lease_db.available = False
        delivery = await asyncio.wait_for(h.run(row), 3)
        assert delivery.outcome == "requeue"
        assert row.id not in h.service.runners


async def test_a_suspend_past_the_lease_fences() -> None:
    async with harness() as h:
        row, _ = await h.started()
        h.clock.advance(TIMINGS.ttl)  # the machine slept; the monotonic clock did not count it
        await h.stopped(row)
        assert row.service_id is None


async def test_a_renewal_that_finds_the_lease_expired_fences() -> None:
    async with harness() as h:
        row, _ = await h.started()
        h.lease_db.expired = True
        await h.stopped(row)
        await until(lambda: len(h.lease_db.joins) == 2)


async def test_reconcile_never_releases_a_take_in_flight() -> None:
    async with harness() as h:
        row = h.store.add("tick")
        taking = await h.take_held(row)
        reconcile = asyncio.create_task(h.service._reconcile())
        await asyncio.sleep(0.02)
        assert not reconcile.done(), "reconcile ran while a take was in flight"
        assert h.store.hold is not None
        h.store.hold.set()
        await taking
        await reconcile
        await h.running(row)
        assert row.service_id == h.service.id


async def test_kind_code_never_resumes_after_the_lease_is_lost() -> None:
    resumed: list[float] = []

    async def waits(ctx: ObserverContext) -> None:
        ctx.ensure_alive()
        await asyncio.sleep(0.1)  # a pool acquire, a connect: not through ctx
        resumed.append(time.monotonic())
        while True:
            await ctx.sleep(1)

    KINDS["waits"] = KindSpec("waits", waits)
    async with harness() as h:
        row = h.store.add("waits")
        await h.run(row)
        await until(lambda: row.id in h.service.runners)
        h.clock.advance(TIMINGS.ttl)  # lost while the kind awaits
        await h.stopped(row)
        assert resumed == []


async def test_a_lost_lease_stops_even_a_copy_that_waits_long() -> None:
    """The guard would stop it at its next resumption, an hour from now; the service must not
    wait that long to release it and come back."""

    async def sleeper(ctx: ObserverContext) -> None:
        await ctx.checkpoint({"started": True})
        await asyncio.sleep(3600)

    KINDS["sleeper"] = KindSpec("sleeper", sleeper)
    async with harness() as h:
        row = h.store.add("sleeper")
        await h.run(row)
        await until(lambda: row.checkpoint is not None)
        h.clock.advance(TIMINGS.ttl)
        await h.stopped(row)
        assert row.service_id is None
        await until(lambda: len(h.lease_db.joins) == 2)


async def test_kind_code_waits_for_a_fresh_renewal_after_a_pause() -> None:
    async with harness() as h:
        row, _ = await h.started()
        h.lease_db.available = False  # renewals fail: the lease grows stale, not yet lost
        await asyncio.sleep(TIMINGS.stale_after + 0.05)
        paused_at = TICKS[row.id]
        await asyncio.sleep(0.1)
        assert TICKS[row.id] <= paused_at + 1, "kind code ran on an unconfirmed lease"
        h.lease_db.available = True
        await until(lambda: TICKS[row.id] > paused_at + 3)
        assert row.epoch == 1


# ------------------------------------------------------------- a kind that blocks the loop
async def test_a_kind_that_blocks_the_loop_is_counted_and_failed() -> None:
    async with harness(loop_stall=0.1) as h:
        neighbour, _ = await h.started()
        row = h.store.add("blocks", params={"block": 0.15})
        await h.run(row)
        await until(lambda: row.status is S.FAILED)
        assert row.last_error is not None
        assert row.last_error.startswith("LoopBlocked: blocked the event loop for 0.")
        assert h.service.metrics.stalls.labels("blocks")._value.get() == 3
        assert not h.lease.fenced, "stalls shorter than the lease cost no lease"
        assert neighbour.epoch == 1


async def test_a_stall_past_the_lease_fails_the_copy_with_no_lease_and_cancels_it() -> None:
    async with harness(loop_stall=0.1) as h:
        row = h.store.add("blocks", params={"block": TIMINGS.ttl})
        await h.run(row)
        await until(lambda: row.status is S.FAILED)
        assert row.last_error is not None
        # Failed by the watchdog during the stall (before any other service could take it).
        assert row.last_error.startswith("blocked the event loop for more than 0.")
        assert row.restart_count < 2, "failed at once, not after its budget"
        await until(lambda: h.broker.cancels == [row.id])


async def test_a_start_that_finds_no_slot_is_requeued_after_a_while() -> None:
    """A copy whose delivery was lost holds its slot, which the prefetch no longer counts: a
    start for another observer waits for room only so long, then goes back for another
    service."""
    async with harness(worker_count=1) as h:
        await h.started()
        await h.broker.session.close()
        await until(lambda: len(h.broker.sessions) == 2)
        other = h.store.add("tick")
        delivery = await asyncio.wait_for(h.run(other), TIMINGS.stale_after + 2)
        assert delivery.outcome == "requeue"
        assert other.service_id is None


async def test_a_take_across_the_end_of_the_lease_session_is_released() -> None:
    """The new session's look at our rows does not cover a take that was in flight: it could
    have been taken from us since. It is released and requeued, never run."""
    async with harness() as h:
        row = h.store.add("tick")
        taking = await h.take_held(row)
        h.lease_db.sessions[-1].end()
        assert h.store.hold is not None
        h.store.hold.set()
        delivery = await taking
        assert delivery.outcome == "requeue"
        assert row.id not in h.service.runners
        assert row.service_id is None


def test_servers_run_with_the_collector_at_their_pace() -> None:
    """``run_loop`` (every manager worker and service) freezes the start-up heap and makes young
    collections rare: with CPython's defaults the collector took about 40 % of a service's CPU
    per observer taken at bulk intake (docs/benchmarks.md)."""
    code = (
        "import asyncio, gc\n"
        "from orch.cli import run_loop\n"
        "async def main() -> int:\n"
        "    print(gc.get_threshold()[0], gc.get_freeze_count() > 0)\n"
        "    return 0\n"
        "run_loop(main())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == [str(heap.YOUNG), "True"]


# ------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("how", ["deleted", "failed", "drained"])
async def test_an_ended_copy_is_freed_at_once_not_by_a_full_collection(how: str) -> None:
    """An ended copy's task kept its exception, whose traceback held the frames that held the
    copy: a cycle only a full collection frees, and a service running many copies runs one
    rarely (``orch_contracts.heap``). Settled, a copy leaves nothing behind for the collector."""
    async with harness(worker_count=60) as h:
        rows = [h.store.add("boom" if how == "failed" else "tick") for _ in range(40)]
        for row in rows:
            await h.run(row)
        if how == "failed":
            await until(lambda: all(r.status is S.FAILED for r in rows), 10)
        else:
            await until(lambda: len(h.service.runners) == len(rows))
            gc.collect()
            if how == "drained":
                h.service.drain()
            for row in rows if how == "deleted" else []:
                row.status = S.ON_DELETING
                await h.broker.session.control(CancelMessage(observer_id=row.id).to_bytes())
        await until(lambda: not h.service.runners and not h.service.admission.in_flight)
        await until(lambda: not h.service._background)
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            left = [type(o).__name__ for o in gc.garbage if type(o).__name__ == "Runner"]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert left == [], f"{len(left)} ended copies wait for a full collection"


# ----------------------------------------------------------------- the process's resources
async def test_a_copy_out_of_the_processs_files_moves_on_spending_one_restart() -> None:
    """EMFILE is the service's limit, not the kind's error: the copy is released and its start
    requeued for another service, not restarted here, the observer not failed; and this
    service takes no new start for a while (it would meet the same limit). The move spends a
    restart: a kind that exhausts every service it runs on fails once its budget is spent."""
    async with harness() as h:
        row = h.store.add("out_of_files")
        delivery = await h.run(row)
        await until(lambda: delivery.outcome == "requeue")
        assert (row.status, row.service_id) == (S.PROCESSING, None), "released, not failed"
        assert row.restart_count == 1
        assert "failed" not in row.events
        other = h.store.add("tick")
        turned_away = await h.run(other)
        await until(lambda: turned_away.outcome == "requeue")
        assert other.status is S.CREATED, "not taken here while short of resources"


async def test_a_kind_that_keeps_exhausting_its_service_fails_with_its_budget() -> None:
    async with harness() as h:
        row = h.store.add("out_of_files", restart_policy={"max_restarts": 0})
        delivery = await h.run(row)
        await until(lambda: row.status is S.FAILED)
        assert "Too many open files" in (row.last_error or "")
        assert delivery.outcome != "requeue"


# ---------------------------------------------------------------- directed through the database
async def test_an_observer_directed_here_whose_start_never_came_is_taken_at_a_renewal() -> None:
    """The leader directed it here, but the directed start never arrived (lost with a control
    queue while cut off from the broker, or not published in a broker alarm): the lease
    renewal reads it and takes it, once."""
    async with harness() as h:
        row = h.store.add("tick", directed_to=h.service.id)
        await h.running(row)
        assert (row.service_id, row.epoch, row.directed_to) == (h.service.id, 1, None)
        assert h.broker.sent == [], "nothing went through the broker"


async def test_a_copy_whose_session_ended_is_marked_as_holding_no_delivery() -> None:
    """The broker requeued its delivery (or lost it with a deleted queue): if this service dies
    now, nothing may be left to requeue, and the leader must not wait for one. An adopted
    redelivery marks it again."""
    async with harness() as h:
        row, _ = await h.started()
        assert row.queued_epoch == row.epoch
        first = h.broker.session
        await first.close()
        await until(lambda: row.queued_epoch is None)
        await until(lambda: h.broker.session is not first)
        await h.run(row, redelivered=True)  # the requeued start comes back here: adopted
        await until(lambda: row.queued_epoch == row.epoch)
        assert row.epoch == 1, "adopted, not taken again"


async def test_a_take_whose_delivery_callback_was_cancelled_is_released_at_once() -> None:
    """When its broker session closes, the client library cancels every delivery callback
    still running (the broker requeues their deliveries): one cut off while its take was
    committing held the row with nothing running it, until the periodic check (23 s unrun in
    a chaos run). The take is released as soon as it lands, for the requeued start to take."""
    async with harness() as h:
        row = h.store.add("tick")
        taking = await h.take_held(row)
        taking.cancel()  # as aiormq does to a consumer's callbacks when the channel closes
        await asyncio.sleep(0)
        assert h.store.hold is not None
        h.store.hold.set()
        await until(lambda: h.store.rows[row.id].epoch == 1)  # the take landed
        await until(lambda: h.store.rows[row.id].service_id is None)
        assert row.id not in h.service.runners
