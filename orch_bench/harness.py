"""What every scenario needs: a fresh database and broker prefix, a local cluster, and probes
(process memory and CPU, database and broker counters)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from orch.cluster import LocalCluster, Scratch, wait_for
from orch_bench.loadgen import RawClient
from orch_contracts.settings import CommonSettings

#: An observer runs when a holder has made a fenced write for it: a checkpoint, or a commit of
#: records (an emitter that commits on its own never writes a checkpoint).
_RUNNING = (
    "status = 'processing' AND service_id IS NOT NULL "
    "AND (checkpointed_at IS NOT NULL OR committed_at IS NOT NULL)"
)


@dataclass
class Figure:
    scenario: str
    name: str
    value: float | None
    unit: str
    target: str = ""
    passed: bool | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Bench:
    """One benchmark run: settings from the environment, a template database migrated once."""

    def __init__(self, settings: CommonSettings, *, lease_ttl: float) -> None:
        self.settings = settings
        self.lease_ttl = lease_ttl
        self.scratch = Scratch(settings.database_url, settings.amqp_url, "bench")
        self.workdir = Path(tempfile.mkdtemp(prefix="orch-bench-"))

    async def prepare(self) -> None:
        await self.scratch.prepare()

    @contextlib.asynccontextmanager
    async def cluster(self, name: str, **env: Any) -> AsyncIterator[BenchCluster]:
        """A fresh database (copy of the template), broker prefix and process cluster."""
        url = await self.scratch.database(name)
        prefix = self.scratch.prefix(name)
        workdir = self.workdir / name
        workdir.mkdir()
        cluster = BenchCluster(
            env={
                "ORCH_DATABASE_URL": url,
                "ORCH_AMQP_URL": self.settings.amqp_url,
                "ORCH_PREFIX": prefix,
                "ORCH_LEASE_TTL": str(self.lease_ttl),
                "ORCH_KIND_MODULES": "observer_service.kinds.recorder",
                # Off unless a scenario measures it: moves would blur the other figures.
                "ORCH_REBALANCE": "false",
                **{f"ORCH_{k.upper()}": str(v) for k, v in env.items()},
            },
            logdir=workdir,
        )
        cluster.workdir = workdir
        cluster.prefix = prefix
        try:
            yield cluster
        finally:
            await cluster.stop()
            await self.scratch.delete_prefix(prefix)

    async def cleanup(self) -> None:
        await self.scratch.cleanup()


class BenchCluster(LocalCluster):
    workdir: Path
    prefix: str
    api_port: int = 0

    async def start_api(self) -> None:
        """The manager, whose API ``api()`` then talks to."""
        manager = await self.start_manager()
        assert manager.port is not None
        self.api_port = manager.port

    async def start(self, services: int, worker_count: int, **env: Any) -> None:
        await self.start_api()
        for i in range(services):
            await self.start_service(f"s{i + 1}", worker_count, **env)

    async def reset_statements(self) -> str | None:
        """Clear ``pg_stat_statements`` for this cluster's database, creating the extension
        there first; why not, when the server cannot (it is not preloaded, and loading it means
        restarting the server)."""
        db = await self.connect()
        preload = await db.fetchval("SELECT current_setting('shared_preload_libraries')")
        if "pg_stat_statements" not in preload.replace(" ", "").split(","):
            return (
                "pg_stat_statements is not in this server's shared_preload_libraries "
                f"({preload or 'empty'}); loading it needs a server restart"
            )
        try:
            await db.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            await db.execute(
                "SELECT pg_stat_statements_reset(0, "
                "(SELECT oid FROM pg_database WHERE datname = current_database()), 0)"
            )
        except asyncpg.PostgresError as exc:
            return f"pg_stat_statements is not usable here: {exc}"
        return None

    async def top_statements(self, scenario: str, why_not: str | None, n: int = 5) -> list[Figure]:
        """The ``n`` statements of this cluster's database with the most execution time since
        ``reset_statements``; one figure saying why not when that could not be read."""
        if why_not is not None:
            return [Figure(scenario, "top statements by total time", None, "", note=why_not)]
        db = await self.connect()
        rows = await db.fetch(
            "SELECT total_exec_time, calls, rows, query FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND query NOT ILIKE '%pg_stat_statements%' "
            "ORDER BY total_exec_time DESC LIMIT $1",
            n,
        )
        return [
            Figure(
                scenario,
                f"statement #{i} by total time",
                round(r["total_exec_time"], 1),
                "ms",
                note=f"{r['calls']} calls, {r['rows']} rows: " + " ".join(r["query"].split())[:160],
            )
            for i, r in enumerate(rows, 1)
        ]

    def api(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
        return httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.api_port}",
            timeout=60,
            limits=limits,
            headers=self.auth_headers,
        )

    async def create_many(
        self,
        n: int,
        kind: str,
        params: dict[str, Any],
        *,
        concurrency: int = 16,
        tag: str = "o",
    ) -> list[uuid.UUID]:
        """Create ``n`` observers through the API over ``concurrency`` connections."""
        ids: list[uuid.UUID] = []
        todo = iter(range(n))

        async def worker() -> None:
            client = RawClient(self.api_port, self.token)
            try:
                for i in todo:
                    body = {"name": f"{tag}-{i}", "kind": kind, "params": params}
                    status, text = await client.post("/observers", body)
                    if status != 201:
                        raise RuntimeError(f"create failed: {status} {text[:200]!r}")
                    ids.append(uuid.UUID(json.loads(text)["id"]))
            finally:
                await client.close()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return ids

    async def grow_to(self, level: int, *, tag: str, interval: float = 3600) -> None:
        """Idle tickers (one tick every ``interval`` seconds) until ``level`` of them run
        (counting those made before), created in bulk."""
        have = await self.running_count()
        await self.create_batches(level - have, "ticker", {"interval": interval}, tag=tag)
        await self.wait_running(level, timeout=300)

    async def create_batches(
        self, n: int, kind: str, params: dict[str, Any], *, tag: str, batch: int = 1000
    ) -> list[uuid.UUID]:
        """Create ``n`` observers through ``POST /observers/batch``."""
        ids: list[uuid.UUID] = []
        client = RawClient(self.api_port, self.token)
        try:
            for first in range(0, n, batch):
                items = [
                    {"name": f"{tag}-{i}", "kind": kind, "params": params}
                    for i in range(first, min(n, first + batch))
                ]
                status, text = await client.post("/observers/batch", {"observers": items})
                body = json.loads(text)
                if status != 200 or body["failed"]:
                    raise RuntimeError(f"bulk create failed: {status} {text[:300]!r}")
                ids += [uuid.UUID(item["observer"]["id"]) for item in body["items"]]
        finally:
            await client.close()
        return ids

    async def running_count(self, ids: list[uuid.UUID] | None = None) -> int:
        db = await self.connect()
        if ids is None:
            n = await db.fetchval(f"SELECT count(*) FROM observers WHERE {_RUNNING}")
        else:
            n = await db.fetchval(
                f"SELECT count(*) FROM observers WHERE id = ANY($1) AND {_RUNNING}", ids
            )
        return int(n)

    async def wait_running(self, n: int, *, timeout: float) -> float:
        """Seconds until ``n`` observers run (have made a fenced write on a holder)."""
        start = time.monotonic()

        async def enough() -> bool:
            return await self.running_count() >= n

        await wait_for(enough, timeout=timeout, what=f"{n} observers running", every=0.2)
        return time.monotonic() - start

    async def wait_moved(self, service_id: uuid.UUID, n: int, *, timeout: float) -> None:
        """Until ``n`` observers run on the service ``service_id``."""
        db = await self.connect()

        async def moved() -> bool:
            k = await db.fetchval(
                "SELECT count(*) FROM observers WHERE service_id = $1 AND status = 'processing'",
                service_id,
            )
            return bool(k >= n)

        await wait_for(moved, timeout=timeout, what=f"{n} observers moved", every=0.05)

    async def busiest_service(self) -> tuple[int, uuid.UUID, int]:
        """(pid, service id, running) of the service running the most observers."""
        db = await self.connect()
        row = await db.fetchrow(
            "SELECT s.pid, s.id, count(o.id) AS n FROM services s JOIN observers o "
            "ON o.service_id = s.id WHERE NOT s.is_deleted GROUP BY s.pid, s.id "
            "ORDER BY n DESC LIMIT 1"
        )
        assert row is not None
        return row["pid"], row["id"], row["n"]

    def proc_by_pid(self, pid: int) -> Any:
        return next(p for p in self.procs if p.pid == pid)

    async def db_counters(self) -> tuple[float, int, int, int]:
        """(when, transactions, rows written, rows read) of this cluster's database so far.

        PostgreSQL flushes a backend's counters up to seconds late: read them after a quiet
        spell, never right after a burst."""
        db = await self.connect()
        row = await db.fetchrow(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted AS writes, "
            "tup_returned AS reads FROM pg_stat_database WHERE datname = current_database()"
        )
        assert row is not None
        return time.monotonic(), int(row["xact_commit"]), int(row["writes"]), int(row["reads"])

    def broker_frames(self) -> int:
        """Frames the broker sent and received on this cluster's connections (its counters)."""
        out = subprocess.run(
            ["rabbitmqctl", "-q", "list_connections", "client_properties", "recv_cnt", "send_cnt"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
        total = 0
        for line in out.splitlines():
            if self.prefix in line:
                parts = line.split()
                with contextlib.suppress(ValueError, IndexError):
                    total += int(parts[-1]) + int(parts[-2])
        return total


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_by_role(cluster: LocalCluster, since: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds used so far (or since ``since``) by role: manager, services, PostgreSQL,
    RabbitMQ, and this process (the load generator), read from /proc."""
    ours = {p.pid: ("manager" if p.name == "manager" else "services") for p in cluster.procs}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        parent = int(fields[1])
        if pid in ours:
            role = ours[pid]
        elif parent in ours:  # a manager worker
            role = ours[parent]
        elif b"postgres" in cmdline:
            role = "postgres"
        elif b"beam.smp" in cmdline or b"rabbitmq" in cmdline:
            role = "rabbitmq"
        elif pid == os.getpid():
            role = "load generator"
        else:
            continue
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    if since is not None:
        out = {role: seconds - since.get(role, 0.0) for role, seconds in out.items()}
    return out
