"""The second half of the promise, judged from the witness: every live observer always has a copy
running, but for the moments a fault explains.

An observer's *evidence* is every record of its copies that shows its code ran (``run``, ``fx``,
``stall``). Between two pieces of evidence, and from its create to the first, no copy was seen
running; less the observer's own *cadence* (how long its code normally waits between two
resumptions: the 90th percentile of the intervals inside its copies), that is time it sat unrun.
Each such *gap* longer than ``TOLERANCE`` must be explained by the faults around it:

- a fault that does not take the observer's holder (a broker restart or alarm, a leader kill, a
  queue deleted, a broker link reset or cut) explains nothing: the gap may be ``TOLERANCE`` at
  most;
- a fault that ends the holder's lease session while it lives (a database reset or blip, the
  session killed) explains a gap until ``RECOVERY`` after it ended: its copies wait until a new
  session proved that none of them was taken (kind code of a service whose session ended
  never resumes before that), or, where no new session came in time, as a holder taken;
- a graceful stop of the holder (SIGTERM, a drain) explains a gap until the shutdown timeout
  and ``RECOVERY`` after it: a copy that could not stop or be released in time keeps its
  process until then;
- a fault that takes its holder (kill, freeze, suspend, isolation, a database partition, the
  lease session ended, a stall of its event loop; a slow link, which may cost the lease at any
  moment of it) explains a gap until ``lease TTL + 2 s`` after the fault began (after it ended,
  for a slow link), on the process that held the observer before the gap or ran it after;
- while such a recovery is under way, a fault that blocks every service's recovery (the broker
  stopped, the leader gone) extends it to ``lease TTL + 2 s`` after that fault ended;
- while no service can take work (each killed, stopped, draining, frozen, or with its broker or
  database link cut, reset or slow; the next still starting), a gap waits for one, and
  ``RECOVERY`` more (``Lives.takers``);
- a process the observer was placed on in the gap (taken by it, or a start directed to it, as
  the database recorded it) held it there, though no step of its copy was seen: a fault on it
  counts as one on its holder;
- a start that went to a process cut off from taking it (its broker or database link cut,
  reset or slow) waits there until the fault ends, a lease TTL at most, and ``RECOVERY`` more:
  a start directed there, or a new observer's (any consumer may have it); or a killed holder's,
  which the broker requeued to any consumer, when a process taking work was cut off then or
  within ``TOLERANCE`` after (while it took it);
- a queue deleted while the observer was between two holders took its start: recovery counts
  from the deletion, as for a holder taken;
- a create waits for what blocks every publish (the broker stopped or alarmed, the leader gone);
- its own restart back-off, its delete and its failure are not gaps; a row of its locked from
  outside explains its own wait until the lock ends;
- a silence inside one copy (the same process and epoch on both sides) while that process's
  event loop kept resuming other copies (never more than ``TOLERANCE`` without one) is not a
  gap: the copy was there and its process live; its code was awaiting its own work (a slow
  answer from the page it polls). A silence of the whole process is judged as any other gap.

Anything beyond is ``UNAVAILABLE``. The mirror for deletes: once a delete was answered, every
copy of the observer is asked to stop within ``TOLERANCE`` plus one lease renewal (the renewal
backs up a lost cancel), later only while a fault kept the cancel from its holder.
"""

from __future__ import annotations

import json
import statistics
import sys
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from orch_contracts.kinds import RestartPolicy
from orch_contracts.witness import Reader, Record

#: Seconds of unrun time no fault needs to explain (a move, a take, a busy core).
TOLERANCE = 1.0
#: Seconds after the bound of its lease TTL that a takeover may take (sweep, dispatch, take).
RECOVERY = 2.0

#: Faults that take the holder from the moment they begin (recovery counts from the start).
TAKE_AT_START = frozenset(
    {"kill", "crash_blip", "freeze", "suspend", "isolate", "db_partition", "lease_kill", "stall"}
)
#: Faults that may cost the holder its lease at any moment until they end.
TAKE_AT_END = frozenset({"slow_link"})
#: Faults that end the holder's lease session while it lives: its copies wait until a new
#: session has proven that none of them was taken (the design's rule), then go on.
END_SESSION = frozenset({"db_reset", "db_blip", "lease_kill"})
#: Faults that keep a service from taking work promptly while they last (and ``RECOVERY``
#: after): cut off from the broker (no start reaches it), or its database link cut, reset or
#: slow (a take is a few round trips).
CANNOT_TAKE = frozenset(
    {
        "amqp_partition",
        "isolate",
        "broker_close",
        "db_blip",
        "db_reset",
        "db_partition",
        "slow_link",
        "lease_kill",
    }
)
#: Graceful stops of the holder: its copies move as soon as they stopped, or once its process
#: gave up waiting for them (``ORCH_SHUTDOWN_TIMEOUT``) and exited.
GRACEFUL = frozenset({"term", "drain"})
#: Faults that take the start of an observer between two holders (its start message in the
#: queue): recovery counts from the fault, as for a holder taken.
TAKE_THE_START = frozenset({"queue_deleted"})
#: Faults that close the holder's broker connection at once: the broker requeues its start to
#: any consumer.
REQUEUE_AT_ONCE = frozenset({"kill", "crash_blip"})
#: Faults that block every service's recovery until they end.
BLOCK_RECOVERY = frozenset({"broker_restart", "leader"})
#: Faults that block every publish, and so a new observer's first start, until they end.
BLOCK_PUBLISH = frozenset({"broker_restart", "alarm", "leader"})
#: Faults on a holder's links that can keep a cancel from it until they end.
CUT_CANCEL = frozenset(
    {
        "freeze",
        "suspend",
        "isolate",
        "db_partition",
        "db_blip",
        "lease_kill",
        "slow_link",
        "amqp_partition",
        "broker_close",
        "stall",
        "broker_restart",
        "queue_deleted",
    }
)
#: Evidence that a copy's code ran.
EVIDENCE = frozenset({"run", "fx", "stall"})


@dataclass
class Fault:
    """A fault as applied: what, from when to when (wall time), on which service process (None:
    the whole cluster), and for a row lock, which observer's row."""

    name: str
    start: float
    end: float
    pid: int | None = None
    observer: str | None = None

    def describe(self, zero: float) -> str:
        where = f" on pid {self.pid}" if self.pid is not None else ""
        span = f" to {self.end - zero:.2f}s" if self.end - self.start >= 0.05 else ""
        return f"{self.name}{where} at {self.start - zero:.2f}s{span}"


@dataclass(frozen=True)
class Lives:
    """When each observer lived, as the campaign saw its API answers and the history."""

    #: Observer -> wall time its create was answered.
    created: dict[str, float]
    #: Observer -> wall time its delete was answered (its copies stop within a renewal of it).
    deleted: dict[str, float] = field(default_factory=dict)
    #: Observer -> wall time its delete was sent: its life ends then, for the gaps (the delete
    #: may take effect any time before its answer).
    delete_sent: dict[str, float] = field(default_factory=dict)
    #: Observer -> when it was marked failed (its own errors: not a gap from then on).
    failed: dict[str, float] = field(default_factory=dict)
    #: Observer -> when each restart of its copy was recorded, oldest first.
    restarts: dict[str, list[float]] = field(default_factory=dict)
    #: Kind -> its restart policy (how long each back-off may be).
    policies: dict[str, RestartPolicy] = field(default_factory=dict)
    #: Per service process, when it took work: from ready to killed, stopped or drained;
    #: and when it was frozen meanwhile. While none took work, a gap waits for one.
    takers: dict[int, tuple[float, float]] = field(default_factory=dict)
    paused: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    #: Observer -> each time the database placed it on a service process: taken by it, or a
    #: start directed to it (when, which process). A process it was placed on in a gap held
    #: it there, though no step of its copy was seen.
    placed: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def taker_after(self, start: float, until: float) -> float | None:
        """If no service took work at some moment in [``start``, ``until``], the first moment
        after the last such moment when one did (inf: none ever did again), counting the
        ``RECOVERY`` after each such taker too (a taker that came, then froze, took nothing);
        else None."""
        if not self.takers:
            return None
        edges = [t for w in self.takers.values() for t in w]
        edges += [t for ws in self.paused.values() for w in ws for t in w]
        found: float | None = None
        while True:
            idle = next(
                (
                    t
                    for t in sorted({start, *(t for t in edges if start < t < until)})
                    if not self._taking_at(t)
                ),
                None,
            )
            if idle is None:
                return found
            found = self._next_taking(idle)
            if found == float("inf"):
                return found
            start, until = found, max(until, found + RECOVERY)

    def took_work(self, pid: int | None, t: float) -> bool:
        """Whether process ``pid`` took work at ``t`` (a process the run did not record: maybe)."""
        if pid is None or pid not in self.takers:
            return True
        a, b = self.takers[pid]
        return a <= t < b and not any(x <= t < y for x, y in self.paused.get(pid, []))

    def _taking_at(self, t: float) -> bool:
        return any(self.took_work(pid, t) for pid in self.takers)

    def _next_taking(self, t: float) -> float:
        starts = sorted(
            {a for a, _ in self.takers.values() if a > t}
            | {y for ws in self.paused.values() for _, y in ws if y > t}
        )
        return next((s for s in starts if self._taking_at(s)), float("inf"))


@dataclass
class Gap:
    """A stretch in which no copy of a live observer was seen running, beyond its cadence."""

    observer: str
    kind: str
    start: float
    end: float
    #: Seconds unrun: the stretch less the observer's cadence.
    unrun: float
    #: Until when the faults around it explain it (wall time).
    explained_until: float
    #: The processes that ran it before and after (None: none).
    before: int | None
    after: int | None
    #: The faults that explain it, and the others around it.
    faults: list[Fault]

    @property
    def explained(self) -> bool:
        return self.end <= self.explained_until

    @property
    def beyond(self) -> float:
        """Seconds past what the faults explain."""
        return max(0.0, self.end - self.explained_until)


@dataclass
class LateStop:
    """A copy of a deleted observer asked to stop later than the delete allows."""

    observer: str
    kind: str
    epoch: int
    pid: int
    #: Seconds from the delete's answer to the copy's stop (or its last step).
    after: float
    allowed: float


@dataclass
class KindDowntime:
    observers: int = 0
    #: Seconds its observers lived, and sat unrun (beyond their cadence), all gaps counted.
    live: float = 0.0
    unrun: float = 0.0
    #: Of those, seconds no fault explains.
    unexplained: float = 0.0

    @property
    def fraction(self) -> float:
        return self.unrun / self.live if self.live > 0 else 0.0


@dataclass
class Availability:
    #: Every gap longer than ``TOLERANCE``, explained or not.
    gaps: list[Gap] = field(default_factory=list)
    late_stops: list[LateStop] = field(default_factory=list)
    downtime: dict[str, KindDowntime] = field(default_factory=dict)

    @property
    def unavailable(self) -> list[Gap]:
        """Gaps no fault explains, longest past its explanation first."""
        return sorted((g for g in self.gaps if not g.explained), key=lambda g: -g.beyond)

    @property
    def held(self) -> bool:
        return not self.unavailable and not self.late_stops

    def as_dict(self, zero: float) -> dict[str, Any]:
        return {
            "held": self.held,
            "unavailable": [
                {
                    "observer": g.observer,
                    "kind": g.kind,
                    "from": round(g.start - zero, 3),
                    "to": round(g.end - zero, 3),
                    "unrun_seconds": round(g.unrun, 3),
                    "beyond_seconds": round(g.beyond, 3),
                    "faults": [f.describe(zero) for f in g.faults],
                }
                for g in self.unavailable
            ],
            "late_stops": [
                {
                    "observer": s.observer,
                    "kind": s.kind,
                    "epoch": s.epoch,
                    "pid": s.pid,
                    "after_seconds": round(s.after, 3),
                    "allowed_seconds": round(s.allowed, 3),
                }
                for s in self.late_stops
            ],
            "gaps": [
                {
                    "observer": g.observer,
                    "from": round(g.start - zero, 3),
                    "unrun_seconds": round(g.unrun, 3),
                    "explained": g.explained,
                    "by": [f.describe(zero) for f in g.faults[:3]],
                }
                for g in self.gaps
            ],
            "gaps_over_tolerance": len(self.gaps),
            "longest_gap_seconds": round(max((g.unrun for g in self.gaps), default=0.0), 3),
            "downtime": {
                kind: {
                    "observers": d.observers,
                    "live_seconds": round(d.live, 1),
                    "unrun_seconds": round(d.unrun, 3),
                    "unexplained_seconds": round(d.unexplained, 3),
                }
                for kind, d in sorted(self.downtime.items())
            },
        }

    def lines(self, zero: float) -> list[str]:
        out = []
        for g in self.unavailable:
            since = "its create" if g.before is None else f"pid {g.before}'s last step"
            faults = "; ".join(f.describe(zero) for f in g.faults) or "no fault"
            out.append(
                f"UNAVAILABLE {g.kind} {g.observer}: no copy ran for {g.unrun:.2f}s, from "
                f"{since} at {g.start - zero:.2f}s to {g.end - zero:.2f}s"
                f"{f' (pid {g.after})' if g.after is not None else ' (none since)'}, "
                f"{g.beyond:.2f}s past what the faults explain (around it: {faults})"
            )
        for s in self.late_stops:
            out.append(
                f"RAN AFTER DELETE {s.kind} {s.observer}: epoch {s.epoch} in process {s.pid} was "
                f"stopped {s.after:.2f}s after its delete was answered (allowed {s.allowed:.2f}s)"
            )
        return out


def judge_availability(
    records: Sequence[Record],
    *,
    kinds: dict[str, str],
    lives: Lives,
    faults: Sequence[Fault],
    ttl: float,
    renew_interval: float,
    end: float,
    shutdown_timeout: float = 10.0,
) -> Availability:
    """Gaps and late stops of every observer in ``kinds`` (observer -> kind), judged at ``end``
    (wall time) against ``faults``; a stall of a process's event loop in ``records`` counts as
    a fault on that process."""
    faults = [*faults, *_stalls(records)]
    evidence: dict[str, list[Record]] = defaultdict(list)
    resumed: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.observer is not None and r.r in EVIDENCE:
            evidence[r.observer].append(r)
            resumed[r.pid].append(r.at)
    out = Availability()
    judge_ = _Judge(faults, ttl, renew_interval, lives, shutdown_timeout)
    judge_.resumed = {pid: sorted(ats) for pid, ats in resumed.items()}
    for observer, kind in kinds.items():
        points = sorted(evidence.get(observer, []), key=lambda r: r.at)
        downtime = out.downtime.setdefault(kind, KindDowntime())
        downtime.observers += 1
        born = lives.created.get(observer)
        if born is None:
            continue  # created outside the campaign: nothing to measure from
        ends = lives.delete_sent.get(observer, lives.deleted.get(observer, end))
        last = min(end, ends, lives.failed.get(observer, end))
        downtime.live += max(0.0, last - born)
        policy = lives.policies.get(kind, RestartPolicy())
        restarts = lives.restarts.get(observer, [])
        for gap in judge_.gaps(observer, kind, points, born, last, restarts, policy):
            downtime.unrun += gap.unrun
            if gap.unrun > TOLERANCE:
                out.gaps.append(gap)
                if not gap.explained:
                    downtime.unexplained += gap.beyond
        if (deleted := lives.deleted.get(observer)) is not None:
            out.late_stops += judge_.late_stops(observer, kind, records, deleted)
    return out


def _stalls(records: Iterable[Record]) -> list[Fault]:
    """A step that held a process's event loop: a freeze of that process (``stall`` records are
    stamped when the step ended)."""
    return [
        Fault("stall", r.at - float(r.detail.get("d", 0.0)), r.at, r.pid)
        for r in records
        if r.r == "stall"
    ]


def cadence(points: Sequence[Record]) -> float:
    """How long the observer's code normally waits between two resumptions: the 90th percentile
    of the intervals inside its copies (0: too few to tell)."""
    by_copy: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for r in points:
        by_copy[r.copy].append(r.at)
    steps = sorted(b - a for ats in by_copy.values() for a, b in pairwise(ats))
    if len(steps) < 3:
        return 0.0
    return steps[min(len(steps) - 1, round(0.9 * (len(steps) - 1)))]


class _Judge:
    def __init__(
        self,
        faults: Sequence[Fault],
        ttl: float,
        renew_interval: float,
        lives: Lives,
        shutdown_timeout: float,
    ) -> None:
        self.faults = sorted(faults, key=lambda f: f.start)
        self.ttl = ttl
        self.renew_interval = renew_interval
        self.lives = lives
        self.shutdown_timeout = shutdown_timeout
        #: Per process, when any copy of it resumed (sorted): its event loop was running.
        self.resumed: dict[int, list[float]] = {}

    def loop_ran(self, pid: int, start: float, stop: float) -> bool:
        """Whether ``pid``'s event loop resumed some copy at least every ``TOLERANCE`` seconds
        from ``start`` to ``stop``."""
        ats = self.resumed.get(pid, [])
        inside = ats[bisect_right(ats, start) : bisect_right(ats, stop)]
        marks = [start, *inside, stop]
        return all(b - a <= TOLERANCE for a, b in pairwise(marks))

    def gaps(
        self,
        observer: str,
        kind: str,
        points: Sequence[Record],
        born: float,
        last: float,
        restarts: Sequence[float],
        policy: RestartPolicy,
    ) -> list[Gap]:
        """Every stretch of the observer's life from ``born`` to ``last`` without evidence,
        with what explains it."""
        step = cadence(points)
        out: list[Gap] = []
        before: Record | None = None
        for r in [*points, None]:
            start = born if before is None else before.at
            stop = last if r is None else min(r.at, last)
            waiting = (
                before is not None
                and r is not None
                and r.copy == before.copy
                and self.loop_ran(r.pid, start, stop)
            )
            if stop > start and not waiting:
                unrun = stop - start - (0.0 if before is None else step)
                if unrun > 0:
                    gap = Gap(
                        observer,
                        kind,
                        start,
                        stop,
                        unrun,
                        start,
                        None if before is None else before.pid,
                        None if r is None else r.pid,
                        [],
                    )
                    self._explain(gap, step, restarts, policy)
                    out.append(gap)
            if r is not None and r.at >= last:
                break
            before = r
        return out

    def _explain(
        self, gap: Gap, step: float, restarts: Sequence[float], policy: RestartPolicy
    ) -> None:
        """Until when the faults (and the observer's own restarts) explain ``gap``."""
        until = gap.start + (0.0 if gap.before is None else step) + TOLERANCE
        for n, at in enumerate(restarts, 1):  # its own error, then its back-off: no gap
            if gap.start - TOLERANCE <= at <= gap.end:
                backoff = policy.nominal_delay(n) + policy.base_delay
                until = max(until, at + backoff + TOLERANCE)
        initial = gap.before is None
        pids = {p for p in (gap.before, gap.after) if p is not None}
        placed = [
            (at, pid)
            for at, pid in self.lives.placed.get(gap.observer, [])
            if gap.start - TOLERANCE <= at <= gap.end
        ]
        pids |= {pid for _, pid in placed}
        used: list[Fault] = []
        taken = False
        changed = True
        while changed:
            changed = False
            for f in self.faults:
                if f in used or f.start > until or f.end + self.ttl + RECOVERY < gap.start:
                    continue
                bound = self._bound(f, gap, pids, placed, initial=initial, taken=taken)
                if bound is None:
                    continue
                used.append(f)
                taken = taken or f.name in TAKE_AT_START | TAKE_AT_END | GRACEFUL | END_SESSION
                if bound > until:
                    until, changed = bound, True
        # While no service took work at all (each killed, stopped or draining, the next one
        # still starting), the observer waits for one: its start is in the queue, or found
        # by the one that comes (a new lease session first, for one that was frozen).
        taker = self.lives.taker_after(gap.start, until)
        if taker is not None:
            until = max(until, taker + RECOVERY)
        gap.explained_until = until
        gap.faults = used + [
            f
            for f in self.faults
            if f not in used and gap.start - 5 <= f.start <= gap.end and f.name != "churn"
        ]

    def _bound(
        self,
        f: Fault,
        gap: Gap,
        pids: set[int],
        placed: Sequence[tuple[float, int]],
        *,
        initial: bool,
        taken: bool,
    ) -> float | None:
        """Until when ``f`` explains ``gap`` (None: it does not)."""
        recovered = self.ttl + RECOVERY
        holder = initial or f.pid in pids
        if f.name in TAKE_AT_START and holder:
            return f.start + recovered
        if f.name in TAKE_AT_END and holder:
            return f.end + recovered
        if f.name in END_SESSION and holder:
            # It bridges to a new session once the fault ends, or, failing that, its lease
            # ends and the observer moves as from a holder taken.
            return max(f.end + RECOVERY, f.start + recovered)
        if f.name in GRACEFUL and holder:
            # A copy that cannot stop in time (a kind slow to stop, a release that cannot land)
            # keeps its process until the shutdown timeout; then it moves as from a crash.
            return f.start + self.shutdown_timeout + RECOVERY
        if f.name in TAKE_THE_START and gap.start <= f.start <= gap.end:
            return f.start + recovered
        if f.name in CANNOT_TAKE:
            # Its start was directed to a process cut off from taking it, or went to any
            # consumer (a new observer's), and so maybe to one cut off then; or the broker
            # requeued it to any consumer when a kill closed its holder's connection, maybe to
            # a process taking work that was cut off then or within ``TOLERANCE`` after (while
            # it took it: a take is a few round trips). It waits there until the fault ends or
            # the manager sends it elsewhere.
            sent = [at for at, pid in placed if pid == f.pid and f.start <= at <= f.end]
            if initial and f.start <= gap.start <= f.end:
                sent.append(gap.start)
            requeued = [
                g.start
                for g in self.faults
                if g.name in REQUEUE_AT_ONCE
                and g.pid in pids
                and gap.start - TOLERANCE <= g.start <= gap.end
            ]
            sent += [
                at
                for at in requeued
                if f.start - TOLERANCE <= at <= f.end and self.lives.took_work(f.pid, at)
            ]
            waits = [min(f.end, max(at, f.start) + self.ttl) + RECOVERY for at in sent]
            return max(waits, default=None)
        if f.name in BLOCK_RECOVERY and taken:
            return f.end + recovered
        if f.name in BLOCK_PUBLISH and initial:
            return f.end + recovered
        if f.name == "row_lock" and f.observer == gap.observer:
            return f.end + TOLERANCE
        return None

    def late_stops(
        self, observer: str, kind: str, records: Sequence[Record], deleted: float
    ) -> list[LateStop]:
        """Copies of a deleted observer that ran past the delete's answer and were asked to stop
        (or stopped, or ran their last step) later than a fault on their holder explains."""
        first: dict[tuple[str, int, int], float] = {}
        last: dict[tuple[str, int, int], float] = {}
        stopped: dict[tuple[str, int, int], float] = {}
        for r in records:
            if r.observer != observer:
                continue
            if r.r in EVIDENCE:
                first.setdefault(r.copy, r.at)
                last[r.copy] = r.at
            elif r.r in ("stop", "end") and r.copy not in stopped:
                stopped[r.copy] = r.at
        out = []
        for copy, at in last.items():
            if at <= deleted + TOLERANCE:
                continue
            _, epoch, pid = copy
            stop = stopped.get(copy, at)
            allowed = self._cancel_reaches(pid, deleted)
            if stop > allowed:
                out.append(LateStop(observer, kind, epoch, pid, stop - deleted, allowed - deleted))
        return out

    def _cancel_reaches(self, pid: int, deleted: float) -> float:
        """Until when a cancel answered at ``deleted`` may take to reach the copy on ``pid``: a
        renewal at most, or a renewal after a fault that cut the holder off ends (a holder cut
        off longer than its lease fences itself)."""
        renewal = self.renew_interval + TOLERANCE
        until = deleted + renewal
        changed = True
        used: list[Fault] = []
        while changed:
            changed = False
            for f in self.faults:
                if f in used or f.name not in CUT_CANCEL or f.start > until:
                    continue
                if f.pid not in (None, pid) or f.end < deleted - self.ttl:
                    continue
                used.append(f)
                bound = min(f.end, f.start + self.ttl) + renewal
                if f.name in ("freeze", "suspend", "stall"):
                    bound = f.end + renewal  # it cannot run meanwhile, and wakes to a renewal
                if bound > until:
                    until, changed = bound, True
        return until


def downtime_line(a: Availability) -> str:
    """One line: unrun time per kind, as a share of the time its observers lived."""
    parts = [
        f"{kind} {d.unrun:.1f}s of {d.live:.0f}s ({100 * d.fraction:.2f} %"
        + (f", {d.unexplained:.1f}s unexplained" if d.unexplained else "")
        + ")"
        for kind, d in sorted(a.downtime.items())
        if d.live > 0
    ]
    longest = max((g.unrun for g in a.gaps), default=0.0)
    median = statistics.median([g.unrun for g in a.gaps]) if a.gaps else 0.0
    return (
        f"downtime (no copy running, beyond each observer's cadence): {', '.join(parts) or '-'}; "
        f"{len(a.gaps)} gap(s) over {TOLERANCE:.0f}s, median {median:.2f}s, longest {longest:.2f}s"
    )


@dataclass
class Inputs:
    """What ``judge_availability`` was given besides the witness records: saved beside the
    witness directory of a run (``INPUTS``), to judge it again offline (``rejudge``)."""

    kinds: dict[str, str]
    lives: Lives
    faults: list[Fault]
    ttl: float
    renew_interval: float
    end: float
    shutdown_timeout: float
    #: The moment the run's times count from.
    zero: float = 0.0

    def judge(self, records: Sequence[Record]) -> Availability:
        return judge_availability(
            records,
            kinds=self.kinds,
            lives=self.lives,
            faults=self.faults,
            ttl=self.ttl,
            renew_interval=self.renew_interval,
            end=self.end,
            shutdown_timeout=self.shutdown_timeout,
        )

    def save(self, path: Path) -> None:
        data = asdict(self)
        data["lives"]["policies"] = {
            kind: policy.model_dump() for kind, policy in self.lives.policies.items()
        }
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> Inputs:
        data = json.loads(path.read_text())
        lives = data.pop("lives")
        lives.setdefault("placed", lives.pop("takes", {}))  # its name in the first saves
        by_pid = ("takers", "paused")
        return cls(
            lives=Lives(
                **{k: v for k, v in lives.items() if k not in (*by_pid, "policies", "placed")},
                policies={k: RestartPolicy(**v) for k, v in lives["policies"].items()},
                takers={int(pid): (a, b) for pid, (a, b) in lives["takers"].items()},
                paused={int(pid): [tuple(w) for w in ws] for pid, ws in lives["paused"].items()},
                placed={o: [(at, pid) for at, pid in ts] for o, ts in lives["placed"].items()},
            ),
            faults=[Fault(**f) for f in data.pop("faults")],
            **data,
        )


#: Where a run keeps its ``Inputs``: beside its witness directory.
INPUTS = "availability.json"


def rejudge(workdir: Path) -> Availability:
    """Judge a kept run again (``workdir``: its logs, witness and ``INPUTS``), with this
    version of the judge."""
    inputs = Inputs.load(workdir / INPUTS)
    return inputs.judge(Reader(workdir / "witness").read())


if __name__ == "__main__":  # python -m orch_verify.availability <workdir>
    where = Path(sys.argv[1])
    zero = Inputs.load(where / INPUTS).zero
    print("\n".join(rejudge(where).lines(zero)) or "held")
