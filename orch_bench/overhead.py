"""What observing the cluster costs: start latency and create throughput with the metrics
endpoints, the request measure, the access log and JSON logs on, against all of them off.

Both clusters run at the same time and the samples alternate between them (a start on one,
then on the other; a burst of creates on one, then on the other), so the machine's own drift
weighs on both alike: clusters measured one after the other differ by more than the 5 % this
must stay under. The creates' cost is the median of the cost within each pair of neighbouring
bursts (one on, one off), reported with the spread of those pairs: what drifts between pairs
drops out."""

from __future__ import annotations

import contextlib
import statistics
from typing import Any

from orch.cluster import free_port
from orch_bench.harness import Bench, BenchCluster, Figure
from orch_bench.loadgen import create_for
from orch_bench.scenarios import IDLE_TICKER, INTAKE_ROOM, Size, Starter, Tick

ON: dict[str, Any] = {"metrics": "true", "access_log": "true", "log_format": "json"}
OFF: dict[str, Any] = {"metrics": "false", "access_log": "false", "log_level": "WARNING"}
#: Bursts of creates on each cluster: many short ones, so that the pairs' median is steady.
BURSTS = 20


async def _start(c: BenchCluster, mode: str) -> None:
    manager = await c.start_manager()
    assert manager.port is not None
    c.api_port = manager.port
    for i in range(2):
        extra = {"metrics_port": free_port()} if mode == "on" else {}
        await c.start_service(f"s{i + 1}", INTAKE_ROOM, **extra)


async def observability_cost(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    async with contextlib.AsyncExitStack() as stack:
        clusters = {
            mode: await stack.enter_async_context(bench.cluster(f"obs-{mode}", **env))
            for mode, env in (("on", ON), ("off", OFF))
        }
        for mode, c in clusters.items():
            await _start(c, mode)
        starters = {mode: Starter(c, f"o{mode}") for mode, c in clusters.items()}
        for i in range(size.start_samples):
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                await starters[mode].one()
            tick(2)
        starts = {mode: await s.latencies() for mode, s in starters.items()}
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for b in range(BURSTS):
            for mode in ("on", "off") if b % 2 == 0 else ("off", "on"):

                def body(client: int, i: int, mode: str = mode, b: int = b) -> dict[str, Any]:
                    name = f"ob-{mode}-{b}-{client}-{i}"
                    return {"name": name, "kind": "ticker", "params": IDLE_TICKER}

                created, elapsed, _ = await create_for(
                    clusters[mode].api_port,
                    size.throughput_seconds / BURSTS,
                    token=clusters[mode].token,
                    clients=32,
                    body=body,
                )
                rates[mode].append(created / elapsed)
    start_on, start_off = (statistics.median(starts[m]) for m in ("on", "off"))
    rate_on, rate_off = (statistics.median(rates[m]) for m in ("on", "off"))
    start_cost = (start_on - start_off) / start_off * 100
    pairs = sorted(
        (off - on) / off * 100 for on, off in zip(rates["on"], rates["off"], strict=True)
    )
    rate_cost = statistics.median(pairs)
    quartiles = statistics.quantiles(pairs, n=4)
    note = (
        f"both clusters up at once; {size.start_samples} starts and {BURSTS} bursts of "
        f"{size.throughput_seconds / BURSTS:.1f}s each, alternating; creates: median of the "
        f"{len(pairs)} pairs, quartiles {quartiles[0]:.1f} to {quartiles[2]:.1f} %"
    )

    def figures(what: str, on: float, off: float, unit: str, cost: float) -> list[Figure]:
        return [
            Figure("observability cost", f"{what}, all on", round(on, 2), unit),
            Figure("observability cost", f"{what}, all off", round(off, 2), unit),
            Figure(
                "observability cost", f"{what}: cost", round(cost, 1), "%", "≤ 5", cost <= 5, note
            ),
        ]

    return figures("start latency p50", start_on, start_off, "ms", start_cost) + figures(
        "creates/s", rate_on, rate_off, "1/s", rate_cost
    )
