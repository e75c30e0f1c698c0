"""The verdict, from the witness the services wrote (``contracts/witness.py``), not from the
orchestrator's tables: those show what the orchestrator believes, the witness what ran.

A *copy* is one run of an observer: its epoch and its process. It spans from its first record
(a resumption of its coroutine, or a side effect it declared) to its last. The promise holds when:

- no two copies of an observer span the same moment (an *overlap*);
- every live observer has a copy running at the end (else it is *lost*), unless it failed;
- no copy of a deleted observer was taken after its delete was accepted, none runs at the end;
- no restart was spent on the orchestrator's own errors.

One step is left out of the spans, and shown on its own: a copy's last step, made just after
its process was resumed from a SIGSTOP that cut it between its lease check and its resumption
(``witness.across_freeze``, at most one per freeze). No check can close that window; only a
fenced write makes what such a step sends harmless.

Per kind it also tells how long copies took to stop once asked, which ignored it (ran on past
the shutdown timeout), the longest event loop stall and memory growth per observer: a growth
sustained over the whole window, above ``GROWTH_FLAG`` and by ``GROWTH_GROWN`` (``trend``).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from orch_contracts.errors import Transient
from orch_contracts.witness import Record, across_freeze, overlapping
from orch_verify.availability import Availability, downtime_line
from orch_verify.outputs import OutputFindings


def _own_errors() -> frozenset[str]:
    """The class names of the orchestrator's own server errors (a restart records ``Name:
    message``). Driver errors are converted to these where they enter its code, so one that
    reached kind code arrives as one of these; a kind's own use of a driver stays its own."""
    found: set[str] = set()
    todo: list[type[BaseException]] = [Transient]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(found)


OWN_ERRORS = _own_errors()
#: Memory growth per observer above which a kind is flagged, bytes per minute (``trend``)...
GROWTH_FLAG = 64 * 1024
#: ... once it has grown by this much per observer, bytes: a minute's growth at the limit, so a
#: trend just above it is judged over a minute and a half of samples or more (a fast leak over
#: seconds), and noise or a buffer allocated once, a few KiB, never passes for one.
GROWTH_GROWN = GROWTH_FLAG
#: Memory samples taken in a process's first seconds are left out (imports, first buffers).
WARM_UP = 10.0
#: A trend is computed from at least this many samples after the warm-up, spanning at least
#: this many seconds (``observer_service/witnessing.py`` takes one every 5 s or more); how long
#: it must be to be flagged is ``GROWTH_GROWN``'s to say.
GROWTH_SAMPLES = 3
GROWTH_SPAN = 15.0


@dataclass
class Copy:
    observer: str
    epoch: int
    pid: int
    service: str
    first: float
    last: float
    stop_at: float | None = None
    stop_why: str = ""
    end_at: float | None = None
    #: A graceful stop gave up waiting for it.
    hung: bool = False
    #: Seconds its stop waited on the orchestrator's commit of its checkpoint (not the kind's).
    waited: float = 0.0

    @property
    def label(self) -> str:
        return f"epoch {self.epoch} in process {self.pid}"


@dataclass
class Overlap:
    observer: str
    kind: str
    a: Copy
    b: Copy
    seconds: float


@dataclass(frozen=True)
class Growth:
    """A kind's memory trend in one process, per observer (``trend``)."""

    #: Bytes per observer per minute, the lesser of the rates over its first and second half.
    rate: float
    #: Bytes per observer it grew by, from its first third to its last (medians).
    grown: float
    #: Seconds its samples span, and how many there are.
    span: float
    samples: int

    @property
    def flagged(self) -> bool:
        """Growing above ``GROWTH_FLAG`` all along, by ``GROWTH_GROWN`` or more."""
        return self.rate > GROWTH_FLAG and self.grown >= GROWTH_GROWN


@dataclass
class KindFigures:
    kind: str
    observers: int = 0
    stops: list[float] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    #: Stops that took longer than the timeout only while the orchestrator's own commit of the
    #: copy's checkpoint was under way (a locked row, a slow database): not the kind's fault.
    waited_on_commit: list[str] = field(default_factory=list)
    stalls: int = 0
    longest_stall: float = 0.0
    stalled_observer: str = ""
    #: Its memory trend where it grew the most (None: too few samples anywhere).
    memory: Growth | None = None
    failed: int = 0

    @property
    def growth(self) -> float | None:
        """Bytes per observer per minute (None: too few samples)."""
        return None if self.memory is None else self.memory.rate

    @property
    def grows(self) -> bool:
        """Its memory grew above ``GROWTH_FLAG``, all along and by ``GROWTH_GROWN`` or more."""
        return self.memory is not None and self.memory.flagged

    def stop_percentiles(self) -> tuple[float, float, float] | None:
        if not self.stops:
            return None
        s = sorted(self.stops)
        p99 = s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]
        return statistics.median(s), p99, s[-1]


@dataclass
class Verdict:
    overlaps: list[Overlap]
    lost: list[str]
    ran_after_delete: list[str]
    failed: dict[str, str]
    own_error_restarts: list[str]
    kinds: dict[str, KindFigures]
    shutdown_timeout: float
    copies: dict[tuple[str, int, int], Copy]
    #: Processes whose witness could not be written: nothing can be concluded.
    broken: list[str] = field(default_factory=list)
    #: Process names (pid -> name), for the lines.
    names: dict[int, str] = field(default_factory=dict)
    #: Observer -> kind, for every observer created.
    observer_kinds: dict[str, str] = field(default_factory=dict)
    #: Per overlapping observer, its history as the orchestrator recorded it (to read next to
    #: the copies and the faults).
    history: dict[str, list[str]] = field(default_factory=dict)
    #: Processes of the orchestrator that exited without being asked (a crash, a bug).
    exits: list[str] = field(default_factory=list)
    #: Creates and deletes of the campaign that no manager accepted in time.
    api_failures: list[str] = field(default_factory=list)
    #: Copies whose last step came just after their process was resumed (left out of spans).
    late_steps: list[str] = field(default_factory=list)
    #: What a plain consumer of ``<prefix>.outputs`` received (``orch_verify/outputs.py``).
    outputs: OutputFindings = field(default_factory=OutputFindings)
    #: The service processes alive at the end (a copy not ended in one runs at the end).
    alive: set[int] = field(default_factory=set)
    #: Deleted observer -> its epoch when its delete was accepted.
    deleted: dict[str, int] = field(default_factory=dict)
    #: The second half of the promise: gaps with no copy running, late stops after a delete
    #: (``orch_verify/availability.py``).
    availability: Availability = field(default_factory=Availability)
    #: Wall time the lines count their seconds from (the campaign's start).
    zero: float = 0.0

    def runs_at_end(self, c: Copy) -> bool:
        """The copy had not ended and its process was alive when the run was judged."""
        return c.end_at is None and c.pid in self.alive

    def ran_after_its_delete(self, c: Copy) -> bool:
        """The copy was taken after its observer's delete was accepted, or runs at the end."""
        epoch = self.deleted.get(c.observer)
        return epoch is not None and (c.epoch > epoch or self.runs_at_end(c))

    def where(self, c: Copy) -> str:
        name = self.names.get(c.pid)
        return f"epoch {c.epoch} on {name} (pid {c.pid})" if name else c.label

    @property
    def promise_held(self) -> bool:
        return not (
            self.overlaps
            or self.lost
            or self.ran_after_delete
            or self.own_error_restarts
            or self.broken
            or not self.availability.held
        )

    @property
    def stopped_in_time(self) -> bool:
        return all(
            not k.ignored and all(s <= self.shutdown_timeout for s in k.stops)
            for k in self.kinds.values()
        )

    @property
    def passed(self) -> bool:
        return (
            self.promise_held
            and self.stopped_in_time
            and not self.exits
            and not self.api_failures
            and self.outputs.held
        )

    def kind_of(self, observer: str) -> str:
        return self.observer_kinds.get(observer, "?")

    def lines(self) -> list[str]:
        """The verdict: its line first (whose fault each failure is), then one line per
        finding, each naming the kind, then the details (an observer's history once)."""
        out = [self.verdict_line()]
        out += [f"INCONCLUSIVE: the witness of {p} could not be written" for p in self.broken]
        out += [f"EXITED ON ITS OWN {e}" for e in self.exits]
        out += [f"API FAILED {f}" for f in self.api_failures]
        for o in self.overlaps:
            out.append(
                f"OVERLAP {o.kind} {o.observer}: {self.where(o.a)} and {self.where(o.b)} ran at "
                f"once for {o.seconds:.3f}s"
            )
        out += [f"STEP ACROSS A FREEZE {s}" for s in self.late_steps]
        out += [f"LOST {self.kind_of(o)} {o}: live, not running at the end" for o in self.lost]
        out += [f"RAN AFTER DELETE {self.kind_of(oid)} {oid}" for oid in self.ran_after_delete]
        out += self.availability.lines(self.zero)
        out += [f"RESTART ON THE ORCHESTRATOR'S ERROR {e}" for e in self.own_error_restarts]
        out += self.outputs.lines(self.observer_kinds)
        if self.availability.downtime:
            out.append(downtime_line(self.availability))
        if self.outputs.received:
            repeats = sum(self.outputs.repeats.values())
            out.append(
                f"outputs: {self.outputs.received} records received once each, {repeats} "
                "repeat(s) dropped"
            )
        for kind, k in sorted(self.kinds.items()):
            for what in k.ignored:
                out.append(f"IGNORED CANCELLATION {kind}: {what}")
            for what in k.waited_on_commit:
                out.append(f"STOP WAITED ON ITS COMMIT {kind}: {what}")
            if k.longest_stall:
                out.append(
                    f"STALL {kind}: blocked the event loop {k.stalls} time(s), longest "
                    f"{k.longest_stall:.2f}s by observer {k.stalled_observer}"
                )
            if k.memory is not None and k.grows:
                out.append(
                    f"MEMORY GROWTH {kind}: {k.memory.rate / 1024:.0f} KiB per observer per "
                    f"minute, {k.memory.grown / 1024:.0f} KiB per observer over "
                    f"{k.memory.span:.0f}s"
                )
            if k.failed:
                out.append(f"FAILED {kind}: {k.failed} observer(s) failed on their own errors")
        shown = (
            {o.observer for o in self.overlaps}
            | set(self.lost)
            | set(self.ran_after_delete)
            | {g.observer for g in self.availability.unavailable}
            | {s.observer for s in self.availability.late_stops}
        )
        for oid in sorted(shown):
            if history := self.history.get(oid):
                out.append(f"history of {self.kind_of(oid)} {oid}:")
                out += [f"  {h}" for h in history]
        return out

    def verdict_line(self) -> str:
        """One line: whether the orchestrator kept its promise (and, if not, how it broke
        it), then what the kinds did wrong, then what else failed the run."""
        broke = [
            f"{n} {what}"
            for n, what in (
                (len(self.overlaps), "overlap(s): two copies ran at once"),
                (len(self.lost), "observer(s) lost"),
                (len(self.ran_after_delete), "deleted observer(s) ran"),
                (len(self.own_error_restarts), "restart(s) spent on its own errors"),
                (
                    len({g.observer for g in self.availability.unavailable}),
                    "observer(s) unrun longer than the faults explain",
                ),
                (len(self.availability.late_stops), "deleted observer(s) stopped late"),
            )
            if n
        ]
        if not self.outputs.held:
            broke.append("outputs not delivered once each in order")
        if self.broken:
            head = "verdict: INCONCLUSIVE, a witness could not be written"
        elif broke:
            head = "verdict: the orchestrator BROKE its promise (" + ", ".join(broke) + ")"
        else:
            head = "verdict: the orchestrator kept its promise"
        faults = []
        for kind, k in sorted(self.kinds.items()):
            if k.ignored or any(s > self.shutdown_timeout for s in k.stops):
                faults.append(f"your kind `{kind}` did not stop in time when asked")
            if k.grows:
                faults.append(f"your kind `{kind}` keeps growing in memory")
        tail = "; ".join(faults) or "every kind stopped in time"
        if self.exits:
            tail += f"; {len(self.exits)} process(es) exited on their own"
        if self.api_failures:
            tail += f"; {len(self.api_failures)} API call(s) failed"
        return f"{head}; {tail}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "promise_held": self.promise_held,
            "stopped_in_time": self.stopped_in_time,
            "overlaps": [
                {
                    "observer": o.observer,
                    "kind": o.kind,
                    "seconds": round(o.seconds, 4),
                    "copies": [asdict(o.a), asdict(o.b)],
                }
                for o in self.overlaps
            ],
            "verdict": self.verdict_line(),
            "lost": [{"observer": o, "kind": self.kind_of(o)} for o in self.lost],
            "ran_after_delete": [
                {"observer": o, "kind": self.kind_of(o)} for o in self.ran_after_delete
            ],
            "availability": self.availability.as_dict(self.zero),
            "failed": self.failed,
            "own_error_restarts": self.own_error_restarts,
            "witness_broken": self.broken,
            "exited_on_their_own": self.exits,
            "api_failures": self.api_failures,
            "steps_across_a_freeze": self.late_steps,
            "outputs": self.outputs.as_dict(),
            "history": self.history,
            "kinds": {
                name: {
                    "observers": k.observers,
                    "stop_seconds_p50_p99_max": k.stop_percentiles(),
                    "stops": len(k.stops),
                    "ignored_cancellation": k.ignored,
                    "stops_waited_on_commit": k.waited_on_commit,
                    "stalls": k.stalls,
                    "longest_stall_seconds": round(k.longest_stall, 3),
                    "stalled_observer": k.stalled_observer,
                    "memory_growth_bytes_per_observer_per_minute": k.growth,
                    "memory_grown_bytes_per_observer": k.memory.grown if k.memory else None,
                    "memory_growth_seconds": round(k.memory.span, 1) if k.memory else None,
                    "memory_grows": k.grows,
                    "failed": k.failed,
                }
                for name, k in sorted(self.kinds.items())
            },
        }


def copies_of(records: list[Record]) -> dict[tuple[str, int, int], Copy]:
    """Every copy the records show, with its span, its stop request and its end."""
    copies: dict[tuple[str, int, int], Copy] = {}
    for rec in records:
        if rec.observer is None:
            continue
        copy = copies.get(rec.copy)
        if rec.r in ("run", "fx", "stall"):  # a stall is stamped when its step ended
            if copy is None:
                copy = copies[rec.copy] = Copy(
                    rec.observer, rec.epoch, rec.pid, rec.service, rec.at, rec.at
                )
            copy.last = max(copy.last, rec.at)
        elif copy is None:
            continue
        elif rec.r == "stop" and copy.stop_at is None:
            copy.stop_at, copy.stop_why = rec.at, str(rec.detail.get("x", ""))
        elif rec.r == "end":
            copy.end_at = rec.at
            copy.waited = float(rec.detail.get("w", 0.0))
        elif rec.r == "hung":
            # A copy whose code had ended (its release was what the service gave up on) keeps
            # the wait its end recorded.
            copy.hung = True
            copy.waited = max(copy.waited, float(rec.detail.get("w", 0.0)))
    return copies


def overlaps(copies: dict[tuple[str, int, int], Copy], kinds: dict[str, str]) -> list[Overlap]:
    pairs = overlapping(
        copies.values(),
        observer=lambda c: c.observer,
        first=lambda c: c.first,
        last=lambda c: c.last,
    )
    return [Overlap(a.observer, kinds.get(a.observer, "?"), a, b, s) for a, b, s in pairs]


def running_at_end(copies: dict[tuple[str, int, int], Copy], alive: set[int]) -> set[str]:
    """Observers with a copy that has not ended, in a process still alive."""
    return {c.observer for c in copies.values() if c.end_at is None and c.pid in alive}


def judge(
    records: list[Record],
    *,
    kinds: dict[str, str],
    live: set[str],
    deleted: dict[str, int],
    failed: dict[str, str],
    restarts: list[tuple[str, str]],
    alive: set[int],
    shutdown_timeout: float,
    paused: dict[int, list[tuple[float, float]]] | None = None,
) -> Verdict:
    """``kinds``: observer -> kind, for every observer created. ``live``: observers created and
    not deleted. ``deleted``: observer -> its epoch when its delete was accepted. ``failed``:
    observer -> its last error. ``restarts``: (observer, error) of every restart. ``alive``: the
    service processes alive at the end. ``paused``: per process, when it was stopped (SIGSTOP):
    a stop request's time excludes them, the copy could not run then."""
    late = across_freeze(
        (r for r in records if r.observer is not None and r.r in ("run", "fx", "stall")),
        pid=lambda r: r.pid,
        copy=lambda r: r.copy,
        at=lambda r: r.at,
        paused=paused or {},
    )
    left_out = {id(r) for r in late}
    copies = copies_of([r for r in records if id(r) not in left_out])
    running = running_at_end(copies, alive)
    lost = sorted(o for o in live if o not in running and o not in failed)
    after = sorted(
        {
            c.observer
            for c in copies.values()
            if c.observer in deleted
            and (c.epoch > deleted[c.observer] or (c.end_at is None and c.pid in alive))
        }
    )
    own = [f"{o}: {e[:200]}" for o, e in restarts if e.partition(":")[0].strip() in OWN_ERRORS]
    figures: dict[str, KindFigures] = {}
    for kind in kinds.values():
        figures.setdefault(kind, KindFigures(kind)).observers += 1
    for observer in failed:
        if observer in kinds:
            figures[kinds[observer]].failed += 1
    for c in copies.values():
        k = figures.setdefault(kinds.get(c.observer, "?"), KindFigures(kinds.get(c.observer, "?")))
        if c.stop_at is None:
            continue
        windows = (paused or {}).get(c.pid, [])
        if c.end_at is not None:
            spent = _running(c.stop_at, c.end_at, windows)
            took = max(0.0, spent - c.waited)  # the wait on its commit is the orchestrator's
            k.stops.append(took)
            if took > shutdown_timeout:
                k.ignored.append(
                    f"{c.observer} ({c.label}) stopped {took:.1f}s after it was asked "
                    f"({c.stop_why})"
                )
            elif spent > shutdown_timeout:
                k.waited_on_commit.append(
                    f"{c.observer} ({c.label}) stopped {spent:.1f}s after it was asked "
                    f"({c.stop_why}), {c.waited:.1f}s of them in the orchestrator's commit of "
                    "its checkpoint"
                )
        elif c.hung and c.waited > 0:
            k.waited_on_commit.append(
                f"{c.observer} ({c.label}) was in the orchestrator's commit of its checkpoint "
                f"when its service gave up waiting, {shutdown_timeout:.0f}s after it was asked "
                f"({c.stop_why})"
            )
        elif c.hung:
            k.ignored.append(
                f"{c.observer} ({c.label}) had not stopped when its service gave up waiting, "
                f"{shutdown_timeout:.0f}s after it was asked ({c.stop_why})"
            )
        elif (took := _running(c.stop_at, c.last, windows)) > shutdown_timeout:
            k.ignored.append(
                f"{c.observer} ({c.label}) ran {took:.1f}s after it was asked to stop "
                f"({c.stop_why}) and never ended"
            )
    for rec in records:
        if rec.r == "stall" and rec.observer is not None:
            kind = kinds.get(rec.observer, "?")
            k = figures.setdefault(kind, KindFigures(kind))
            k.stalls += 1
            d = float(rec.detail.get("d", 0.0))
            if d > k.longest_stall:
                k.longest_stall, k.stalled_observer = d, rec.observer
    for kind, growth in memory_growth(records).items():
        figures.setdefault(kind, KindFigures(kind)).memory = growth
    verdict = Verdict(
        overlaps(copies, kinds), lost, after, failed, own, figures, shutdown_timeout, copies
    )
    verdict.observer_kinds = dict(kinds)
    verdict.alive, verdict.deleted = set(alive), dict(deleted)
    verdict.late_steps = [
        f"{r.observer}: epoch {r.epoch} in process {r.pid} stepped once, {r.r} at {r.at:.3f}"
        for r in late
    ]
    return verdict


def _running(start: float, end: float, paused: list[tuple[float, float]]) -> float:
    """Seconds from ``start`` to ``end`` less the time the process was stopped in between."""
    stopped = sum(max(0.0, min(end, b) - max(start, a)) for a, b in paused)
    return max(0.0, end - start - stopped)


def memory_growth(records: list[Record]) -> dict[str, Growth]:
    """Per kind: its memory trend per observer (``Growth``) in the process where it grew the
    most: a flagged one first, else the steepest. Each process's samples are taken after
    ``WARM_UP``, where at least ``GROWTH_SAMPLES`` of them span ``GROWTH_SPAN`` or more."""
    found: dict[str, Growth] = {}
    for (kind, _pid), g in growth_series(records).items():
        best = found.get(kind)
        if best is None or (g.flagged, g.rate) > (best.flagged, best.rate):
            found[kind] = g
    return found


def growth_series(records: list[Record]) -> dict[tuple[str, int], Growth]:
    """Per kind and process, the trend of its bytes per observer (``trend``)."""
    series: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    first_seen: dict[int, float] = {}
    for rec in records:
        first_seen.setdefault(rec.pid, rec.at)
        if rec.r == "mem" and rec.detail.get("n"):
            kind = str(rec.detail["k"])
            series[(kind, rec.pid)].append((rec.at, rec.detail["b"] / rec.detail["n"]))
    found: dict[tuple[str, int], Growth] = {}
    for (kind, pid), points in series.items():
        points = [(t, v) for t, v in points if t - first_seen[pid] >= WARM_UP]
        if len(points) >= GROWTH_SAMPLES and points[-1][0] - points[0][0] >= GROWTH_SPAN:
            found[(kind, pid)] = trend(points)
    return found


def trend(points: list[tuple[float, float]]) -> Growth:
    """The growth of a series of (time, bytes) samples, oldest first, in three thirds: from
    the first third's medians (of time and of bytes) to the middle's, and from the middle's to
    the last's. Its rate is the lesser of the two: a series grows only if it grows all along,
    so a one-off step (a buffer allocated once, a cache filled once) is no trend, and medians
    leave out a single sample the allocator's noise put high or low."""
    third = max(1, len(points) // 3)
    parts = (points[:third], points[third:-third], points[-third:])
    (t1, v1), (t2, v2), (t3, v3) = (
        (statistics.median(t for t, _ in part), statistics.median(v for _, v in part))
        for part in parts
    )
    rates = [
        (b - a) / (tb - ta) if tb > ta else 0.0
        for a, b, ta, tb in ((v1, v2, t1, t2), (v2, v3, t2, t3))
    ]
    return Growth(
        rate=min(rates) * 60,
        grown=v3 - v1,
        span=points[-1][0] - points[0][0],
        samples=len(points),
    )
