"""``recorder``: a ticker that also logs every tick to a local file, outside the fenced path.

Tests and the benchmark read these files to see whether two copies of one observer ever ran at
the same time: a stale copy's checkpoints are refused, but its file lines are not.
"""

from __future__ import annotations

import json
import os
import time
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
        await ctx.checkpoint({"count": count})
        await ctx.sleep(params.interval)
