"""Pools where the leader decides: placement, rebalance plans and the take rule's facts."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from observer_service.ports import Seen, StartRequest
from observer_service.take import Decision, Departed, decide
from observer_service.taking import facts
from orch_contracts.messages import StartMessage
from orch_contracts.pools import check_pool
from orch_contracts.statuses import ObserverStatus
from orch_contracts.topology import Topology
from orch_manager.background import found, place
from orch_manager.rebalance import Load, plan_pools
from orch_manager.repository import Needs, Runs

a, b, c = (uuid.UUID(int=i) for i in (1, 2, 3))


def test_a_start_goes_only_to_a_service_of_its_pool_that_runs_its_kind() -> None:
    runs = {a: Runs("default", None), b: Runs("eu", {"ws": "2"}), c: Runs("eu", None)}
    free = {a: 9, b: 5, c: 1}
    assert place(free, [Needs("eu", "ws")] * 3, runs) == [b, b, b]
    assert place(free, [Needs("eu", "poll")] * 2, runs) == [c, None]
    assert place(free, [Needs("us", "ws")], runs) == [None]
    assert place(free, [Needs("default", "ws")], runs) == [a]


def test_a_start_pinned_to_a_version_goes_only_where_that_version_is() -> None:
    """A service of an earlier release (every kind, versions unknown) takes no pinned one."""
    runs = {a: Runs("eu", {"ws": "1"}), b: Runs("eu", {"ws": "2"}), c: Runs("eu", None)}
    free = {a: 9, b: 1, c: 9}
    assert place(free, [Needs("eu", "ws", "2")] * 2, runs) == [b, None]
    assert place(free, [Needs("eu", "ws", "3")], runs) == [None]


def test_rebalance_evens_each_pool_alone() -> None:
    """A busy pool next to an idle one: nothing moves across, each pool is evened out."""
    loads = [Load(a, 10, 10, "eu"), Load(b, 10, 0, "eu"), Load(c, 10, 0, "default")]
    moves = plan_pools(loads, pace=1.0)
    assert moves == [(a, b)] * 5


def test_a_pool_name_becomes_part_of_a_queue_name() -> None:
    topology = Topology("p")
    assert topology.work_queue_of("default") == "p.work"
    assert topology.work_queue_of("eu-1") == "p.work.eu-1"
    for bad in ("", "EU", "a.b", "x" * 64, "-eu"):
        with pytest.raises(ValueError, match="pool name"):
            check_pool(bad)


def test_a_start_of_another_pool_is_passed_on_never_taken() -> None:
    start = StartMessage(observer_id=a, dispatch_id=b)
    row = Seen(
        observer_id=a,
        status=ObserverStatus.CREATED,
        dispatch_id=b,
        epoch=0,
        holder=None,
        holder_live=False,
        holder_lock_free=False,
        holder_key=None,
        holder_remaining=0.0,
        name="x",
        kind="ws",
        params={},
        checkpoint=None,
        restart_policy=None,
        pool="eu",
    )
    req = StartRequest(start=start, redelivered=False, running_here=False)
    for pool, expected in (("default", Decision.NOT_HERE), ("eu", Decision.TAKE)):
        seen = facts(row, req, c, Departed(), None, pool)
        assert decide(seen, me=c, redelivered=False, running_here=False) is expected
    pinned = replace(row, kind_version="2")
    for versions, expected in (({"ws": "1"}, Decision.NOT_HERE), ({"ws": "2"}, Decision.TAKE)):
        seen = facts(pinned, req, c, Departed(), versions, "eu")
        assert decide(seen, me=c, redelivered=False, running_here=False) is expected


def test_directed_starts_go_to_services_found_on_the_broker_or_any_when_none_answered() -> None:
    """A lease says a process lives, not that a message reaches it: those found on the broker
    are chosen. When no probe answered (the broker restarting), any service with a lease may be
    chosen: it reads its directed starts from the database at its next renewal."""
    runs = {a: Runs("default", None), b: Runs("default", None)}
    free = {a: 9, b: 1}
    assert place(free, [Needs("default", "ws")] * 2, runs, among={b}) == [b, None]
    assert place(free, [Needs("default", "ws")], runs, among=found({a: None, b: None})) == [a]
    assert found({a: False, b: None}) == set()
    assert found({a: True, b: None}) == {a}
