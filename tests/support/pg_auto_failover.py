"""A pg_auto_failover formation of one test's own: a monitor, a primary and a synchronous
standby, failing over by themselves.

Made with Debian's pg_auto_failover (``pg_autoctl`` from ``pg-auto-failover-cli``, the monitor's
extension from ``postgresql-15-auto-failover``) and the server binaries of ``PG_BIN`` (see
``tests/support/pg_pair.py``), in a temporary directory, on free ports, listening on 127.0.0.1
and on a socket directory of their own; ``pg_autoctl``'s configuration, state and pid files go
there too (``XDG_*``). As root, everything runs as the ``postgres`` user. ``start()`` creates the
monitor, then the first node (it becomes the primary) and the second (the standby, cloned with
``pg_basebackup`` by ``pg_autoctl``), each under a ``pg_autoctl run`` of this process; it returns
once the monitor shows one ``primary`` and one ``secondary`` and the primary's standby is
synchronous (``synchronous_standby_names = 'ANY 1 (...)'``: ``quorum``).

``crash_primary()`` is a lost machine: the primary's ``pg_autoctl run`` and every process under
it (the keeper, the Postgres supervisor, the postmaster and its backends) are SIGKILLed at once,
so nothing restarts it. The monitor then fails over alone; ``wait_failover()`` returns when the
standby takes writes.

The monitor's health checks are made fast for a test (``FAST_MONITOR``): it marks a dead
primary unhealthy within a second or two and promotes the standby once ``primary_demote_timeout``
(1.5 s) has passed; the standby takes writes some 3 to 6 s after the kill here. The production
defaults are in the comments there: with them the same takes about a minute (20 s before the
node counts as unhealthy, then 30 s of demote timeout). The keepers'
``timeout.network_partition_timeout`` (after which a primary that reaches neither the monitor
nor its standby demotes itself, 20 s by default) is lowered to stay below
``primary_demote_timeout``, as pg_auto_failover's argument against two primaries requires.

``close()`` stops every ``pg_autoctl run`` (SIGTERM, then SIGKILL of all its processes), stops
any server left running, and removes every file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from orch.cluster import free_port, wait_for
from tests.support.pg_pair import PG_BIN, _children, _pg_env, _postmaster_pid
from tests.support.pg_pair import missing_binaries as missing_server_binaries

PG_AUTOCTL = Path(os.environ.get("PG_AUTOCTL") or shutil.which("pg_autoctl") or "pg_autoctl")
#: The monitor's extension, where Debian puts it (next to ``PG_BIN``).
EXTENSION = PG_BIN.parent / "lib" / "pgautofailover.so"
DATABASE = "orch_failover"

#: The monitor's settings (milliseconds unless said), and pg_auto_failover's defaults.
FAST_MONITOR = {
    "pgautofailover.health_check_period": 500,  # 5000: a health check of every node
    "pgautofailover.health_check_timeout": 500,  # 5000: its connect timeout
    "pgautofailover.health_check_max_retries": 1,  # 2: retries before a node counts as failed
    "pgautofailover.health_check_retry_delay": 200,  # 2000: between those retries
    # 20000: a failed node is unhealthy once it has not reported for this long
    "pgautofailover.node_considered_unhealthy_timeout": 1000,
    # 30000: how long the old primary is given to demote itself before the standby is promoted
    "pgautofailover.primary_demote_timeout": 1500,
    "pgautofailover.startup_grace_period": 1000,  # 10000: no failover this soon after a start
}
#: Seconds (default 20); below ``primary_demote_timeout``.
NETWORK_PARTITION_TIMEOUT = 1


def missing_binaries() -> str | None:
    """Why a formation cannot be made here, or None."""
    why = missing_server_binaries()
    if why is not None:
        return why
    if not (PG_AUTOCTL.is_file() and os.access(PG_AUTOCTL, os.X_OK)):
        return (
            "pg_autoctl is not installed (apt-get install pg-auto-failover-cli "
            "postgresql-15-auto-failover; or PG_AUTOCTL)"
        )
    if not EXTENSION.is_file():
        return f"the pg_auto_failover extension is not installed: no {EXTENSION}"
    return None


@dataclass
class Node:
    """A ``pg_autoctl``-managed server: the monitor, or a Postgres node."""

    name: str
    data: Path
    port: int
    #: Its ``pg_autoctl run``, while it runs.
    run: subprocess.Popen[bytes] | None = None


@dataclass
class Failover:
    """What the automatic failover took (``time.time()`` seconds)."""

    crashed: float
    writable: float
    port: int

    @property
    def seconds(self) -> float:
        return self.writable - self.crashed


@dataclass
class AutoFailover:
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="orch-autofail-")))
    user: str = "postgres"
    database: str = DATABASE
    monitor_settings: dict[str, int] = field(default_factory=lambda: dict(FAST_MONITOR))

    def __post_init__(self) -> None:
        self._as_postgres = os.getuid() == 0
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.base, entry.pw_uid, entry.pw_gid)
        self.base.chmod(0o700)
        self.sockets = self.base / "sockets"
        self.monitor = Node("monitor", self.base / "monitor", free_port())
        self.nodes = [Node(f"node_{i}", self.base / f"node_{i}", free_port()) for i in (1, 2)]
        self._logs: list[Path] = []

    # ------------------------------------------------------------------------------ URLs
    def url(self) -> str:
        """A libpq multi-host URL of both nodes that only ever connects to the writable one
        (what ``pg_autoctl show uri --formation default`` gives, with a user)."""
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        return f"postgresql://{self.user}@{hosts}/{self.database}?target_session_attrs=read-write"

    def dsn(self, port: int, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{port}/{database}"

    @property
    def monitor_uri(self) -> str:
        """How the keepers reach the monitor."""
        return (
            f"postgres://autoctl_node@127.0.0.1:{self.monitor.port}/pg_auto_failover"
            "?sslmode=disable"
        )

    # ------------------------------------------------------------------------- lifecycle
    async def start(self) -> AutoFailover:
        for d in (self.sockets, self.base / "xdg" / "config", self.base / "xdg" / "data"):
            d.mkdir(parents=True)
        (self.base / "xdg" / "run").mkdir(mode=0o700)
        if self._as_postgres:
            for d in (self.sockets, *(self.base / "xdg").rglob("*"), self.base / "xdg"):
                shutil.chown(d, "postgres", "postgres")
        # The monitor and the first node are made from a data directory of ours, so that our
        # settings (after pg_autoctl's include, which comes first) win; the standby is a copy.
        await self._initdb(self.monitor)
        with (self.monitor.data / "postgresql.conf").open("a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in self.monitor_settings.items())
        await self._autoctl("create", "monitor", *self._common(self.monitor))
        await self._listen_locally(self.monitor)
        self._run(self.monitor)
        await self._wait_monitor()

        primary, standby = self.nodes
        await self._initdb(primary)
        await self._create_node(primary)
        await self._wait_states({primary.port: "single"}, what="the first node to run alone")
        await self._create_node(standby)
        await self._wait_states(
            {primary.port: "primary", standby.port: "secondary"},
            what="a primary and a secondary",
        )
        await self._wait_sync(primary)
        return self

    async def primary(self) -> Node:
        """The node the monitor has as primary."""
        states = await self.states()
        [port] = [p for p, (reported, _) in states.items() if reported == "primary"]
        return next(n for n in self.nodes if n.port == port)

    async def states(self) -> dict[int, tuple[str, str]]:
        """Each node's port: its reported and its assigned (goal) state, from the monitor."""
        monitor = await asyncpg.connect(self.dsn(self.monitor.port, "pg_auto_failover"))
        try:
            rows = await monitor.fetch(
                "SELECT nodeport, reportedstate::text, goalstate::text FROM pgautofailover.node"
            )
        finally:
            await monitor.close()
        return {r["nodeport"]: (r["reportedstate"], r["goalstate"]) for r in rows}

    async def crash_primary(self) -> tuple[Node, float]:
        """SIGKILL the primary's ``pg_autoctl run`` and every process under it at once, and its
        postmaster and backends: a lost machine. The node and the time."""
        node = await self.primary()
        assert node.run is not None, f"{node.name} was not started"
        assert node.run.poll() is None, f"{node.name} is not running"
        doomed = _tree(node.run.pid)
        postmaster = _postmaster_pid(node.data)
        if postmaster is not None:
            doomed |= _tree(postmaster)
        # Stopped first: no supervisor sees a child die and starts another.
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in doomed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        at = time.time()
        await asyncio.to_thread(node.run.wait, 10)
        node.run = None
        (node.data / "postmaster.pid").unlink(missing_ok=True)
        return node, at

    async def wait_failover(self, crashed: Node, at: float, *, timeout: float = 60) -> Failover:
        """Wait until the other node takes writes (a new session there is out of recovery, not
        read-only, and its commits wait for no standby that is gone). pg_auto_failover promotes
        it read-only (``stop_replication``) and opens it to writes only once the old primary's
        ``primary_demote_timeout`` has passed (``wait_primary``)."""
        [survivor] = [n for n in self.nodes if n is not crashed]

        async def writable() -> bool:
            try:
                conn = await asyncpg.connect(self.dsn(survivor.port), timeout=1)
            except (OSError, TimeoutError, asyncpg.PostgresError):
                return False
            try:
                row = await conn.fetchrow(
                    "SELECT pg_is_in_recovery() AS standby, "
                    "current_setting('transaction_read_only') AS read_only, "
                    "current_setting('synchronous_standby_names') AS names, "
                    "(SELECT count(*) FROM pg_stat_replication "
                    " WHERE sync_state IN ('sync', 'quorum')) AS synchronous"
                )
            finally:
                await conn.close()
            assert row is not None
            waits = bool(row["names"].strip()) and not row["synchronous"]
            return not row["standby"] and row["read_only"] == "off" and not waits

        await wait_for(
            writable, timeout=timeout, what=f"{survivor.name} to take writes", every=0.02
        )
        return Failover(at, time.time(), survivor.port)

    def close(self) -> None:
        """Stop every ``pg_autoctl run`` (SIGTERM: it stops its server; SIGKILL of all its
        processes after 20 s), then any server still up, and remove every file."""
        running = [n for n in (*self.nodes, self.monitor) if n.run is not None]
        trees = {n.name: _tree(n.run.pid) for n in running if n.run is not None}
        for node in running:
            assert node.run is not None
            if node.run.poll() is None:
                node.run.send_signal(signal.SIGTERM)
        for node in running:
            assert node.run is not None
            try:
                node.run.wait(20)
            except subprocess.TimeoutExpired:
                for pid in trees[node.name] | _tree(node.run.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                node.run.wait(5)
            node.run = None
        for node in (*self.nodes, self.monitor):  # a create that failed half way
            if not (node.data / "postmaster.pid").exists():
                continue
            try:
                self._run_sync(
                    str(PG_BIN / "pg_ctl"), "stop", "-D", node.data, "-m", "immediate", "-w"
                )
            except (subprocess.SubprocessError, OSError):
                postmaster = _postmaster_pid(node.data)
                if postmaster is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(postmaster, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)

    def logs(self, lines: int = 40) -> str:
        """The end of every ``pg_autoctl run``'s log (for a failure's message)."""
        out = []
        for log in self._logs:
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # ----------------------------------------------------------------------------- parts
    def _common(self, node: Node) -> list[str | Path]:
        return [
            "--pgdata", node.data, "--pgport", str(node.port), "--pgctl", PG_BIN / "pg_ctl",
            "--hostname", "127.0.0.1", "--auth", "trust", "--no-ssl",
        ]  # fmt: skip

    async def _create_node(self, node: Node) -> None:
        await self._autoctl(
            "create", "postgres", *self._common(node),
            "--listen", "127.0.0.1", "--name", node.name,
            "--dbname", self.database, "--monitor", self.monitor_uri,
        )  # fmt: skip
        await self._autoctl(
            "config", "set", "--pgdata", node.data,
            "timeout.network_partition_timeout", str(NETWORK_PARTITION_TIMEOUT),
        )  # fmt: skip
        self._run(node)

    async def _listen_locally(self, node: Node) -> None:
        """The monitor's create takes no ``--listen``: set it after (else it listens on ``*``)."""
        await self._autoctl(
            "config", "set", "--pgdata", node.data, "postgresql.listen_addresses", "127.0.0.1"
        )

    async def _initdb(self, node: Node) -> None:
        await asyncio.to_thread(
            self._run_sync, str(PG_BIN / "initdb"), "-D", node.data, "-U", self.user,
            "--auth=trust", "--no-sync", "-E", "UTF8",
        )  # fmt: skip
        with (node.data / "postgresql.conf").open("a") as f:
            f.write(
                "\n# tests/support/pg_auto_failover.py\n"
                f"listen_addresses = '127.0.0.1'\nunix_socket_directories = '{self.sockets}'\n"
                "max_connections = 200\nfsync = off\nshared_buffers = 32MB\n"
                "effective_cache_size = 128MB\nmaintenance_work_mem = 64MB\nwork_mem = 4MB\n"
            )

    def _run(self, node: Node) -> None:
        """``pg_autoctl run`` of ``node`` in the background, logging to a file."""
        log = self.base / f"{node.name}.log"
        self._logs.append(log)
        with log.open("ab") as out:
            node.run = subprocess.Popen(
                self._cmd(str(PG_AUTOCTL), "run", "--pgdata", node.data),
                stdout=out, stderr=subprocess.STDOUT, cwd=self.base, env=self._env(),
            )  # fmt: skip

    async def _wait_monitor(self) -> None:
        async def up() -> bool:
            try:
                await self.states()
            except (OSError, asyncpg.PostgresError):
                return False
            return True

        await wait_for(up, timeout=60, what="the monitor to answer", every=0.2)

    async def _wait_states(self, want: dict[int, str], *, what: str) -> None:
        async def reached() -> bool:
            states = await self.states()
            return all(states.get(port) == (state, state) for port, state in want.items())

        try:
            await wait_for(reached, timeout=90, what=what, every=0.2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.logs()}") from None

    async def _wait_sync(self, primary: Node) -> None:
        conn = await asyncpg.connect(self.dsn(primary.port))
        try:

            async def synchronous() -> bool:
                return bool(
                    await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_replication "
                        "WHERE sync_state IN ('sync', 'quorum')"
                    )
                )

            await wait_for(synchronous, timeout=30, what="the standby to be synchronous")
        finally:
            await conn.close()

    async def _autoctl(self, *args: str | Path) -> str:
        return await asyncio.to_thread(self._run_sync, str(PG_AUTOCTL), *args)

    def _cmd(self, *args: str | Path) -> list[str]:
        cmd = list(map(str, args))
        return ["runuser", "-u", "postgres", "--", *cmd] if self._as_postgres else cmd

    def _env(self) -> dict[str, str]:
        """``_pg_env`` with ``PG_BIN`` first on the path, the local connections on our socket
        directory (``PGHOST``), and pg_autoctl's files in ``base``."""
        env = _pg_env()
        env["PATH"] = f"{PG_BIN}{os.pathsep}{env.get('PATH', os.defpath)}"
        env["PGHOST"] = str(self.sockets)
        xdg = self.base / "xdg"
        env |= {
            "XDG_CONFIG_HOME": str(xdg / "config"),
            "XDG_DATA_HOME": str(xdg / "data"),
            "XDG_RUNTIME_DIR": str(xdg / "run"),
        }
        return env

    def _run_sync(self, *args: str | Path) -> str:
        cmd = self._cmd(*args)
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=180, cwd=self.base, env=self._env()
        )
        if done.returncode != 0:
            tool = Path(str(args[0])).name
            raise subprocess.CalledProcessError(
                done.returncode, cmd, done.stdout, f"{tool} failed: {done.stderr}"
            )
        return done.stdout


def _tree(pid: int) -> set[int]:
    """``pid`` and every process under it."""
    found = {pid}
    todo = [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
