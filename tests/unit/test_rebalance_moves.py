"""What a rebalancer remembers between rounds: the moves it asked for (which count, which are
forgotten, when a round waits) and which services may take part (on the broker, and steadily)."""

from __future__ import annotations

import uuid

from orch_manager.rebalance import Ledger, Load, Seen, Sightings


def ids(n: int) -> list[uuid.UUID]:
    return [uuid.UUID(int=i + 1) for i in range(n)]


def test_a_move_that_reached_its_target_is_not_picked_within_the_cooldown() -> None:
    o, target = ids(2)
    ledger = Ledger(cooldown=600, landing=10)
    ledger.record([(o, target)], now=0)
    assert ledger.update([Seen(o, target, in_motion=False)], now=1) == 0
    assert ledger.recent() == [o]
    ledger.update([], now=599)
    assert ledger.recent() == [o]
    ledger.update([], now=600)
    assert ledger.recent() == []


def test_a_round_waits_for_a_move_in_motion_but_not_forever() -> None:
    o, target = ids(2)
    ledger = Ledger(cooldown=600, landing=10)
    ledger.record([(o, target)], now=0)
    assert ledger.update([Seen(o, None, in_motion=True)], now=9.9) == 1, "released, not taken"
    assert ledger.update([Seen(o, None, in_motion=True)], now=10) == 0, "its start was lost"
    assert ledger.recent() == [], "a move that never landed is forgotten, no cooldown"


def test_a_handoff_that_did_not_reach_its_target_puts_no_cooldown() -> None:
    """Dropped (still on its holder) or bounced to the work queue (taken by another): it is not
    picked again while it may still be on its way, then it is free to move."""
    stayed, bounced, donor, other, target = ids(5)
    ledger = Ledger(cooldown=600, landing=10)
    ledger.record([(stayed, target), (bounced, target)], now=0)
    seen = [Seen(stayed, donor, in_motion=False), Seen(bounced, other, in_motion=False)]
    assert ledger.update(seen, now=1) == 0, "nothing between holders: the next round goes on"
    assert set(ledger.recent()) == {stayed, bounced}
    ledger.update(seen, now=10)
    assert ledger.recent() == []


def test_a_deleted_observer_is_forgotten() -> None:
    o, target = ids(2)
    ledger = Ledger(cooldown=600, landing=10)
    ledger.record([(o, target)], now=0)
    assert ledger.update([], now=1) == 0
    assert ledger.recent() == []


def test_only_services_on_the_broker_take_part() -> None:
    a, b = ids(2)
    loads = [Load(a, 10, 10), Load(b, 10, 0)]
    sightings = Sightings(min_age=0)
    assert sightings.steady(loads, {a}, now=0) == [Load(a, 10, 10)]
    assert sightings.steady(loads, {a, b}, now=0) == loads


def test_min_age_counts_again_from_the_last_time_a_service_was_seen_off_the_broker() -> None:
    a, b = ids(2)
    loads = [Load(a, 10, 10), Load(b, 10, 0)]
    sightings = Sightings(min_age=10)
    assert sightings.steady(loads, {a, b}, now=0) == loads, "never seen off: its row's age"
    assert sightings.steady(loads, {a}, now=5) == [Load(a, 10, 10)], "cut off"
    assert sightings.steady(loads, {a, b}, now=6) == [Load(a, 10, 10)], "back, not steady yet"
    assert sightings.steady(loads, {a, b}, now=14.9) == [Load(a, 10, 10)]
    assert sightings.steady(loads, {a, b}, now=15) == loads
