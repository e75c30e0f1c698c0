"""``ticker``: counts and checkpoints its count; resumes from the last count after a move."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from observer_service.context import ObserverContext
from orch_contracts.kinds import observer_kind


class TickerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    interval: float = Field(default=1.0, ge=0.01, le=86_400, description="seconds between ticks")


@observer_kind("ticker", params=TickerParams)
async def ticker(ctx: ObserverContext) -> None:
    """Counts up every ``interval`` seconds and checkpoints the count."""
    params: TickerParams = ctx.params
    count = int((ctx.last_checkpoint or {}).get("count", 0))
    while True:
        count += 1
        await ctx.checkpoint({"count": count})
        await ctx.sleep(params.interval)
