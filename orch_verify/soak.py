"""The soak (``scripts/soak MINUTES``): an ordinary life at a brisk pace for MINUTES, judged as
``orch verify`` judges a campaign (overlap, availability, outputs), and measured for what only
time shows: a process whose memory grows, a table that grows, a latency that creeps.

Its life: the built-in kinds (``recorder``, ``ticker``, ``http_poll`` against a local page,
``websocket`` against a local server) and an ``emitter``, on three services and two managers;
observers created and deleted all along (churn), services killed and drained now and then. Every
``SAMPLE`` seconds it reads each process's memory, each table's size and rows, and how long the
API takes to list observers. Growth is given per hour, from the samples after ``WARM_UP``; a
process (alive that long) that grows ``MEMORY_LIMIT`` an hour or more fails the soak.

Where the server runs with autovacuum off (as some images do), the soak says so and vacuums
the tables itself by autovacuum's default rule (``VACUUM_RULE``), as a deployment with
autovacuum on would: table growth is judged on tables kept as they would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import websockets

from orch.cluster import Scratch
from orch_contracts.settings import CommonSettings
from orch_manager.auth import Role, new_token
from orch_verify.campaign import Campaign, ObserverSpec
from orch_verify.cluster import FaultCluster
from orch_verify.judge import trend
from orch_verify.run import Options, campaign_on

#: Seconds between two samples.
SAMPLE = 15.0
#: Seconds of samples left out of the trends at first (imports, caches, first buffers).
WARM_UP = 180.0
#: A process whose memory grows this much an hour or more fails the soak, bytes.
MEMORY_LIMIT = 5 * 1024 * 1024
#: Autovacuum's default rule: a table is vacuumed once its dead rows pass 50 + 20 % of its live.
VACUUM_RULE = (50, 0.2)
#: Seconds between two looks for tables to vacuum, when the soak vacuums them itself.
VACUUM_EVERY = 60.0

TABLES = """
SELECT relname, pg_total_relation_size(relid) AS bytes, n_live_tup AS live, n_dead_tup AS dead
  FROM pg_stat_user_tables
"""


@dataclass
class Samples:
    """What the sampler read, each a (wall time, value) series."""

    memory: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    table_bytes: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    table_rows: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    list_ms: list[tuple[float, float]] = field(default_factory=list)
    vacuums: int = 0
    autovacuum: bool = True


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _sample(cluster: FaultCluster, samples: Samples, port: int) -> None:
    now = time.time()
    for p in cluster.procs:
        if p.alive and (rss := _rss(p.pid)) is not None:
            samples.memory.setdefault(f"{p.name} (pid {p.pid})", []).append((now, rss))
    for r in await cluster.q(TABLES):
        samples.table_bytes.setdefault(r["relname"], []).append((now, float(r["bytes"])))
        samples.table_rows.setdefault(r["relname"], []).append((now, float(r["live"])))
    async with httpx.AsyncClient(timeout=30, headers=cluster.auth_headers) as api:
        began = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            await api.get(f"http://127.0.0.1:{port}/observers", params={"limit": 100})
            samples.list_ms.append((now, 1000 * (time.perf_counter() - began)))


async def _vacuum(cluster: FaultCluster, samples: Samples) -> None:
    """Vacuum (and analyze) each table past autovacuum's default rule."""
    base, share = VACUUM_RULE
    for r in await cluster.q(TABLES):
        if r["dead"] > base + share * r["live"]:
            await cluster.q(f'VACUUM (ANALYZE) "{r["relname"]}"')
            samples.vacuums += 1


async def _sampler(cluster: FaultCluster, samples: Samples, campaign: Campaign) -> None:
    last_vacuum = time.monotonic()
    while True:
        live = [m for m in campaign.managers if m.alive and m.port]
        if live:
            with contextlib.suppress(OSError, TimeoutError):
                await _sample(cluster, samples, live[0].port or 0)
        if not samples.autovacuum and time.monotonic() - last_vacuum >= VACUUM_EVERY:
            last_vacuum = time.monotonic()
            await _vacuum(cluster, samples)
        await asyncio.sleep(SAMPLE)


def per_hour(points: list[tuple[float, float]]) -> float | None:
    """A series' growth per hour after ``WARM_UP``: the lesser of its two halves' rates
    (``judge.trend``), so a step allocated once is no growth; None when too short."""
    if not points:
        return None
    start = points[0][0] + WARM_UP
    kept = [p for p in points if p[0] >= start]
    if len(kept) < 6 or kept[-1][0] - kept[0][0] < 120:
        return None
    return trend(kept).rate * 60


# ----------------------------------------------------------------------- what it runs against
class _Counter(BaseHTTPRequestHandler):
    """A page that changes at every request (each poll checkpoints)."""

    protocol_version = "HTTP/1.1"
    hits = itertools.count()

    def do_GET(self) -> None:
        body = str(next(self.hits)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        return None


class _Quiet(ThreadingHTTPServer):
    """A poller whose service was killed resets its connection: that is no error to print."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextlib.contextmanager
def page() -> Iterator[int]:
    """A local page to poll; its port."""
    server = _Quiet(("127.0.0.1", 0), _Counter)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextlib.asynccontextmanager
async def feed(every: float = 0.5) -> AsyncIterator[int]:
    """A local websocket server sending a message every ``every`` seconds; its port."""

    async def handler(ws: Any) -> None:
        # A client that goes (its copy stopped, its service killed) ends its feed: no traceback.
        with contextlib.suppress(websockets.ConnectionClosed):
            for n in itertools.count():
                await ws.send(f"tick {n}")
                await asyncio.sleep(every)

    async with websockets.serve(handler, "127.0.0.1", 0) as server:
        yield next(iter(server.sockets)).getsockname()[1]


def observers(ticks: Path, http_port: int, ws_port: int) -> list[ObserverSpec]:
    return [
        ObserverSpec("recorder", {"dir": str(ticks), "interval": 0.1, "checkpoint_every": 5}, 10),
        ObserverSpec("ticker", {"interval": 0.5}, 10),
        ObserverSpec("http_poll", {"url": f"http://127.0.0.1:{http_port}/", "interval": 1}, 10),
        ObserverSpec("websocket", {"url": f"ws://127.0.0.1:{ws_port}/"}, 5),
        ObserverSpec("emitter", {"interval": 0.1, "checkpoint_every": 5}, 5),
    ]


# ------------------------------------------------------------------------------------ the run
async def soak(minutes: float, settings: CommonSettings, workdir: Path) -> bool:
    """Run the soak; print its verdict and growth; whether it passed."""
    scratch = Scratch(settings.database_url, settings.amqp_url, "soak")
    token, entry = new_token("orch-soak", Role.ADMIN)
    samples = Samples()
    witness_dir = workdir / "witness"
    cluster: FaultCluster | None = None
    try:
        await scratch.prepare()
        url = await scratch.database("run")
        with page() as http_port:
            async with feed() as ws_port:
                cluster = running = FaultCluster(
                    token=token,
                    env={
                        "ORCH_DATABASE_URL": url,
                        "ORCH_AMQP_URL": settings.amqp_url,
                        "ORCH_PREFIX": scratch.prefix("run"),
                        "ORCH_KIND_MODULES": "tests.support.kinds",
                        "ORCH_WITNESS_DIR": str(witness_dir),
                        # No memory tracing: it slows every process several times over, and
                        # the soak's memory judge is each process's size, read from outside.
                        "ORCH_WITNESS_MEMORY": "false",
                        "ORCH_HTTP_POLL_ALLOW": f"127.0.0.1:{http_port},127.0.0.1:{ws_port}",
                        "ORCH_BROKER_ADVICE": "false",
                        "ORCH_API_TOKENS": entry,
                        "ORCH_AUTH": "on",
                        # The emitter is a test kind: the repository is on the path.
                        "PYTHONPATH": os.environ.get("PYTHONPATH") or str(Path.cwd()),
                    },
                    logdir=workdir,
                )
                samples.autovacuum = (await cluster.q("SHOW autovacuum", one=True)) == "on"
                if not samples.autovacuum:
                    print(
                        "autovacuum is off on this server: the soak vacuums each table by "
                        f"autovacuum's default rule (dead rows past {VACUUM_RULE[0]} + "
                        f"{VACUUM_RULE[1]:.0%} of live), every {VACUUM_EVERY:.0f} s"
                    )
                options = Options(
                    kind_modules=["tests.support.kinds"],
                    observers=observers(workdir / "ticks", http_port, ws_port),
                    seconds=minutes * 60,
                    seed=int(time.time()) % 1_000_000,
                    weights={"churn": 8, "kill": 1, "drain": 1},
                    every=5.0,
                )
                outcome = await campaign_on(
                    cluster,
                    options,
                    witness_dir,
                    lambda line: print(line, flush=True),
                    alongside=lambda c: _sampler(running, samples, c),
                )
    finally:
        try:
            if cluster is not None:
                await cluster.stop()
        finally:
            await scratch.cleanup()
    verdict = outcome.verdict
    for line in verdict.lines():
        print(line)
    return report(samples, minutes) and verdict.passed


def report(samples: Samples, minutes: float) -> bool:
    """Print the growth per hour of every process's memory, every table and the API's latency;
    whether every process's memory stayed under ``MEMORY_LIMIT`` an hour."""
    held = True
    print(f"\nsoak of {minutes:g} minutes; growth per hour from the samples after {WARM_UP:.0f} s")
    print("memory, per process (MiB an hour; only those alive long enough to tell):")
    for name, points in sorted(samples.memory.items()):
        rate = per_hour(points)
        if rate is None:
            continue
        flag = rate >= MEMORY_LIMIT
        held = held and not flag
        mib = points[-1][1] / 2**20
        print(f"  {name:32} {rate / 2**20:+7.2f}  (now {mib:.0f} MiB){'  GROWS' if flag else ''}")
    print("tables (KiB an hour, rows an hour):")
    for name in sorted(samples.table_bytes):
        size = per_hour(samples.table_bytes[name])
        rows = per_hour(samples.table_rows.get(name, []))
        if size is None:
            continue
        shown_rows = "-" if rows is None else f"{rows:+.0f}"
        print(f"  {name:32} {size / 1024:+9.0f}  {shown_rows}")
    listing = per_hour(samples.list_ms)
    if samples.list_ms:
        ms = [v for _, v in samples.list_ms]
        print(
            f"API list of 100 observers: median {statistics.median(ms):.1f} ms, max {max(ms):.1f}"
            f" ms, {'-' if listing is None else f'{listing:+.1f}'} ms an hour"
        )
    if not samples.autovacuum:
        print(f"autovacuum off on the server: the soak vacuumed {samples.vacuums} time(s)")
    print(f"memory {'flat' if held else 'GROWS'} (limit {MEMORY_LIMIT / 2**20:.0f} MiB an hour)")
    return held


def main(argv: list[str]) -> int:
    minutes = float(argv[0]) if argv else 20.0
    keep = Path(argv[1]) if len(argv) > 1 else None
    workdir = keep or Path(tempfile.mkdtemp(prefix="orch-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        return 0 if asyncio.run(soak(minutes, CommonSettings(), workdir)) else 1
    finally:
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
