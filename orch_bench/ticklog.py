"""Reading the tick logs that ``recorder`` observers write, and judging them.

A tick log is written outside the fenced path, by the observer's own code, so it shows what
really ran: two copies of one observer that ticked in overlapping time ran at once, whatever the
orchestrator's tables say. The benchmark and the tests judge every run from these files.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

from orch_contracts.witness import overlapping


@dataclass(frozen=True)
class Tick:
    observer: str
    epoch: int
    service: str
    pid: int
    at: float
    count: int

    @property
    def copy(self) -> tuple[int, int]:
        """Which running copy made the tick: its epoch and its process."""
        return (self.epoch, self.pid)


def _parse(lines: list[str]) -> list[Tick]:
    ticks: list[Tick] = []
    for line in lines:
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by SIGKILL
        ticks.append(Tick(d["o"], d["e"], d["s"], d["p"], d["t"], d["n"]))
    return ticks


def read_ticks(directory: str | Path) -> list[Tick]:
    """Every tick recorded under ``directory``, oldest first."""
    ticks: list[Tick] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        ticks += _parse(path.read_text().splitlines())
    ticks.sort(key=lambda t: t.at)
    return ticks


class TickTail:
    """The ticks written under ``directory`` since the last ``read`` (or ``skip``): each file
    is read on from where the last read ended, so a hundred thousand observers' logs are not
    parsed again on every look."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.offsets: dict[Path, int] = {}

    def _new(self, path: Path) -> bytes:
        with path.open("rb") as f:
            f.seek(self.offsets.get(path, 0))
            data = f.read()
        whole = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self.offsets[path] = self.offsets.get(path, 0) + whole
        return data[:whole]

    def read(self) -> list[Tick]:
        """The new ticks, in no particular order."""
        ticks: list[Tick] = []
        for path in sorted(self.directory.glob("*.jsonl")):
            ticks += _parse(self._new(path).decode().splitlines())
        return ticks

    def skip(self) -> None:
        """Pass over everything written so far without parsing it."""
        for path in self.directory.glob("*.jsonl"):
            self._new(path)


def overlap_seconds(ticks: list[Tick]) -> dict[str, float]:
    """Per observer, the seconds during which two copies (epoch, process) both ticked
    (``witness.overlapping``: a copy spans from its first to its last tick). Observers without
    overlap are left out."""
    spans: dict[tuple[str, tuple[int, int]], list[float]] = {}
    for t in ticks:
        span = spans.setdefault((t.observer, t.copy), [t.at, t.at])
        span[1] = t.at
    copies = [(observer, first, last) for (observer, _), (first, last) in spans.items()]
    result: dict[str, float] = {}
    pairs = overlapping(copies, observer=itemgetter(0), first=itemgetter(1), last=itemgetter(2))
    for (observer, _, _), _, seconds in pairs:
        result[observer] = result.get(observer, 0.0) + seconds
    return result


def failover_gaps(
    ticks: list[Tick], at: float, pid: int | None = None, *, from_fault: bool = False
) -> dict[str, float]:
    """Per observer that ticked before ``at`` (last in process ``pid``, if given): seconds from
    its last tick before ``at`` (from ``at`` itself with ``from_fault``, for ticks too sparse
    to time a gap by) to the first tick after ``at`` by another copy (inf when no other copy
    ever ticked)."""
    last_before: dict[str, Tick] = {}
    for t in ticks:
        if t.at <= at:
            last_before[t.observer] = t
    if pid is not None:
        last_before = {o: t for o, t in last_before.items() if t.pid == pid}
    gaps = {o: float("inf") for o in last_before}
    for t in ticks:
        before = last_before.get(t.observer)
        if before and t.at > at and t.copy != before.copy and gaps[t.observer] == float("inf"):
            gaps[t.observer] = t.at - (at if from_fault else before.at)
    return gaps


def last_tick_by_copy(ticks: list[Tick]) -> dict[tuple[str, int, int], float]:
    """(observer, epoch, pid) -> time of that copy's last tick."""
    out: dict[tuple[str, int, int], float] = {}
    for t in ticks:
        out[(t.observer, t.epoch, t.pid)] = t.at
    return out


def largest_gaps(ticks: list[Tick], start: float, end: float) -> dict[str, float]:
    """Per observer that ticked before ``start``: the longest time between two of its ticks
    (by any copy) within [``start``, ``end``], counting from its last tick before ``start``
    and up to ``end`` if it stopped ticking."""
    by_observer: dict[str, list[float]] = {}
    for t in ticks:
        by_observer.setdefault(t.observer, []).append(t.at)
    gaps: dict[str, float] = {}
    for observer, times in by_observer.items():
        before = [at for at in times if at <= start]
        if not before:
            continue
        points = [before[-1], *(at for at in times if start < at <= end), end]
        gaps[observer] = max(b - a for a, b in itertools.pairwise(points))
    return gaps
