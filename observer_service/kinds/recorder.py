"""``recorder``: a ticker that also logs every tick to a local file, outside the fenced path.

Tests and the benchmark read these files to see whether two copies of one observer ever ran at
the same time: a stale copy's checkpoints are refused, but its file lines are not.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, Field

from contracts.kinds import observer_kind
from observer_service.context import ObserverContext

_files: dict[Path, IO[str]] = {}


class RecorderParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str = Field(description="directory for the tick logs (one file per process)")
    interval: float = Field(default=0.1, ge=0.005, le=3600)
    checkpoint_every: int = Field(default=1, ge=1, le=1_000_000, description="ticks per checkpoint")


def _file(directory: str) -> IO[str]:
    path = Path(directory) / f"{os.getpid()}.jsonl"
    f = _files.get(path)
    if f is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = _files[path] = path.open("a", buffering=1)
    return f


@observer_kind("recorder", params=RecorderParams)
async def recorder(ctx: ObserverContext) -> None:
    """Ticks like ``ticker`` and appends every tick to ``{dir}/{pid}.jsonl``."""
    params: RecorderParams = ctx.params
    out = _file(params.dir)
    count = int((ctx.last_checkpoint or {}).get("count", 0))
    while True:
        ctx.ensure_alive()
        count += 1
        out.write(
            json.dumps(
                {
                    "o": str(ctx.observer_id),
                    "e": ctx.epoch,
                    "s": str(ctx.service_id),
                    "p": os.getpid(),
                    "t": time.time(),
                    "n": count,
                }
            )
            + "\n"
        )
        if count % params.checkpoint_every == 0 or count == 1:
            await ctx.checkpoint({"count": count})
        await ctx.sleep(params.interval)


# --------------------------------------------------------------------------- reading the logs
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


def read_ticks(directory: str | Path) -> list[Tick]:
    """Every tick recorded under ``directory``, oldest first."""
    ticks: list[Tick] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by SIGKILL
            ticks.append(Tick(d["o"], d["e"], d["s"], d["p"], d["t"], d["n"]))
    ticks.sort(key=lambda t: t.at)
    return ticks


def overlap_seconds(ticks: list[Tick]) -> dict[str, float]:
    """Per observer, the seconds during which two copies (epoch, process) both ticked.

    A copy spans from its first to its last tick; two spans that intersect mean two copies ran at
    the same time (a single tick inside another copy's span counts, as 0 s). Observers without
    overlap are left out.
    """
    spans: dict[str, dict[tuple[int, int], list[float]]] = {}
    for t in ticks:
        span = spans.setdefault(t.observer, {}).setdefault(t.copy, [t.at, t.at])
        span[1] = t.at
    result: dict[str, float] = {}
    for observer, copies in spans.items():
        ordered = sorted(copies.values())
        total, reach, overlapped = 0.0, ordered[0][1], False
        for start, end in ordered[1:]:
            if start <= reach:
                overlapped = True
                total += min(end, reach) - start
            reach = max(reach, end)
        if overlapped:
            result[observer] = total
    return result


def failover_gaps(ticks: list[Tick], at: float, pid: int | None = None) -> dict[str, float]:
    """Per observer that ticked before ``at`` (last in process ``pid``, if given): seconds from
    its last tick before ``at`` to the first tick after ``at`` by another copy (inf when no
    other copy ever ticked)."""
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
            gaps[t.observer] = t.at - before.at
    return gaps
