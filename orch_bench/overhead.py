"""What observing the cluster costs: start latency and create throughput with the metrics
endpoints, the request measure, the access log and JSON logs on, against all of them off, in
interleaved rounds (a single run is noisier than the 5 % this must stay under)."""

from __future__ import annotations

import statistics
from typing import Any

from orch.cluster import free_port
from orch_bench.harness import Bench, Figure
from orch_bench.loadgen import create_for
from orch_bench.scenarios import IDLE_TICKER, Size, Tick, measure_starts

ON: dict[str, Any] = {"metrics": "true", "access_log": "true", "log_format": "json"}
OFF: dict[str, Any] = {"metrics": "false", "access_log": "false", "log_level": "WARNING"}


async def _round(bench: Bench, size: Size, tick: Tick, mode: str, r: int) -> tuple[float, float]:
    """(median start latency ms, creates/s) of one cluster."""
    env = ON if mode == "on" else OFF
    async with bench.cluster(f"obs-{mode}-{r}", **env) as c:
        manager = await c.start_manager()
        assert manager.port is not None
        c.api_port = manager.port
        for i in range(2):
            extra = {"metrics_port": free_port()} if mode == "on" else {}
            await c.start_service(f"s{i + 1}", 20_000, **extra)
        starts = await measure_starts(c, size.start_samples // 2, tick, tag=f"o{mode}{r}")

        def body(client: int, i: int) -> dict[str, Any]:
            return {"name": f"ob-{mode}-{r}-{client}-{i}", "kind": "ticker", "params": IDLE_TICKER}

        created, elapsed, _ = await create_for(
            c.api_port, size.throughput_seconds / 2, token=c.token, clients=32, body=body
        )
    return statistics.median(starts), created / elapsed


async def observability_cost(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    rounds = 3
    results: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
    for r in range(rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            results[mode].append(await _round(bench, size, tick, mode, r))
    start_on = statistics.median(x[0] for x in results["on"])
    start_off = statistics.median(x[0] for x in results["off"])
    rate_on = statistics.median(x[1] for x in results["on"])
    rate_off = statistics.median(x[1] for x in results["off"])
    start_cost = (start_on - start_off) / start_off * 100
    rate_cost = (rate_off - rate_on) / rate_off * 100
    note = f"medians of {rounds} interleaved rounds each way"

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
