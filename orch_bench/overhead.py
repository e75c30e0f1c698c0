"""What observing the cluster costs: start latency and create throughput with the metrics
endpoints, the request measure, the access log and JSON logs on, against all of them off; and
with traces on (``orch_contracts.tracing``, OTLP/HTTP to a collector that drops them), against off.

Both clusters run at the same time and the samples alternate between them (a start on one,
then on the other; a burst of creates on one, then on the other), so the machine's own drift
weighs on both alike: clusters measured one after the other differ by more than the 5 % this
must stay under. The creates' cost is the median of the cost within each pair of neighbouring
bursts (one on, one off), reported with the spread of those pairs: what drifts between pairs
drops out."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from orch.cluster import free_port
from orch_bench.harness import Bench, BenchCluster, Figure
from orch_bench.loadgen import create_for
from orch_bench.scenarios import IDLE_TICKER, INTAKE_ROOM, Size, Starter, Tick

ON: dict[str, Any] = {"metrics": "true", "access_log": "true", "log_format": "json"}
OFF: dict[str, Any] = {"metrics": "false", "access_log": "false", "log_level": "WARNING"}
#: Bursts of creates on each cluster: many short ones, so that the pairs' median is steady.
BURSTS = 20
MODES = ("on", "off", "traced")

#: A collector that takes OTLP/HTTP exports and drops them (a process of its own: in the
#: benchmark's process it would share the load generator's interpreter).
COLLECTOR = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers['Content-Length']))
        self.send_response(200)
        self.send_header('Content-Length', '0')
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


@contextlib.contextmanager
def _collector() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", COLLECTOR, str(port)])
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def _traced(port: int) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
    }


def _order(i: int) -> list[str]:
    """Each cluster first, second and last in turn."""
    return [MODES[(i + k) % len(MODES)] for k in range(len(MODES))]


async def _start(c: BenchCluster, mode: str) -> None:
    manager = await c.start_manager()
    assert manager.port is not None
    c.api_port = manager.port
    for i in range(2):
        extra = {"metrics_port": free_port()} if mode == "on" else {}
        await c.start_service(f"s{i + 1}", INTAKE_ROOM, **extra)


async def observability_cost(bench: Bench, size: Size, tick: Tick) -> list[Figure]:
    async with contextlib.AsyncExitStack() as stack:
        collector = stack.enter_context(_collector())
        clusters = {
            mode: await stack.enter_async_context(bench.cluster(f"obs-{mode}", **env))
            for mode, env in (("on", ON), ("off", OFF), ("traced", OFF))
        }
        clusters["traced"].env.update(_traced(collector))
        for mode, c in clusters.items():
            await _start(c, mode)
        starters = {mode: Starter(c, f"o{mode}") for mode, c in clusters.items()}
        for i in range(size.start_samples):
            for mode in _order(i):
                await starters[mode].one()
            tick(3)
        starts = {mode: await s.latencies() for mode, s in starters.items()}
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for b in range(BURSTS):
            for mode in _order(b):

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
    note = (
        f"the three clusters up at once; {size.start_samples} starts and {BURSTS} bursts of "
        f"{size.throughput_seconds / BURSTS:.1f}s each, in turn"
    )
    return _cost(
        "observability cost", "all on", "all off", starts, rates, "on", "off", note, target=5
    ) + _cost("tracing cost", "traced", "off", starts, rates, "traced", "off", note)


def _cost(
    scenario: str,
    on_label: str,
    off_label: str,
    starts: dict[str, list[float]],
    rates: dict[str, list[float]],
    on: str,
    off: str,
    note: str,
    *,
    target: float | None = None,
) -> list[Figure]:
    """Start latency and creates/s of mode ``on`` against ``off``; the creates' cost is the
    median of the costs within each pair of bursts run next to each other."""
    start_on, start_off = (statistics.median(starts[m]) for m in (on, off))
    rate_on, rate_off = (statistics.median(rates[m]) for m in (on, off))
    start_cost = (start_on - start_off) / start_off * 100
    pairs = sorted((b - a) / b * 100 for a, b in zip(rates[on], rates[off], strict=True))
    rate_cost = statistics.median(pairs)
    quartiles = statistics.quantiles(pairs, n=4)
    spread = (
        f"; creates: median of {len(pairs)} pairs, "
        f"quartiles {quartiles[0]:.1f} to {quartiles[2]:.1f} %"
    )

    def figures(what: str, a: float, b: float, unit: str, cost: float) -> list[Figure]:
        return [
            Figure(scenario, f"{what}, {on_label}", round(a, 2), unit),
            Figure(scenario, f"{what}, {off_label}", round(b, 2), unit),
            Figure(
                scenario,
                f"{what}: cost",
                round(cost, 1),
                "%",
                "" if target is None else f"≤ {target:g}",
                None if target is None else cost <= target,
                note + spread,
            ),
        ]

    return figures("start latency p50", start_on, start_off, "ms", start_cost) + figures(
        "creates/s", rate_on, rate_off, "1/s", rate_cost
    )
