"""The availability judge (``orch_verify/availability.py``): gaps with no copy running, what
explains them, and deleted observers stopped late; from hand-made witness records."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from orch_contracts.kinds import RestartPolicy
from orch_contracts.witness import Record
from orch_verify.availability import (
    INPUTS,
    TOLERANCE,
    Availability,
    Fault,
    Inputs,
    Lives,
    cadence,
    downtime_line,
    judge_availability,
)

OID = "11111111-1111-1111-1111-111111111111"
TTL = 5.0


def ticks(pid: int, epoch: int, start: float, stop: float, every: float = 0.1) -> list[Record]:
    """A copy resuming every ``every`` seconds from ``start`` to ``stop``."""
    n = round((stop - start) / every)
    return [Record("run", OID, epoch, "svc", pid, start + i * every, {}) for i in range(n + 1)]


def judged(records: list[Record], faults: Sequence[Fault] = (), **lives: Any) -> Availability:
    end = lives.pop("end", max(r.at for r in records) + 0.05)
    return judge_availability(
        records,
        kinds={OID: "k"},
        lives=Lives(created={OID: lives.pop("created", 0.0)}, **lives),
        faults=list(faults),
        ttl=TTL,
        renew_interval=1.0,
        end=end,
    )


def test_a_copy_that_runs_all_along_has_no_gap_and_its_cadence_is_not_one() -> None:
    slow = ticks(10, 1, 0.1, 30.0, every=3.0)
    assert cadence(slow) == pytest.approx(3.0)
    a = judged(slow)
    assert a.gaps == []
    assert a.held
    assert a.downtime["k"].unrun < 0.2


def test_a_move_within_the_tolerance_is_no_finding_and_a_longer_one_unexplained_is() -> None:
    quick = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 5.6, 10.0)]
    assert judged(quick).held
    slow = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 8.0, 10.0)]
    a = judged(slow)
    (gap,) = a.unavailable
    assert (gap.before, gap.after) == (10, 20)
    assert gap.unrun == pytest.approx(2.9, abs=0.01)
    assert gap.beyond == pytest.approx(8.0 - (5.0 + 0.1 + TOLERANCE), abs=0.01)
    assert not a.held
    assert a.lines(0.0)[0].startswith("UNAVAILABLE k " + OID + ": no copy ran for 2.90s")


def test_a_copy_awaiting_its_own_work_in_a_live_process_has_no_gap() -> None:
    """A silence inside one copy while its process's loop resumes another copy all along: its
    code awaited its own I/O. The same silence with the whole process silent is a gap."""
    other = "22222222-2222-2222-2222-222222222222"
    neighbour = [
        Record("run", other, 1, "svc", 10, 0.1 + i * 0.1, {}) for i in range(round(12 / 0.1))
    ]
    waited = [*ticks(10, 1, 0.1, 5.0), *ticks(10, 1, 8.0, 12.0)]
    assert judged([*waited, *neighbour]).gaps == []
    (gap,) = judged(waited).unavailable  # no neighbour: the process was silent too
    assert gap.before == gap.after == 10
    moved = [*ticks(10, 1, 0.1, 5.0), *ticks(10, 2, 8.0, 12.0)]  # another copy: a real gap
    assert judged([*moved, *neighbour]).unavailable


def test_a_kill_of_the_holder_explains_a_gap_up_to_the_lease_ttl_and_two_seconds() -> None:
    kill = Fault("kill", 5.05, 5.05, pid=10)
    within = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 11.5, 14.0)]
    assert judged(within, [kill]).held
    beyond = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 13.0, 14.0)]
    (gap,) = judged(beyond, [kill]).unavailable
    assert gap.explained_until == pytest.approx(5.05 + TTL + 2)
    assert gap.faults == [kill]
    # A kill of another service explains nothing of this observer's gap.
    other = Fault("kill", 5.05, 5.05, pid=30)
    assert not judged(within, [other]).held


@pytest.mark.parametrize("name", ["alarm", "broker_restart", "leader", "queue_deleted"])
def test_a_fault_that_does_not_take_the_holder_explains_no_gap(name: str) -> None:
    """The copy runs on through it (the lease, not the broker, proves it the only one)."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(10, 1, 8.0, 10.0)]
    assert not judged(records, [Fault(name, 4.0, 20.0)]).held


def test_a_blocking_fault_extends_a_recovery_under_way_until_it_ends() -> None:
    """A holder killed while the broker is stopped: its observers come back once the broker is
    back, within the lease TTL and two seconds of that."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 20.0, 21.0)]
    kill = Fault("kill", 5.05, 5.05, pid=10)
    broker = Fault("broker_restart", 4.0, 15.0)
    assert judged(records, [kill, broker]).held
    assert not judged(records, [kill]).held
    # An alarm blocks publishers, not deliveries: failover must run through it.
    assert not judged(records, [kill, Fault("alarm", 4.0, 15.0)]).held


def test_a_slow_link_may_cost_the_lease_until_it_ends() -> None:
    records = [*ticks(10, 1, 0.1, 12.0), *ticks(20, 2, 17.0, 18.0)]
    assert judged(records, [Fault("slow_link", 2.0, 13.0, pid=10)]).held
    assert not judged(records, [Fault("db_blip", 2.0, 13.0, pid=10)]).held


def test_a_stall_of_the_event_loop_is_a_freeze_of_its_process() -> None:
    stall = Record("stall", "22222222-2222-2222-2222-222222222222", 1, "svc", 10, 9.0, {"d": 4.0})
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 10.0, 11.0), stall]
    a = judged(records)
    assert a.held, a.lines(0.0)


def test_its_own_restart_back_off_is_not_a_gap() -> None:
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(10, 1, 9.0, 10.0)]
    policy = RestartPolicy(base_delay=1.0, max_delay=60.0)
    # The third restart waits 4 s (plus a jitter of up to the base delay).
    own = judged(records, restarts={OID: [1.0, 2.0, 5.0]}, policies={"k": policy})
    assert own.held, own.lines(0.0)
    assert not judged(records).held


def test_a_create_is_running_within_the_tolerance_unless_every_publish_is_blocked() -> None:
    late = ticks(10, 1, 3.0, 5.0)
    (gap,) = judged(late, created=0.5).unavailable
    assert gap.before is None
    assert judged(late, [Fault("alarm", 0.0, 1.5)], created=0.5).held


def test_a_delete_ends_the_observers_life_and_its_copies_must_stop_in_time() -> None:
    deleted = 5.0
    stopped = [*ticks(10, 1, 0.1, 5.2), Record("stop", OID, 1, "svc", 10, 5.05, {})]
    a = judged(stopped, deleted={OID: deleted}, end=30.0)
    assert a.held, "no gap after its delete, and its copy was asked to stop at once"
    # A copy that ran on, with no stop asked, for 7 s after the delete was answered.
    late = [*ticks(10, 1, 0.1, 12.0), Record("stop", OID, 1, "svc", 10, 12.0, {})]
    (s,) = judged(late, deleted={OID: deleted}, end=30.0).late_stops
    assert (s.epoch, s.pid) == (1, 10)
    assert s.after == pytest.approx(7.0)
    assert s.allowed == pytest.approx(1.0 + TOLERANCE)
    # The same, frozen meanwhile: it could hear of the delete only once resumed.
    freeze = Fault("freeze", 4.0, 11.5, pid=10)
    assert judged(late, [freeze], deleted={OID: deleted}, end=30.0).held
    # A kind that goes on for a while once asked to stop is the kind's (its stop time).
    polite = [*ticks(10, 1, 0.1, 8.0), Record("stop", OID, 1, "svc", 10, 5.1, {})]
    assert judged(polite, deleted={OID: deleted}, end=30.0).held


def test_downtime_is_told_per_kind() -> None:
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 8.0, 10.0)]
    line = downtime_line(judged(records, [Fault("kill", 5.05, 5.05, pid=10)]))
    assert line.startswith(
        "downtime (no copy running, beyond each observer's cadence): k 3.0s of 10s"
    )
    assert "1 gap(s) over 1s" in line


def test_while_no_service_takes_work_a_gap_waits_for_the_next_one() -> None:
    """Its holder drained while the other service was killed and its replacement still
    starting: nobody could take it until that one was ready."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(30, 2, 8.2, 9.0)]
    takers = {10: (0.0, 5.05), 20: (0.0, 4.0), 30: (7.5, float("inf"))}
    assert judged(records, takers=takers).held
    assert not judged(records, takers={**takers, 30: (3.0, float("inf"))}).held
    # A frozen service takes nothing either.
    frozen = {30: [(3.0, 7.5)]}
    assert judged(records, takers={**takers, 30: (3.0, float("inf"))}, paused=frozen).held
    # The one that came needs a new lease session (or its start) to take it: RECOVERY, not more.
    assert judged([*ticks(10, 1, 0.1, 5.0), *ticks(30, 2, 9.4, 10.0)], takers=takers).held
    # One that came and froze at once took nothing: the wait goes on until it thawed.
    thawed = [*ticks(10, 1, 0.1, 5.0), *ticks(30, 2, 11.4, 12.0)]
    assert judged(thawed, takers=takers, paused={30: [(7.55, 9.5)]}).held
    assert not judged(thawed, takers=takers).held
    assert not judged([*ticks(10, 1, 0.1, 5.0), *ticks(30, 2, 9.7, 10.0)], takers=takers).held


def test_a_lost_lease_session_during_a_broker_restart_moves_once_the_broker_is_back() -> None:
    """The holder's database link cut past its lease: its observers move by a re-dispatch,
    which a broker restart holds until it is back."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 19.0, 20.0)]
    blip = Fault("db_blip", 5.0, 12.0, pid=10)
    assert not judged(records, [blip]).held
    assert judged(records, [blip, Fault("broker_restart", 6.0, 13.0)]).held


def test_every_stretch_with_no_taker_in_the_wait_extends_it() -> None:
    """Its holder was killed; a taker came, then later every service was frozen at once (all
    suspended), before the observer had run again: it waits for the first to thaw."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 14.5, 15.0)]
    kill = Fault("kill", 5.05, 5.05, pid=10)
    takers = {10: (0.0, 5.05), 20: (0.0, float("inf")), 30: (0.0, float("inf"))}
    paused = {20: [(5.2, 5.6), (8.0, 13.0)], 30: [(5.0, 6.0), (8.5, 14.0)]}
    assert judged(records, [kill], takers=takers, paused=paused).held
    assert not judged(records, [kill], takers=takers, paused={20: [(5.2, 5.6)]}).held


def test_a_fault_on_a_process_that_took_the_observer_in_the_gap_explains_it() -> None:
    """Its holder was killed; another took it (the database says so) and was killed before a
    step of its copy was seen; a third ran it a TTL later. The second kill explains the rest of
    the gap only because that process had taken it."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(30, 3, 14.0, 15.0)]
    faults = [Fault("kill", 5.05, 5.05, pid=10), Fault("kill", 9.5, 9.5, pid=20)]
    assert not judged(records, faults).held
    assert judged(records, faults, placed={OID: [(9.0, 20)]}).held
    assert not judged(records, faults, placed={OID: [(2.0, 20)]}).held  # before the gap


def test_a_start_sent_to_a_process_cut_off_from_taking_waits_for_the_audit() -> None:
    """A start that went to a process cut off from the broker (a new observer's, which any
    consumer may have had; or one directed there) waits until the cut ends or the audit sends
    it elsewhere: a lease TTL at most."""
    late = ticks(20, 1, 3.5, 5.0)
    cut = Fault("amqp_partition", 0.0, 4.0, pid=10)
    assert not judged(late, created=0.5).held
    (gap,) = judged(late, [cut], created=0.5).gaps
    assert gap.explained_until == pytest.approx(min(4.0, 0.5 + TTL) + 2.0)
    long_cut = Fault("amqp_partition", 0.0, 60.0, pid=10)
    (gap,) = judged(ticks(20, 1, 9.0, 10.0), [long_cut], created=0.5).gaps
    assert gap.explained_until == pytest.approx(0.5 + TTL + 2.0)
    # A holder's gap: only a cut process the observer was placed on explains it.
    moved = [*ticks(30, 1, 0.1, 2.0), *ticks(20, 2, 5.0, 6.0)]
    kill = Fault("kill", 2.05, 2.05, pid=30)
    assert judged(moved, [kill], created=0.0).held
    slow = [*ticks(30, 1, 0.1, 2.0), *ticks(20, 2, 11.0, 12.0)]
    cut = Fault("amqp_partition", 0.0, 20.0, pid=10)
    assert not judged(slow, [kill, cut], created=0.0).held
    (gap,) = judged(slow, [kill, cut], created=0.0, placed={OID: [(3.0, 10)]}).gaps
    assert gap.explained_until == pytest.approx(3.0 + TTL + 2.0)


def test_a_holders_start_requeued_to_a_process_cut_off_while_it_takes_it_waits_there() -> None:
    """The holder is killed; the broker requeues its start to another consumer, whose database
    link turns slow 0.4 s later, while it takes it (chaos seed 9): the start waits there as a
    new observer's would, until the fault ends, a lease TTL at most, and the recovery."""
    records = [*ticks(10, 1, 0.1, 2.0), *ticks(30, 2, 9.3, 10.0)]
    kill = Fault("kill", 2.05, 2.05, pid=10)
    slow = Fault("slow_link", 2.45, 12.0, pid=20)
    assert not judged(records, [kill]).held
    (gap,) = judged(records, [kill, slow]).gaps
    assert gap.explained_until == pytest.approx(2.45 + TTL + 2.0)
    # A link that turned slow long after the start came held nothing of it.
    late = Fault("slow_link", 6.0, 12.0, pid=20)
    assert not judged(records, [kill, late]).held
    # Nor one of a process that took no work then (not a consumer the requeue could reach).
    gone = {10: (0.0, 2.05), 20: (0.0, 1.0), 30: (0.0, 20.0)}
    assert not judged(records, [kill, slow], takers=gone).held
    # A frozen holder keeps its broker connection: nothing of its was requeued.
    frozen = Fault("freeze", 2.05, 2.1, pid=10)
    assert not judged(records, [frozen, slow]).held


def test_a_drain_during_a_broker_restart_moves_once_the_broker_is_back() -> None:
    """A drained holder hands its observers over through the broker: a restart of the broker
    holds the move until it is back, as it holds a crashed holder's."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 22.0, 23.0)]
    drain = Fault("drain", 5.0, 6.0, pid=10)
    assert not judged(records, [drain]).held  # the shutdown timeout (10 s) and 2 s
    assert judged(records, [drain, Fault("broker_restart", 4.0, 15.0)]).held


def test_a_run_is_judged_again_from_its_saved_inputs(tmp_path: Path) -> None:
    """What a run saves beside its witness (``INPUTS``) gives the same verdict offline."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(30, 3, 14.0, 15.0)]
    inputs = Inputs(
        kinds={OID: "k"},
        lives=Lives(
            created={OID: 0.0},
            policies={"k": RestartPolicy(max_restarts=3)},
            takers={10: (0.0, float("inf"))},
            paused={10: [(1.0, 2.0)]},
            placed={OID: [(9.0, 20)]},
        ),
        faults=[Fault("kill", 5.05, 5.05, pid=10), Fault("kill", 9.5, 9.5, pid=20)],
        ttl=TTL,
        renew_interval=1.0,
        end=15.05,
        shutdown_timeout=2.0,
        zero=0.5,
    )
    inputs.save(tmp_path / INPUTS)
    again = Inputs.load(tmp_path / INPUTS)
    assert again == inputs
    assert again.judge(records).as_dict(0.5) == inputs.judge(records).as_dict(0.5)


def test_a_queue_deleted_while_the_observer_was_between_holders_took_its_start() -> None:
    """Its start was in the work queue (a drain had released it) when the queue was deleted:
    the audit sends it anew. A queue deleted while it ran explains no gap."""
    records = [*ticks(10, 1, 0.1, 5.0), *ticks(20, 2, 8.5, 9.0)]
    assert judged(records, [Fault("queue_deleted", 5.5, 5.5)]).held
    assert not judged(records, [Fault("queue_deleted", 4.0, 4.0)]).held


def test_a_process_frozen_past_its_lease_takes_nothing_until_it_joined_again() -> None:
    """Thawed after its lease ended, a service fences, releases and joins on a new session (its
    broker connection opened anew) before it takes: ``RECOVERY`` after the thaw. A short
    freeze costs it nothing."""
    from types import SimpleNamespace
    from typing import cast

    from orch_verify.campaign import Campaign
    from orch_verify.run import _not_taking

    campaign = cast(Campaign, SimpleNamespace(paused={10: [(1.0, 9.0), (20.0, 20.5)]}, faults=[]))
    assert _not_taking(campaign, ttl=TTL) == {10: [(1.0, 11.0), (20.0, 20.5)]}
