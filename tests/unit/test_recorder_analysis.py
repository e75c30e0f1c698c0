"""The overlap and gap measures the chaos tests and the benchmark rely on."""

from __future__ import annotations

import pytest

from orch_bench.ticklog import Tick, failover_gaps, overlap_seconds


def ticks(*spec: tuple[str, int, int, float]) -> list[Tick]:
    return [Tick(o, e, "s", p, t, 0) for o, e, p, t in spec]


def test_no_overlap_when_copies_follow_each_other() -> None:
    t = ticks(("a", 1, 10, 0.0), ("a", 1, 10, 1.0), ("a", 2, 11, 1.5), ("a", 2, 11, 3.0))
    assert overlap_seconds(t) == {}
    assert failover_gaps(t, at=1.2) == {"a": 0.5}


def test_overlap_is_measured() -> None:
    t = ticks(("a", 1, 10, 0.0), ("a", 2, 11, 1.0), ("a", 1, 10, 2.0), ("a", 2, 11, 3.0))
    assert overlap_seconds(t) == {"a": 1.0}


def test_same_epoch_in_two_processes_counts_as_two_copies() -> None:
    t = ticks(("a", 1, 10, 0.0), ("a", 1, 11, 0.5), ("a", 1, 11, 0.7), ("a", 1, 10, 1.0))
    assert overlap_seconds(t) == {"a": pytest.approx(0.2)}
    single = ticks(("a", 1, 10, 0.0), ("a", 2, 11, 0.5), ("a", 1, 10, 1.0))
    assert overlap_seconds(single) == {"a": 0.0}


def test_never_resumed_is_infinite() -> None:
    t = ticks(("a", 1, 10, 0.0), ("b", 1, 10, 0.0), ("b", 2, 11, 2.0))
    assert failover_gaps(t, at=1.0) == {"a": float("inf"), "b": 2.0}
