"""A PostgreSQL primary and its synchronous streaming standby, of one test's own.

Made with the installed server binaries (``PG_BIN``, else ``/usr/lib/postgresql/15/bin``) in a
temporary directory, on free ports, listening on 127.0.0.1 and on a socket directory of their
own (the machine's own server is never touched). ``switchover()`` is a planned switchover: the
primary is stopped cleanly, the standby is checked to have replayed everything the primary
wrote, then promoted. ``close()`` stops both servers and removes every file, whatever state they
are in. Servers refuse to run as root: as root, every binary runs as the ``postgres`` user.

``PgPair(synchronous=False, lag=2.0)`` is the common asynchronous setup instead: the standby
streams through a proxy of this process that holds what the primary sends for ``lag`` seconds
(a replica behind by that much), and ``crash()`` kills the primary and the proxy with what it
held, the way a lost machine takes its unsent WAL with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from orch.cluster import free_port, wait_for

PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
_TOOLS = ("initdb", "pg_ctl", "pg_basebackup", "pg_controldata", "postgres")
STANDBY_NAME = "standby"


def missing_binaries() -> str | None:
    """Why a pair cannot be made here, or None."""
    absent = [t for t in _TOOLS if not (PG_BIN / t).is_file()]
    if absent:
        return f"PostgreSQL server binaries not found in {PG_BIN}: {', '.join(absent)} (PG_BIN)"
    if os.getuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the servers as"
    return None


@dataclass
class Switchover:
    """What a switchover took (``time.time()`` seconds)."""

    stop_started: float
    stopped: float
    caught_up: float
    promoted: float
    last_lsn: str

    @property
    def outage(self) -> float:
        return self.promoted - self.stop_started


@dataclass
class PgPair:
    base: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="orch-pgpair-")))
    primary_port: int = field(default_factory=free_port)
    standby_port: int = field(default_factory=free_port)
    user: str = "postgres"
    synchronous: bool = True
    #: Seconds the proxy holds what the primary sends the standby (asynchronous only).
    lag: float = 0.0

    def __post_init__(self) -> None:
        self._as_postgres = os.getuid() == 0
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.base, entry.pw_uid, entry.pw_gid)
        self.base.chmod(0o700)
        self.primary = self.base / "primary"
        self.standby = self.base / "standby"
        self.sockets = self.base / "sockets"
        self.proxy: LagProxy | None = None

    # ------------------------------------------------------------------------------ URLs
    def url(self, database: str, *, hosts: str = "primary,standby") -> str:
        """A libpq multi-host URL that only ever connects to the writable server."""
        ports = {"primary": self.primary_port, "standby": self.standby_port}
        hostlist = ",".join(f"127.0.0.1:{ports[h]}" for h in hosts.split(","))
        return f"postgresql://{self.user}@{hostlist}/{database}?target_session_attrs=read-write"

    def dsn(self, port: int, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{port}/{database}"

    # ------------------------------------------------------------------------- lifecycle
    async def start(self) -> PgPair:
        self.sockets.mkdir()
        if self._as_postgres:
            shutil.chown(self.sockets, "postgres", "postgres")
        await self._run(
            "initdb", "-D", self.primary, "-U", self.user, "--auth=trust", "--no-sync", "-E", "UTF8"
        )
        self._configure(self.primary, self.primary_port)
        with (self.primary / "postgresql.conf").open("a") as f:
            f.write("wal_level = replica\nmax_wal_senders = 4\n")
            if self.synchronous:
                f.write(f"synchronous_standby_names = '{STANDBY_NAME}'\nsynchronous_commit = on\n")
        (self.primary / "pg_hba.conf").write_text(
            "local all all trust\n"
            "host all all 127.0.0.1/32 trust\n"
            # ``all`` does not cover replication connections: they need their own line.
            "host replication all 127.0.0.1/32 trust\n"
        )
        await self._pg_ctl("start", self.primary)
        await self._run(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary_port), "-U", self.user,
            "-D", self.standby, "-R", "-X", "stream", "--no-sync",
        )  # fmt: skip
        upstream = self.primary_port
        if self.lag > 0:
            self.proxy = await LagProxy(self.primary_port, self.lag).start()
            upstream = self.proxy.port
        with (self.standby / "postgresql.auto.conf").open("a") as f:
            f.write(
                f"port = {self.standby_port}\n"
                f"primary_conninfo = 'host=127.0.0.1 port={upstream} user={self.user} "
                f"application_name={STANDBY_NAME}'\n"
                # Once promoted it has no standby of its own: waiting for one would hang every
                # commit.
                "synchronous_standby_names = ''\n"
            )
        await self._pg_ctl("start", self.standby)
        await self._wait_sync()
        # Streaming starts with a few round trips, each held ``lag`` by the proxy: from then on
        # the standby is ``lag`` behind. A write proves it has started.
        await self.caught_up(timeout=4 * self.lag + 30, write=True)
        return self

    async def caught_up(self, *, timeout: float, write: bool = False) -> None:
        """Wait until the standby replayed all the primary wrote so far (``write``: after a
        write of its own, so that the wait proves the standby streams)."""
        primary = await asyncpg.connect(self.dsn(self.primary_port))
        standby = await asyncpg.connect(self.dsn(self.standby_port))
        try:
            if write:
                await primary.execute("CREATE TABLE IF NOT EXISTS streaming_started ()")
            lsn = await primary.fetchval("SELECT pg_current_wal_lsn()::text")

            async def replayed() -> bool:
                return bool(
                    await standby.fetchval(
                        "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", lsn
                    )
                )

            await wait_for(replayed, timeout=timeout, what=f"the standby to replay up to {lsn}")
        finally:
            await primary.close()
            await standby.close()

    async def crash(self) -> float:
        """SIGKILL the primary and every process of it, drop what the proxy held; the time."""
        pid = _postmaster_pid(self.primary)
        assert pid is not None, "the primary is not running"
        for child in [pid, *_children(pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        at = time.time()
        if self.proxy is not None:
            self.proxy.close()
        (self.primary / "postmaster.pid").unlink(missing_ok=True)
        return at

    async def promote(self) -> float:
        """Promote the standby (after a crash); the time it accepts writes."""
        await self._pg_ctl("promote", self.standby)
        return time.time()

    async def switchover(self, *, catch_up_timeout: float = 10.0) -> Switchover:
        """Stop the primary cleanly, check the standby replayed all it wrote, promote it."""
        stop_started = time.time()
        await self._pg_ctl("stop", self.primary, "-m", "fast")
        stopped = time.time()
        last_lsn = await self._checkpoint_lsn(self.primary)
        standby = await asyncpg.connect(self.dsn(self.standby_port))
        try:

            async def replayed() -> bool:
                return bool(
                    await standby.fetchval(
                        "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn", last_lsn
                    )
                )

            await wait_for(
                replayed, timeout=catch_up_timeout, what=f"standby to replay up to {last_lsn}"
            )
            caught_up = time.time()
            await self._pg_ctl("promote", self.standby)
            assert await standby.fetchval("SELECT NOT pg_is_in_recovery()"), "not promoted"
        finally:
            await standby.close()
        return Switchover(stop_started, stopped, caught_up, time.time(), last_lsn)

    def close(self) -> None:
        """Stop both servers (immediately; a stuck one is killed) and remove every file."""
        if self.proxy is not None:
            self.proxy.close()
        for data in (self.standby, self.primary):
            if not (data / "postmaster.pid").exists():
                continue
            try:
                self._run_sync("pg_ctl", "stop", "-D", data, "-m", "immediate", "-w", "-t", "20")
            except (subprocess.SubprocessError, OSError):
                pid = _postmaster_pid(data)
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)

    # ----------------------------------------------------------------------------- parts
    def _configure(self, data: Path, port: int) -> None:
        with (data / "postgresql.conf").open("a") as f:
            f.write(
                f"\n# tests/support/pg_pair.py\nport = {port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.sockets}'\nmax_connections = 200\n"
                "fsync = off\nshared_buffers = 32MB\nlogging_collector = off\n"
            )

    async def _wait_sync(self) -> None:
        primary = await asyncpg.connect(self.dsn(self.primary_port))
        want = "sync" if self.synchronous else "async"
        try:

            async def replicating() -> bool:
                state = await primary.fetchval(
                    "SELECT sync_state FROM pg_stat_replication WHERE application_name = $1",
                    STANDBY_NAME,
                )
                return bool(state == want)

            await wait_for(replicating, timeout=30, what=f"the standby to replicate ({want})")
        finally:
            await primary.close()

    async def _checkpoint_lsn(self, data: Path) -> str:
        out = await self._run("pg_controldata", "-D", data)
        state = re.search(r"^Database cluster state:\s*(.+)$", out, re.M)
        assert state, out
        assert state.group(1).strip() == "shut down", f"primary not shut down: {out}"
        found = re.search(r"^Latest checkpoint location:\s*(\S+)$", out, re.M)
        assert found, out
        return found.group(1)

    async def _pg_ctl(self, action: str, data: Path, *args: str) -> str:
        log = ["-l", str(data.with_suffix(".log"))] if action == "start" else []
        return await self._run("pg_ctl", action, "-D", data, "-w", "-t", "60", *log, *args)

    async def _run(self, tool: str, *args: str | Path) -> str:
        return await asyncio.to_thread(self._run_sync, tool, *args)

    def _run_sync(self, tool: str, *args: str | Path) -> str:
        cmd = [str(PG_BIN / tool), *map(str, args)]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, cwd=self.base, env=_pg_env()
        )
        if done.returncode != 0:
            raise subprocess.CalledProcessError(
                done.returncode, cmd, done.stdout, f"{tool} failed: {done.stderr}"
            )
        return done.stdout


def _pg_env() -> dict[str, str]:
    """The environment without libpq variables that would point the tools elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (a postmaster's backends), read from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


class LagProxy:
    """A TCP proxy to ``port`` that holds every chunk from the server ``lag`` seconds before it
    passes it on (what a client sends goes at once)."""

    def __init__(self, port: int, lag: float) -> None:
        self.upstream = port
        self.lag = lag
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> LagProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            client_w.close()
            return
        self._writers += [client_w, server_w]
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def up() -> None:
            while data := await client_r.read(65536):
                server_w.write(data)
                await server_w.drain()

        async def down_read() -> None:
            while data := await server_r.read(65536):
                held.put_nowait((time.monotonic() + self.lag, data))

        async def down_write() -> None:
            while True:
                due, data = await held.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                client_w.write(data)
                await client_w.drain()

        for coro in (up(), down_read(), down_write()):
            task = asyncio.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Stop: every connection cut, whatever was held dropped."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for writer in self._writers:
            writer.transport.abort()
