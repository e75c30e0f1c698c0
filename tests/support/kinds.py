"""Observer kinds used only by the tests (loaded with ORCH_KIND_MODULES=tests.support.kinds)."""

from __future__ import annotations

from pydantic import BaseModel

from observer_service import ObserverContext, RestartPolicy, observer_kind


class FlakyParams(BaseModel):
    fail_after: float = 0.0


@observer_kind(
    "always_fails", restart=RestartPolicy(max_restarts=2, base_delay=0.05, max_delay=0.2)
)
async def always_fails(ctx: ObserverContext) -> None:
    """Raises at once, every time."""
    await ctx.checkpoint({"attempt": (ctx.last_checkpoint or {}).get("attempt", 0) + 1})
    raise RuntimeError("boom")
