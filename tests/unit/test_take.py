"""Every branch of the take rule."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from observer_service.take import Decision as D
from observer_service.take import Facts, decide
from orch_contracts.statuses import ObserverStatus as S

ME, OTHER = uuid.uuid4(), uuid.uuid4()


def run(facts: Facts, *, redelivered: bool = False, here: bool = False) -> D:
    return decide(facts, me=ME, redelivered=redelivered, running_here=here)


def live(status: S, holder: uuid.UUID | None = None, **kw: object) -> Facts:
    kw.setdefault("dispatch_current", True)
    return Facts(exists=True, status=status, holder=holder, **kw)  # type: ignore[arg-type]


def test_missing_is_dropped() -> None:
    assert run(Facts(exists=False)) is D.DROP_MISSING


@pytest.mark.parametrize("status", [S.CREATED, S.PROCESSING])
def test_a_stale_start_runs_an_observer_nobody_runs(status: S) -> None:
    """Its newer start has not been taken (unpublished in a broker alarm, or waiting at a full
    service): whichever start comes first takes it, the epoch's compare-and-set once."""
    assert run(replace(live(status), dispatch_current=False)) is D.TAKE
    gone = live(status, OTHER, holder_live=False, dispatch_current=False)
    assert run(gone) is D.TAKE
    fenced_here = live(status, ME, holder_live=True, dispatch_current=False)
    assert run(fenced_here, here=False) is D.TAKE
    no_room = replace(live(status), dispatch_current=False)
    assert decide(no_room, me=ME, redelivered=False, running_here=False, room=False) is D.NO_ROOM


def test_a_stale_start_is_dropped_where_a_copy_runs_or_it_must_not_run_here() -> None:
    def stale(status: S, holder: uuid.UUID | None = None, **kw: object) -> Facts:
        return live(status, holder, dispatch_current=False, **kw)

    assert run(stale(S.PROCESSING, OTHER, holder_live=True)) is D.DROP_STALE
    assert run(stale(S.PROCESSING, OTHER, holder_live=True), redelivered=True) is D.DROP_STALE
    assert run(stale(S.PROCESSING, ME, holder_live=True), here=True) is D.DROP_STALE
    assert run(stale(S.CREATED, belongs_here=False)) is D.DROP_STALE
    for status in (S.DELETED, S.PAUSED, S.FAILED, S.ON_DELETING, S.PAUSING):
        assert run(stale(status)) is D.DROP_STALE


@pytest.mark.parametrize("status", [S.CREATED, S.PROCESSING])
def test_unheld_is_taken(status: S) -> None:
    assert run(live(status)) is D.TAKE


def test_deleted_and_paused_are_dropped() -> None:
    assert run(live(S.DELETED)) is D.DROP_DELETED
    assert run(live(S.PAUSED)) is D.DROP_PAUSED


@pytest.mark.parametrize("status", [S.ON_DELETING, S.PAUSING])
def test_a_stop_nobody_runs_is_completed_here(status: S) -> None:
    assert run(live(status)) is D.COMPLETE_STOP
    assert run(live(status, OTHER, holder_live=False)) is D.COMPLETE_STOP
    assert run(live(status, ME, holder_live=True), here=False) is D.COMPLETE_STOP


@pytest.mark.parametrize("status", [S.ON_DELETING, S.PAUSING])
def test_a_stop_with_a_live_holder_is_left_to_the_holder(status: S) -> None:
    assert run(live(status, OTHER, holder_live=True)) is D.DROP_STOPPING_ELSEWHERE


def test_failed_is_dropped() -> None:
    assert run(live(S.FAILED)) is D.DROP_FAILED


def test_held_by_me() -> None:
    assert run(live(S.PROCESSING, ME, holder_live=True), here=True) is D.DROP_DUPLICATE
    # Not running here (a fenced copy, or one on a dead channel): take it again, new epoch.
    assert run(live(S.PROCESSING, ME, holder_live=True), here=False) is D.TAKE


def test_held_by_expired_holder_is_taken() -> None:
    assert run(live(S.PROCESSING, OTHER, holder_live=False)) is D.TAKE


def test_first_delivery_while_a_live_holder_runs_it_is_a_duplicate() -> None:
    assert run(live(S.PROCESSING, OTHER, holder_live=True)) is D.DROP_DUPLICATE


def test_redelivery_from_a_live_holder_needs_proof_its_process_is_gone() -> None:
    held = live(S.PROCESSING, OTHER, holder_live=True, holder_lock_free=False)
    assert run(held, redelivered=True) is D.WAIT, "its session lives: it is stopping its copy"
    ended = live(S.PROCESSING, OTHER, holder_live=True, holder_lock_free=True)
    assert run(ended, redelivered=True) is D.PROBE, "a free lock alone proves nothing"
    gone = live(
        S.PROCESSING, OTHER, holder_live=True, holder_lock_free=True, holder_off_broker=True
    )
    assert run(gone, redelivered=True) is D.TAKE
    on_broker = live(
        S.PROCESSING, OTHER, holder_live=True, holder_lock_free=True, holder_off_broker=False
    )
    assert run(on_broker, redelivered=True) is D.WAIT


def test_a_copy_running_here_is_never_taken_again_whatever_the_row_says() -> None:
    assert run(live(S.ON_DELETING, ME, holder_live=True), here=True) is D.DROP_DUPLICATE


def test_a_kind_not_installed_here_is_passed_on_never_taken() -> None:
    me, other = uuid.uuid4(), uuid.uuid4()
    free = Facts(exists=True, status=S.CREATED, dispatch_current=True, belongs_here=False)
    assert decide(free, me=me, redelivered=False, running_here=False) is D.NOT_HERE
    assert decide(free, me=me, redelivered=False, running_here=False, room=False) is (D.NOT_HERE), (
        "passed on without waiting for a slot it would not use"
    )
    held = replace(free, status=S.PROCESSING, holder=other, holder_live=True)
    assert decide(held, me=me, redelivered=False, running_here=False) is D.DROP_DUPLICATE
    assert decide(held, me=me, redelivered=True, running_here=False) is D.NOT_HERE
    stopping = replace(free, status=S.ON_DELETING)
    assert decide(stopping, me=me, redelivered=False, running_here=False) is (D.COMPLETE_STOP), (
        "a stop nobody runs is completed by whoever sees it, kind or not"
    )
