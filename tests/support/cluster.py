"""The local cluster of real processes, with what acceptance tests need on top."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from orch.cluster import Proc, quiet, wait_for
from orch_contracts.topology import Topology, delete_topology
from orch_verify.cluster import FaultCluster

__all__ = ["Cluster", "Proc", "quiet", "wait_for"]

ROOT = Path(__file__).resolve().parents[2]


class Cluster(FaultCluster):
    def __init__(
        self,
        *,
        database_url: str,
        amqp_url: str,
        prefix: str,
        workdir: Path,
        lease_ttl: float = 2.0,
    ) -> None:
        self.database_url = database_url
        self.amqp_url = amqp_url
        self.prefix = prefix
        self.workdir = workdir
        self.lease_ttl = lease_ttl
        self.api_port: int | None = None
        #: The pools services were started in (their work queues are deleted at the end).
        self.pools: set[str] = set()
        super().__init__(
            env={
                "PYTHONPATH": str(ROOT),
                "ORCH_DATABASE_URL": database_url,
                "ORCH_AMQP_URL": amqp_url,
                "ORCH_PREFIX": prefix,
                "ORCH_LEASE_TTL": str(lease_ttl),
                "ORCH_KIND_MODULES": "tests.support.kinds",
                "ORCH_SWEEP_INTERVAL": "0.1",
                "ORCH_RELAY_GRACE": "0.5",
                "ORCH_RELAY_INTERVAL": "0.2",
                "ORCH_AMQP_HEARTBEAT": "5",
                "ORCH_REBALANCE": "false",  # tests of rebalancing turn it on
            },
            logdir=workdir,
        )

    @contextlib.asynccontextmanager
    async def frozen(
        self, proc: Proc, *, before_waking: Callable[[], None] = lambda: None
    ) -> AsyncIterator[None]:
        """SIGSTOP ``proc`` inside; SIGCONT it on the way out, whatever happens."""
        proc.signal(signal.SIGSTOP)
        try:
            yield
        finally:
            before_waking()
            proc.signal(signal.SIGCONT)

    @property
    def tick_dir(self) -> Path:
        return self.workdir / "ticks"

    async def start_manager(self, port: int | None = None, **env: Any) -> Proc:
        proc = await super().start_manager(port, **orch_env(env))
        if self.api_port is None:
            self.api_port = proc.port
        return proc

    async def start_service(self, name: str = "svc", worker_count: int = 10, **env: Any) -> Proc:
        if env.get("pool"):
            self.pools.add(str(env["pool"]))
        return await super().start_service(name, worker_count, **orch_env(env))

    async def stop(self, timeout: float = 20) -> None:
        """Every process; then the work queues of the pools its services joined (the prefix's
        own queues go with the prefix)."""
        await super().stop(timeout)
        if self.pools:
            with contextlib.suppress(Exception):
                await delete_topology(self.amqp_url, Topology(self.prefix), sorted(self.pools))

    # ------------------------------------------------------------- API and database
    def api(self) -> httpx.AsyncClient:
        assert self.api_port is not None, "start a manager first"
        return httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.api_port}", timeout=30, headers=self.auth_headers
        )

    async def create(self, name: str, kind: str = "ticker", **params: Any) -> dict[str, Any]:
        async with self.api() as c:
            r = await c.post("/observers", json={"name": name, "kind": kind, "params": params})
        assert r.status_code == 201, r.text
        body: dict[str, Any] = r.json()
        return body

    async def create_recorders(self, n: int, interval: float = 0.05) -> list[uuid.UUID]:
        ids = []
        for i in range(n):
            body = await self.create(
                f"rec-{i}", "recorder", dir=str(self.tick_dir), interval=interval
            )
            ids.append(uuid.UUID(body["id"]))
        return ids

    async def observer(self, observer_id: uuid.UUID | str) -> asyncpg.Record:
        row = await (await self.connect()).fetchrow(
            "SELECT * FROM observers WHERE id = $1", uuid.UUID(str(observer_id))
        )
        assert row is not None
        return row

    async def wait_status(
        self, observer_id: uuid.UUID | str, status: str, *, timeout: float = 10
    ) -> None:
        async def reached() -> bool:
            return bool((await self.observer(observer_id))["status"] == status)

        await wait_for(reached, timeout=timeout, what=f"{observer_id} {status}")

    async def checkpoint_count(self, observer_id: uuid.UUID | str) -> int:
        row = await self.observer(observer_id)
        return int(json.loads(row["checkpoint"] or "{}").get("count", 0))

    async def wait_all_running(
        self,
        ids: list[uuid.UUID],
        *,
        timeout: float,
        on: set[uuid.UUID] | None = None,
        fresh_after: float = 0.0,
    ) -> None:
        """Every observer processing on a live service (one of ``on``), checkpointing after
        ``fresh_after`` (epoch seconds)."""

        async def check() -> bool:
            rows = await self.q(
                "SELECT o.service_id, extract(epoch FROM o.checkpointed_at) AS cp "
                "FROM observers o JOIN services s ON s.id = o.service_id "
                "WHERE o.id = ANY($1) AND o.status = 'processing' AND NOT s.is_deleted",
                ids,
            )
            return len(rows) == len(ids) and all(
                (on is None or r["service_id"] in on) and float(r["cp"] or 0) > fresh_after
                for r in rows
            )

        await wait_for(check, timeout=timeout, what=f"{len(ids)} observers running")


def orch_env(env: dict[str, Any]) -> dict[str, str]:
    return {f"ORCH_{k.upper()}": str(v) for k, v in env.items()}


@contextlib.asynccontextmanager
async def migrated_cluster(
    database_url: str, amqp_url: str, prefix: str, workdir: Path
) -> AsyncIterator[Cluster]:
    """A cluster on a database server of the test's own (a replicated pair, an HA stack),
    its schema made by ``orch migrate`` through ``database_url``; stopped afterwards."""
    cluster = Cluster(database_url=database_url, amqp_url=amqp_url, prefix=prefix, workdir=workdir)
    try:
        migrate = cluster.spawn("migrate", ["migrate"])
        code = await asyncio.to_thread(migrate.popen.wait, 120)
        assert code == 0, f"orch migrate failed:\n{migrate.tail()}"
        yield cluster
    finally:
        await cluster.stop()
