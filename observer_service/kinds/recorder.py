"""``recorder``: a ticker that also logs every tick to a local file, outside the fenced path.

Tests and the benchmark read these files (``orch_bench.ticklog``) to see whether two copies of
one observer ever ran at the same time: a stale copy's checkpoints are refused, but its file
lines are not.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, Field

from observer_service.context import ObserverContext
from orch_contracts.kinds import observer_kind
from orch_contracts.witness import tick_line

_files: dict[str, IO[str]] = {}


class RecorderParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str = Field(description="directory for the tick logs (one file per process)")
    interval: float = Field(default=0.1, ge=0.005, le=3600)
    checkpoint_every: int = Field(default=1, ge=1, le=1_000_000, description="ticks per checkpoint")


def _file(directory: str) -> IO[str]:
    f = _files.get(directory)
    if f is None:
        path = Path(directory) / f"{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        f = _files[directory] = path.open("a", buffering=1)  # a line survives a SIGKILL
    return f


def write_tick(directory: str, ctx: ObserverContext, count: int) -> None:
    """Append one tick of this copy to ``{directory}/{pid}.jsonl`` (one JSON object a line)."""
    _file(directory).write(tick_line(ctx.observer_id, ctx.epoch, ctx.service_id, count))


@observer_kind("recorder", params=RecorderParams)
async def recorder(ctx: ObserverContext) -> None:
    """Ticks like ``ticker`` and appends every tick to ``{dir}/{pid}.jsonl``."""
    params: RecorderParams = ctx.params
    count = int((ctx.last_checkpoint or {}).get("count", 0))
    while True:
        ctx.ensure_alive()
        count += 1
        write_tick(params.dir, ctx, count)
        if count % params.checkpoint_every == 0 or count == 1:
            await ctx.checkpoint({"count": count})
        await ctx.sleep(params.interval)


class EmitterParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    interval: float = Field(default=0.1, ge=0.001, le=3600)
    per_tick: int = Field(default=1, ge=1, le=10_000, description="records emitted each tick")


@observer_kind("bench_emitter", params=EmitterParams, commit_every=0.005)
async def bench_emitter(ctx: ObserverContext) -> None:
    """Emits ``per_tick`` records ``{"t": wall time}`` every ``interval`` (the benchmark's
    outputs load); they commit on their own."""
    params: EmitterParams = ctx.params
    while True:
        now = time.time()
        for _ in range(params.per_tick):
            await ctx.emit({"t": now})
        await ctx.sleep(params.interval)
