"""Real manager and service processes for acceptance tests, and ways to wait on them."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]


async def wait_for(
    check: Callable[[], Awaitable[T]], *, timeout: float, what: str, every: float = 0.05
) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Cluster:
    database_url: str
    amqp_url: str
    prefix: str
    workdir: Path
    lease_ttl: float = 2.0
    kind_modules: str = "tests.support.kinds"
    procs: list[Proc] = field(default_factory=list)
    api_port: int | None = None
    db: asyncpg.Connection | None = None

    @property
    def tick_dir(self) -> Path:
        return self.workdir / "ticks"

    def env(self, **overrides: Any) -> dict[str, str]:
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("ORCH_") and k != "PYTHONPATH"
        }
        env.update(
            PYTHONPATH=str(ROOT),
            PYTHONUNBUFFERED="1",
            ORCH_DATABASE_URL=self.database_url,
            ORCH_AMQP_URL=self.amqp_url,
            ORCH_PREFIX=self.prefix,
            ORCH_LEASE_TTL=str(self.lease_ttl),
            ORCH_KIND_MODULES=self.kind_modules,
            ORCH_SWEEP_INTERVAL="0.1",
            ORCH_RELAY_GRACE="0.5",
            ORCH_RELAY_INTERVAL="0.2",
            ORCH_AMQP_HEARTBEAT="5",
        )
        env.update({f"ORCH_{k.upper()}": str(v) for k, v in overrides.items()})
        return env

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Proc:
        log = self.workdir / f"{name}-{len(self.procs)}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "orch", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    async def connect(self) -> None:
        self.db = await asyncpg.connect("postgresql://" + self.database_url.partition("://")[2])

    # ------------------------------------------------------------- processes
    async def start_manager(self, **env: Any) -> Proc:
        port = free_port()
        proc = self._spawn("manager", ["manager", "--port", str(port)], self.env(**env))
        if self.api_port is None:
            self.api_port = port

        async def healthy() -> bool:
            if proc.popen.poll() is not None:
                raise AssertionError(f"manager exited:\n{proc.tail()}")
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_for(healthy, timeout=30, what="manager ready")
        return proc

    async def start_service(self, name: str = "svc", worker_count: int = 10, **env: Any) -> Proc:
        proc = self._spawn(
            name, ["service", "--name", name, "--worker-count", str(worker_count)], self.env(**env)
        )
        await self.wait_service_up(proc)
        return proc

    async def wait_service_up(self, proc: Proc) -> uuid.UUID:
        async def registered() -> uuid.UUID | None:
            if proc.popen.poll() is not None:
                raise AssertionError(f"service exited:\n{proc.tail()}")
            return await self.q(
                "SELECT id FROM services WHERE pid = $1 AND NOT is_deleted", proc.pid, one=True
            )

        sid: uuid.UUID = await wait_for(registered, timeout=30, what=f"{proc.name} registered")
        return sid

    async def service_id(self, proc: Proc) -> uuid.UUID:
        sid: uuid.UUID = await self.q(
            "SELECT id FROM services WHERE pid = $1 ORDER BY created_at DESC LIMIT 1",
            proc.pid,
            one=True,
        )
        return sid

    async def stop(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGTERM)
        for p in self.procs:
            try:
                await asyncio.to_thread(p.popen.wait, 15)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                await asyncio.to_thread(p.popen.wait, 5)
        if self.db is not None:
            await self.db.close()

    # ------------------------------------------------------------- API and database
    def api(self) -> httpx.AsyncClient:
        assert self.api_port is not None, "start a manager first"
        return httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.api_port}", timeout=30)

    async def q(self, sql: str, *args: Any, one: bool = False) -> Any:
        assert self.db is not None
        if one:
            return await self.db.fetchval(sql, *args)
        return await self.db.fetch(sql, *args)

    async def create(self, name: str, kind: str = "ticker", **params: Any) -> dict[str, Any]:
        async with self.api() as c:
            r = await c.post("/observers", json={"name": name, "kind": kind, "params": params})
        assert r.status_code == 201, r.text
        body: dict[str, Any] = r.json()
        return body

    async def create_recorders(self, n: int, interval: float = 0.05) -> list[uuid.UUID]:
        return [
            uuid.UUID(
                (
                    await self.create(
                        f"rec-{i}", "recorder", dir=str(self.tick_dir), interval=interval
                    )
                )["id"]
            )
            for i in range(n)
        ]

    async def observer(self, observer_id: uuid.UUID | str) -> asyncpg.Record:
        assert self.db is not None
        row = await self.db.fetchrow(
            "SELECT * FROM observers WHERE id = $1", uuid.UUID(str(observer_id))
        )
        assert row is not None
        return row

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
