"""The shared lease deadline, the clocks, and the guard that drives kind coroutines."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import pytest

from observer_service.guard import guarded
from orch_contracts.clock import Clock, set_suspend_lag
from orch_contracts.deadline import LeaseDeadline, LeaseTimings
from orch_contracts.errors import LeaseLost
from tests.support.fakes import ManualClock
from tests.unit.test_kinds_and_settings import _ctx as context

TIMINGS = LeaseTimings(ttl=5, renew_interval=1, margin=1)


def test_a_lease_is_valid_until_sent_plus_ttl_minus_margin() -> None:
    clock = ManualClock()
    d = LeaseDeadline(clock, TIMINGS)
    assert not d.valid(), "nothing is valid before the first renewal"
    sent = clock.now()
    d.renewed(sent)
    assert d.until == sent + 4
    clock.advance(3.9)
    assert d.valid()
    assert d.stale(), "not confirmed for more than renew_interval + margin"
    clock.advance(0.2)
    assert not d.valid()


def test_the_suspend_aware_clock_counts_what_the_monotonic_one_missed(tmp_path: Path) -> None:
    hook = tmp_path / "clock"
    clock = Clock(hook)
    before_now, before_mono = clock.now(), clock.monotonic()
    set_suspend_lag(hook, 10)
    assert clock.monotonic() < before_mono - 9, "the monotonic clock did not count the suspend"
    assert clock.now() >= before_now, "the suspend-aware one did"
    if hasattr(time, "CLOCK_BOOTTIME"):
        assert abs(clock.now() - time.clock_gettime(time.CLOCK_BOOTTIME)) < 1


async def test_the_guard_abandons_the_kind_before_it_resumes_on_a_lost_lease() -> None:
    lost = False
    after: list[str] = []

    def gate() -> asyncio.Future[None] | None:
        if lost:
            raise LeaseLost("gone")
        return None

    async def kind() -> None:
        await asyncio.sleep(0.05)
        after.append("side effect")

    task = asyncio.ensure_future(guarded(kind(), gate))
    await asyncio.sleep(0.01)
    lost = True
    with pytest.raises(LeaseLost):
        await task
    assert after == []


async def test_an_abandoned_copy_releases_what_it_registered_and_runs_no_cleanup() -> None:
    """A kind's own ``finally`` never runs once its lease is lost; what it registered with
    ``ctx.on_abandon`` (a socket to abort) is released instead, once, newest first."""
    lost = False
    seen: list[str] = []

    def gate() -> asyncio.Future[None] | None:
        if lost:
            raise LeaseLost("gone")
        return None

    ctx = context()

    async def kind() -> None:
        ctx.on_abandon(lambda: seen.append("socket aborted"))
        forget = ctx.on_abandon(lambda: seen.append("closed the ordinary way"))
        forget()
        ctx.on_abandon(lambda: seen.append("file closed"))
        try:
            await asyncio.sleep(0.05)
        finally:
            seen.append("finally")

    task = asyncio.ensure_future(guarded(kind(), gate, None, ctx.abandoned))
    await asyncio.sleep(0.01)
    lost = True
    with pytest.raises(LeaseLost):
        await task
    assert seen == ["file closed", "socket aborted"]
    ctx.abandoned()  # a second telling releases nothing twice
    assert seen == ["file closed", "socket aborted"]


async def test_the_guard_parks_the_kind_until_told_to_go_on() -> None:
    loop = asyncio.get_running_loop()
    park: asyncio.Future[None] | None = None
    steps: list[int] = []

    def gate() -> asyncio.Future[None] | None:
        return park if park is not None and not park.done() else None

    async def kind() -> None:
        for i in range(100):
            steps.append(i)
            await asyncio.sleep(0.001)

    task = asyncio.ensure_future(guarded(kind(), gate))
    await asyncio.sleep(0.01)
    park = loop.create_future()
    await asyncio.sleep(0.01)
    parked_at = len(steps)
    await asyncio.sleep(0.05)
    assert len(steps) == parked_at, "the kind ran on while parked"
    park.set_result(None)
    await asyncio.wait_for(task, 2)
    assert steps == list(range(100))


async def test_a_cancellation_reaches_a_parked_kind_once_the_gate_opens() -> None:
    """A stop asked while the lease is unconfirmed runs the kind's cleanup only after a renewal
    proved the copy still ours; the future the gate shares with other copies is spared."""
    shared: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    parking = False

    def gate() -> asyncio.Future[None] | None:
        if shared.done() or not parking:
            return None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def release(_: asyncio.Future[None]) -> None:
            if not fut.done():
                fut.set_result(None)

        shared.add_done_callback(release)
        return fut

    async def kind() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = asyncio.ensure_future(guarded(kind(), gate))
    await asyncio.sleep(0.01)
    parking = True
    task.cancel()
    await asyncio.sleep(0.02)
    assert seen == [], "the cleanup ran before the lease was confirmed"
    assert not task.done()
    shared.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"]


async def test_a_kind_parked_when_its_lease_is_lost_is_abandoned_untouched() -> None:
    park: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    parking = False

    def gate() -> asyncio.Future[None] | None:
        return park if parking else None

    async def kind() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            seen.append("finally")

    task = asyncio.ensure_future(guarded(kind(), gate))
    await asyncio.sleep(0.01)
    parking = True
    task.cancel()  # a stop asked meanwhile never reaches it either
    await asyncio.sleep(0.01)
    park.set_exception(LeaseLost("gone"))
    with pytest.raises(LeaseLost):
        await task
    gc.collect()
    assert seen == [], "an abandoned copy's finally ran"
