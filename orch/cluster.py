"""A local cluster of real processes (a manager and observer services), for ``orch up``, the
benchmark and the acceptance tests."""

from __future__ import annotations

import asyncio
import contextlib
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

from orch_contracts import pgconnect

T = TypeVar("T")


async def wait_for(
    check: Callable[[], Awaitable[T | None]], *, timeout: float, what: str, every: float = 0.05
) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await check()
        if last:
            return last  # type: ignore[no-any-return]
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        await asyncio.sleep(every)


async def quiet(seconds: float, why: str) -> None:
    """A window in which a check must see that nothing happens (no tick of a stopped copy, no
    second leader, no move): the one place where a test waits for time, not for a condition.
    ``why`` says what would happen in it if the code were wrong."""
    del why
    await asyncio.sleep(seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Logged:
    """Something that runs under a ``name`` and writes its log to the file ``log``."""

    name: str
    log: Path | None

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    async def wait_log(self, text: str, *, timeout: float = 10) -> None:
        """Wait until it has logged ``text``."""

        async def logged() -> bool:
            assert self.log is not None, f"{self.name} logs to a terminal"
            return self.log.exists() and text in self.log.read_text(errors="replace")

        await wait_for(logged, timeout=timeout, what=f"{self.name} to log {text!r}")

    def tail(self, lines: int = 30) -> str:
        if self.log is None:
            return ""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Proc(Logged):
    name: str
    popen: subprocess.Popen[bytes]
    log: Path | None
    port: int | None = None
    #: How it was started (``LocalCluster.respawn`` starts it again the same way).
    args: list[str] = field(default_factory=list)
    module: str = "orch"
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.pid, sig)


@dataclass
class LocalCluster:
    """Processes sharing one database and broker prefix. ``env`` holds the ORCH_* settings."""

    env: dict[str, str]
    #: Where process logs go; None lets them write to this terminal.
    logdir: Path | None = None
    procs: list[Proc] = field(default_factory=list)
    #: A small pool, so that concurrent checks (a test's own tasks) never share one connection.
    db: asyncpg.Pool | None = None
    #: An admin API token made for this cluster (None when auth is off or tokens were given).
    token: str | None = None

    def __post_init__(self) -> None:
        if "ORCH_API_TOKENS" in self.env or os.environ.get("ORCH_API_TOKENS"):
            return
        if self.env.get("ORCH_AUTH", os.environ.get("ORCH_AUTH")) == "disabled":
            return
        from orch_manager.auth import Role, new_token

        self.token, entry = new_token("local-admin", Role.ADMIN)
        self.env["ORCH_API_TOKENS"] = entry

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    @property
    def database_dsn(self) -> str:
        """The database the processes use: from ``env``, else as the settings resolve it
        (the environment, then the defaults)."""
        from orch_contracts.settings import CommonSettings

        url = self.env.get("ORCH_DATABASE_URL")
        settings = CommonSettings(database_url=url) if url else CommonSettings()
        return settings.asyncpg_dsn

    def spawn(self, name: str, args: list[str], *, module: str = "orch", **env: Any) -> Proc:
        """Run ``python -m {module} {args}`` with the cluster's settings, logging to a file."""
        full_env = {**os.environ, **self.env, **{k: str(v) for k, v in env.items()}}
        full_env["PYTHONUNBUFFERED"] = "1"
        log = None if self.logdir is None else self.logdir / f"{name}-{len(self.procs)}.log"
        with contextlib.ExitStack() as stack:
            out = None if log is None else stack.enter_context(log.open("wb"))
            popen = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=self.cwd(full_env),
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
            )
        proc = Proc(name, popen, log, args=args, module=module, env=env)
        self.procs.append(proc)
        return proc

    def cwd(self, env: dict[str, str]) -> str | None:
        """The working directory of a process started with ``env`` (None: this one's)."""
        return None

    def respawn(self, proc: Proc) -> Proc:
        """Start an exited process again, as it was started, in its place in ``procs``."""
        self.procs.remove(proc)
        again = self.spawn(proc.name, proc.args, module=proc.module, **proc.env)
        again.port = proc.port
        return again

    async def connect(self) -> asyncpg.Pool:
        if self.db is None:
            self.db = await asyncpg.create_pool(
                self.database_dsn, connect=pgconnect.connect, min_size=1, max_size=4
            )
        return self.db

    async def start_manager(self, port: int | None = None, **env: Any) -> Proc:
        port = port or free_port()
        proc = self.spawn("manager", ["manager", "--port", str(port)], **env)
        proc.port = port
        await self._wait_ready(proc, port)
        return proc

    @staticmethod
    async def _wait_ready(manager: Logged, port: int) -> None:
        async def ready() -> bool:
            if not manager.alive:
                raise RuntimeError(f"manager exited:\n{manager.tail()}")
            try:
                async with httpx.AsyncClient() as c:
                    return (await c.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_for(ready, timeout=30, what="manager ready")

    async def start_service(self, name: str, worker_count: int, **env: Any) -> Proc:
        """Start a service and wait until it takes work: registered, and its broker session
        open (its control queue exists)."""
        proc = self.spawn(
            name, ["service", "--name", name, "--worker-count", str(worker_count)], **env
        )
        sid = await self.service_id(proc, wait=30)
        await self._wait_on_broker(proc, sid)
        return proc

    async def _wait_on_broker(self, proc: Logged, service_id: uuid.UUID) -> None:
        from orch_contracts.amqp import connect_first
        from orch_contracts.settings import CommonSettings, split_urls
        from orch_contracts.topology import service_present

        defaults = CommonSettings()
        url = self.env.get("ORCH_AMQP_URL", defaults.amqp_url)
        topology = CommonSettings(prefix=self.env.get("ORCH_PREFIX", defaults.prefix)).topology
        connection, _ = await connect_first(split_urls(url), timeout=5)
        async with connection:

            async def present() -> bool:
                if not proc.alive:
                    raise RuntimeError(f"service {proc.name} exited:\n{proc.tail()}")
                return await service_present(connection, topology, service_id)

            await wait_for(present, timeout=30, what=f"{proc.name} on the broker", every=0.02)

    async def service_id(self, proc: Proc, *, wait: float = 0) -> uuid.UUID:
        """The id of the service row a service process registered (waiting up to ``wait``)."""
        db = await self.connect()

        async def registered() -> uuid.UUID | None:
            if not proc.alive and wait:
                raise RuntimeError(f"service {proc.name} exited:\n{proc.tail()}")
            sid: uuid.UUID | None = await db.fetchval(
                "SELECT id FROM services WHERE pid = $1 ORDER BY created_at DESC LIMIT 1",
                proc.pid,
            )
            return sid

        if not wait:
            sid = await registered()
            assert sid is not None, f"{proc.name} has no service row"
            return sid
        return await wait_for(registered, timeout=wait, what=f"{proc.name} registered")

    async def stop(self, timeout: float = 20) -> None:
        """SIGTERM every process (resuming frozen ones first), SIGKILL what does not exit."""
        for p in self.procs:
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
        for p in self.procs:
            try:
                await asyncio.to_thread(p.popen.wait, timeout)
            except subprocess.TimeoutExpired:
                p.popen.kill()
                await asyncio.to_thread(p.popen.wait, 5)
        if self.db is not None:
            await self.db.close()
            self.db = None


class Scratch:
    """Throw-away databases and broker prefixes for one run of a tool (``orch bench``, ``orch
    verify``): a template database migrated once, copied for each cluster; ``cleanup`` drops
    every database and deletes every prefix's queues and exchanges."""

    def __init__(self, server_url: str, amqp_url: str, tool: str) -> None:
        self.server_url = server_url
        self.amqp_url = amqp_url
        self.tool = tool
        self.run_id = uuid.uuid4().hex[:8]
        self.template = f"orch_{tool}_{self.run_id}_tpl"
        self.databases: list[str] = []
        self.prefixes: list[str] = []

    async def _admin(self) -> asyncpg.Connection:
        from orch_contracts.settings import asyncpg_dsn, on_database

        return await asyncpg.connect(asyncpg_dsn(on_database(self.server_url, "postgres")))

    async def prepare(self) -> None:
        from alembic import command

        from orch_contracts.settings import on_database
        from orch_migrations import alembic_config

        await self._run(f'CREATE DATABASE "{self.template}"')
        self.databases.append(self.template)
        url = on_database(self.server_url, self.template)
        await asyncio.to_thread(command.upgrade, alembic_config(url), "head")

    async def database(self, name: str) -> str:
        """A fresh migrated database; its URL."""
        from orch_contracts.settings import on_database

        db = f"orch_{self.tool}_{self.run_id}_{name}"
        await self._run(f'CREATE DATABASE "{db}" TEMPLATE "{self.template}"')
        self.databases.append(db)
        return on_database(self.server_url, db)

    def prefix(self, name: str) -> str:
        prefix = f"{self.tool}-{self.run_id}-{name}"
        self.prefixes.append(prefix)
        return prefix

    async def delete_prefix(self, prefix: str) -> None:
        from orch_contracts.topology import Topology, delete_topology

        with contextlib.suppress(Exception):
            await delete_topology(self.amqp_url, Topology(prefix))

    async def cleanup(self) -> None:
        """Every prefix and database, each on its own (one that fails leaves the others gone);
        raises the first failure at the end."""
        failed: Exception | None = None
        for prefix in self.prefixes:
            await self.delete_prefix(prefix)
        for db in reversed(self.databases):
            try:
                await self._run(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            except (OSError, asyncpg.PostgresError) as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    async def _run(self, sql: str) -> None:
        admin = await self._admin()
        try:
            await admin.execute(sql)
        finally:
            await admin.close()
