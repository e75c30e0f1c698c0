"""Fair shares and the moves that reach them."""

from __future__ import annotations

import uuid

from orch_manager.rebalance import Load, balanced, plan_moves, plan_round, targets


def ids(n: int) -> list[uuid.UUID]:
    return [uuid.UUID(int=i + 1) for i in range(n)]


def test_equal_weights_split_evenly() -> None:
    a, b, c, d = ids(4)
    loads = [Load(a, 100, 30), Load(b, 100, 30), Load(c, 100, 30), Load(d, 100, 0)]
    goal = targets(loads)
    assert sorted(goal.values()) == [22, 22, 23, 23]
    assert sum(goal.values()) == 90
    moves = plan_moves(loads, max_moves=100)
    assert len(moves) == goal[d] == 22 or len(moves) == goal[d]
    assert all(t == d for _, t in moves)


def test_shares_follow_weights() -> None:
    a, b = ids(2)
    goal = targets([Load(a, 10, 20), Load(b, 30, 0)])
    assert goal == {a: 5, b: 15}
    assert len(plan_moves([Load(a, 10, 20), Load(b, 30, 0)], max_moves=100)) == 15


def test_balanced_or_tied_moves_nothing() -> None:
    a, b, c = ids(3)
    assert plan_moves([Load(a, 10, 5), Load(b, 10, 5)], max_moves=10) == []
    # 7 over 3 equal services: 3/2/2 is as fair as 2/3/2; nothing moves for a tie.
    assert plan_moves([Load(a, 10, 3), Load(b, 10, 2), Load(c, 10, 2)], max_moves=10) == []


def test_pace_limits_moves_per_round() -> None:
    a, b = ids(2)
    assert len(plan_moves([Load(a, 100, 100), Load(b, 100, 0)], max_moves=10)) == 10


def test_a_fleet_within_the_tolerance_is_left_alone() -> None:
    a, b, c = ids(3)
    near = [Load(a, 10, 104), Load(b, 10, 98), Load(c, 10, 98)]  # shares 100: 4 % off at most
    assert balanced(near, 0.05)
    assert plan_round(near, pace=1.0, tolerance=0.05, evening=False) == []
    # A rebalance under way goes on to the exact shares.
    assert len(plan_round(near, pace=1.0, tolerance=0.05, evening=True)) == 4
    # One service outside the band: the round evens out everything.
    far = [Load(a, 10, 110), Load(b, 10, 95), Load(c, 10, 95)]
    assert not balanced(far, 0.05)
    assert len(plan_round(far, pace=1.0, tolerance=0.05, evening=False)) == 10


def test_a_small_share_is_met_exactly() -> None:
    a, b = ids(2)
    assert not balanced([Load(a, 10, 11), Load(b, 10, 9)], 0.05)  # shares of 10: ±0
    assert balanced([Load(a, 10, 10), Load(b, 10, 10)], 0.05)


def test_the_band_is_kept_in_each_pool() -> None:
    a, b, c, d = ids(4)
    loads = [
        Load(a, 10, 100, "p"),
        Load(b, 10, 100, "p"),
        Load(c, 10, 30, "q"),
        Load(d, 10, 0, "q"),
    ]
    assert not balanced(loads, 0.05)
    moves = plan_round(loads, pace=1.0, tolerance=0.05, evening=False)
    assert sorted(moves) == sorted([(c, d)] * 15)
