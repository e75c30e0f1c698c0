"""Two releases side by side: the previous release's code checked out from its git tag, and a
cluster whose every process runs the code of the release it was started from.

A process of a release runs from that release's tree: its working directory and its
``PYTHONPATH`` are the tree, so ``python -m orch`` imports that tree's packages (the path comes
before the project's editable install; a tree imports its folders by the names it uses: v0.1.0
as ``contracts``, ``manager``, ``migrations``, this tree as ``orch_contracts`` and so on), and
``ORCH_KIND_MODULES=tests.support.kinds`` loads that tree's test kinds. ``Release.imports`` asks
such a process where it really imported each package from, so a test can prove which code ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from orch.cluster import LocalCluster, Proc
from tests.support.cluster import ROOT, Cluster, orch_env

#: The release before this tree, and the commit its tag names (used when the tag is missing).
PREVIOUS_TAG = "v0.1.0"
PREVIOUS_COMMIT = "43c5486"

#: The packages a process of this tree imports (the test kinds included).
PACKAGES = (
    "orch",
    "orch_manager",
    "observer_service",
    "orch_contracts",
    "orch_migrations",
    "tests.support.kinds",
)
#: The same packages by the names the previous release imported them by.
PREVIOUS_PACKAGES = (
    "orch",
    "manager",
    "observer_service",
    "contracts",
    "migrations",
    "tests.support.kinds",
)


@dataclass(frozen=True)
class Release:
    """The code of one release: the source tree its processes import."""

    name: str
    root: Path
    #: Its packages by the names it imports them by.
    packages: tuple[str, ...] = PACKAGES
    #: What its ``contracts/`` and ``migrations/`` are imported as: ``orch_contracts`` here.
    prefix: str = "orch_"

    @property
    def env(self) -> dict[str, str]:
        """What a process of this release gets on top of the cluster's settings."""
        return {"PYTHONPATH": str(self.root)}

    def python(self, *args: str, env: dict[str, str] | None = None) -> str:
        """Run this venv's python in this release's tree; its standard output (fails loudly)."""
        full_env = {**os.environ, **(env or {}), **self.env}
        done = subprocess.run(
            [sys.executable, *args],
            cwd=self.root,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (
            f"{self.name}: python {' '.join(args)} exited {done.returncode}:\n"
            f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
        return done.stdout

    def imports(self) -> dict[str, Path]:
        """Where a process of this release imports each of its ``packages`` from."""
        code = (
            "import importlib, json\n"
            f"names = {self.packages!r}\n"
            "print(json.dumps({m: importlib.import_module(m).__file__ for m in names}))"
        )
        got: dict[str, str] = json.loads(self.python("-c", code).strip().splitlines()[-1])
        return {module: Path(path).resolve() for module, path in got.items()}

    def assert_imported_from_here(self) -> None:
        """Every package a process of this release imports comes from this release's tree."""
        root = self.root.resolve()
        strays = {m: p for m, p in self.imports().items() if not p.is_relative_to(root)}
        assert not strays, f"{self.name} processes would import other code than {root}: {strays}"

    def alembic_heads(self) -> set[str]:
        """The head revisions of this release's migrations (read by its own Alembic scripts)."""
        code = (
            "from alembic.script import ScriptDirectory\n"
            f"from {self.prefix}migrations import alembic_config\n"
            "print(' '.join(ScriptDirectory.from_config(alembic_config('x://')).get_heads()))"
        )
        return set(self.python("-c", code).split())


HEAD = Release("head", ROOT)


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def previous_commit() -> str:
    """The previous release's commit: its tag, else the commit the tag names. A clone without
    that history fails the test (a roll cannot be proven without the code rolled from)."""
    for ref in (f"refs/tags/{PREVIOUS_TAG}^{{commit}}", f"{PREVIOUS_COMMIT}^{{commit}}"):
        found = _git("rev-parse", "--verify", "--quiet", ref)
        if found.returncode == 0 and found.stdout.strip():
            return found.stdout.strip()
    pytest.fail(
        f"this test needs the repository's history: neither the tag {PREVIOUS_TAG} nor the "
        f"commit {PREVIOUS_COMMIT} is in the clone at {ROOT} (a shallow clone or one without "
        "tags; fetch them with `git fetch --tags --unshallow`)"
    )


def previous_module(path: str) -> types.ModuleType:
    """One module of the previous release, read from the repository's history and run in a
    module of its own (one that imports nothing of this tree: ``contracts/messages.py``)."""
    shown = _git("show", f"{previous_commit()}:{path}")
    assert shown.returncode == 0, f"git show failed: {shown.stderr}"
    name = f"previous_release_{path.replace('/', '_').removesuffix('.py')}"
    module = types.ModuleType(name)
    module.__file__ = f"{PREVIOUS_TAG}:{path}"
    sys.modules[name] = module  # pydantic resolves the module's annotations through it
    exec(compile(shown.stdout, module.__file__, "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def previous_release(parent: Path) -> Iterator[Release]:
    """The previous release's tree, a detached git worktree under ``parent``; removed after,
    whatever happened (the main working tree and index are not touched)."""
    commit = previous_commit()
    path = parent / PREVIOUS_TAG
    added = _git("worktree", "add", "--detach", str(path), commit)
    assert added.returncode == 0, f"git worktree add failed: {added.stderr}"
    try:
        yield Release(PREVIOUS_TAG, path, PREVIOUS_PACKAGES, prefix="")
    finally:
        removed = _git("worktree", "remove", "--force", str(path))
        if removed.returncode != 0:
            _git("worktree", "prune")


class MixedCluster(Cluster):
    """A ``Cluster`` whose processes each run one release: a process started with a release's
    ``env`` runs in that release's tree (``Release``); the others run this tree."""

    def cwd(self, env: dict[str, str]) -> str | None:
        """A process runs in its release's tree: ``python -m`` puts its working directory
        first on ``sys.path``, before ``PYTHONPATH``."""
        return env["PYTHONPATH"]

    async def start_manager_of(
        self, release: Release, port: int | None = None, **settings: Any
    ) -> Proc:
        """A manager of ``release``, ready; the API the test talks to if it is the first."""
        proc = await LocalCluster.start_manager(self, port, **release.env, **orch_env(settings))
        if self.api_port is None:
            self.api_port = proc.port
        return proc

    async def start_service_of(
        self, release: Release, name: str, worker_count: int = 10, **settings: Any
    ) -> Proc:
        """A service of ``release``, registered and on the broker."""
        return await LocalCluster.start_service(
            self, name, worker_count, **release.env, **orch_env(settings)
        )

    async def migrate(self, release: Release) -> str:
        """``orch migrate`` of ``release`` on the cluster's database; the revision it left."""
        env = {k: v for k, v in self.env.items() if k.startswith("ORCH_")}
        await asyncio.to_thread(release.python, "-m", "orch", "migrate", env=env)
        return await self.revision()

    async def revision(self) -> str:
        version: str = await self.q("SELECT version_num FROM alembic_version", one=True)
        return version

    async def stop_gracefully(self, proc: Proc, *, timeout: float = 20) -> int:
        """SIGTERM ``proc`` and wait for it to exit; its exit code."""
        proc.popen.terminate()
        return await asyncio.to_thread(proc.popen.wait, timeout)

    def errors(self) -> list[str]:
        """Every line of any process's log that reports an error or a traceback."""
        found = []
        for p in self.procs:
            assert p.log is not None
            for line in p.log.read_text(errors="replace").splitlines():
                if any(mark in line for mark in (" ERROR ", " CRITICAL ", "Traceback")):
                    found.append(f"{p.name} (pid {p.pid}): {line}")
        return found

    def tails(self) -> str:
        return "\n".join(f"--- {p.name} (pid {p.pid})\n{p.tail(40)}" for p in self.procs)


@contextlib.asynccontextmanager
async def mixed_cluster(
    *, database_url: str, amqp_url: str, prefix: str, workdir: Path
) -> AsyncIterator[MixedCluster]:
    """A ``MixedCluster``; every process it started is stopped after (by its pid), and on a
    failure the end of each process's log is printed."""
    cluster = MixedCluster(
        database_url=database_url, amqp_url=amqp_url, prefix=prefix, workdir=workdir
    )
    try:
        yield cluster
    except BaseException:
        print(cluster.tails(), flush=True)
        raise
    finally:
        await cluster.stop()


@contextlib.asynccontextmanager
async def empty_database(admin_dsn: str) -> AsyncIterator[str]:
    """A database of its own with no schema (``admin_dsn``: an asyncpg DSN of the server's
    ``postgres`` database); its name. Dropped after, whatever happened."""
    name = f"orch_t_release_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield name
    finally:
        admin = await asyncpg.connect(admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
