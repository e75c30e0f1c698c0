"""The one retry backoff."""

from __future__ import annotations

from orch_contracts.backoff import Backoff


def test_it_doubles_up_to_its_cap_and_starts_again_after_a_reset() -> None:
    b = Backoff(0.02, 0.25)
    assert [b.next() for _ in range(6)] == [0.02, 0.04, 0.08, 0.16, 0.25, 0.25]
    b.reset()
    assert b.next() == 0.02


def test_jitter_only_lengthens_a_wait_and_by_at_most_its_share() -> None:
    b = Backoff(1.0, 1.0, jitter=0.2)
    waits = [b.next() for _ in range(200)]
    assert all(1.0 <= w <= 1.2 for w in waits)
    assert len(set(waits)) > 1
