"""Kinds that break the rules, each in its own way, for ``orch verify`` to catch
(``ORCH_KIND_MODULES=tests.support.bad_kinds``)."""

from __future__ import annotations

import asyncio
import threading
import time

from pydantic import BaseModel, ConfigDict

from observer_service import ObserverContext, RestartPolicy, observer_kind


@observer_kind("swallower")
async def swallower(ctx: ObserverContext) -> None:
    """Never stops: every cancellation is caught and ignored."""
    while True:
        ctx.witness("tick")
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            continue


class LoopBlockerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Seconds it blocks the event loop each time.
    block: float = 2.0
    #: Seconds between two blocks.
    every: float = 5.0


@observer_kind(
    "loop_blocker",
    params=LoopBlockerParams,
    restart=RestartPolicy(max_restarts=100, base_delay=0.05, max_delay=0.2),
)
async def loop_blocker(ctx: ObserverContext) -> None:
    """Blocks the event loop (synchronous code) for ``block`` seconds every ``every`` seconds."""
    p: LoopBlockerParams = ctx.params
    while True:
        await ctx.sleep(p.every)
        time.sleep(p.block)  # noqa: ASYNC251 - blocking the loop is what it is for


@observer_kind("thread_writer")
async def thread_writer(ctx: ObserverContext) -> None:
    """Writes from a thread it starts and never stops: the thread goes on writing after the copy
    was stopped and the observer runs elsewhere. It says so before each write
    (``ctx.witness``), as a kind should, so the witness sees the second writer."""

    def write_forever() -> None:
        while True:
            ctx.witness("write")
            time.sleep(0.05)

    threading.Thread(target=write_forever, daemon=True).start()
    while True:
        await ctx.sleep(0.1)


_kept: list[bytes] = []


class LeakyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Bytes kept for ever at each tick.
    leak: int = 10_000
    interval: float = 0.05


@observer_kind("leaky", params=LeakyParams)
async def leaky(ctx: ObserverContext) -> None:
    """Keeps ``leak`` bytes more at every tick (a cache that is never trimmed)."""
    p: LeakyParams = ctx.params
    while True:
        _kept.append(bytes(p.leak))
        await ctx.sleep(p.interval)
