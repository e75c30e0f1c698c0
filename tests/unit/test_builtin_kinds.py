"""The built-in kinds, run with the kit kind authors get (``orch.testing``): on the test's
clock, fenced, cut off from their lease and stopped, without any server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from contracts.errors import Fenced, LeaseLost
from orch.testing import KindRun, VirtualClock, run_kind

KindRunner = Callable[..., contextlib.AbstractAsyncContextManager[KindRun]]


async def test_ticker_checkpoints_each_tick_on_the_tests_clock(kind_run: KindRunner) -> None:
    async with kind_run("ticker", {"interval": 5}) as run:
        assert run.checkpoints == [{"count": 1}]  # at once, then every 5 s
        await run.advance(4.9)
        assert run.checkpoints == [{"count": 1}]
        await run.advance(0.1)
        await run.advance(10)
        assert run.checkpoints == [{"count": c} for c in (1, 2, 3, 4)]
        assert not run.stopped


async def test_ticker_resumes_from_its_checkpoint() -> None:
    async with run_kind("ticker", {"interval": 1}, checkpoint={"count": 41}) as run:
        assert run.checkpoints == [{"count": 42}]


async def test_ticker_stops_at_a_fence_and_writes_nothing_after_it(kind_run: KindRunner) -> None:
    async with kind_run("ticker", {"interval": 1}) as run:
        await run.advance(2)
        run.fence()
        await run.advance(1)
        assert run.stopped
        assert isinstance(run.error, Fenced)
        assert run.writes_after_fence == ["checkpoint"]  # refused, and the last it tried
        assert run.checkpoints == [{"count": c} for c in (1, 2, 3)]
        await run.advance(10)
        assert run.writes_after_fence == ["checkpoint"]


async def test_ticker_abandoned_on_a_lost_lease_runs_no_more(kind_run: KindRunner) -> None:
    async with kind_run("ticker", {"interval": 1}) as run:
        await run.lose_lease()
        await run.advance(5)
        assert run.stopped
        assert isinstance(run.error, LeaseLost)
        assert run.checkpoints == [{"count": 1}]


async def test_ticker_stops_in_time_when_asked(kind_run: KindRunner) -> None:
    async with kind_run("ticker", {"interval": 3600}) as run:
        took = await run.stop(timeout=1)
        assert took < 1
        assert run.stopped
        assert run.error is None  # a stop is no error


async def test_the_kit_refuses_params_the_kind_refuses() -> None:
    from contracts.errors import InvalidParams

    with pytest.raises(InvalidParams):
        async with run_kind("ticker", {"interval": 0}):
            pass


async def test_a_kind_that_ignores_a_stop_is_caught(virtual_clock: VirtualClock) -> None:
    from contracts.kinds import KindSpec

    async def stubborn(ctx: Any) -> None:
        try:
            await ctx.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(2)  # cleans up for longer than a stop may take

    spec = KindSpec("stubborn", stubborn)
    async with run_kind(spec, clock=virtual_clock) as run:
        with pytest.raises(TimeoutError, match="did not stop"):
            await run.stop(timeout=0.2)


def test_the_readmes_kit_example_runs_as_written() -> None:
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Testing a kind", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ticker passed\n"
