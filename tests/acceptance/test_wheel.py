"""The built wheel alone runs the system: built from the project's files, installed by itself
into a fresh virtual environment, and run from a directory outside the source tree (so nothing
is imported from the tree), beside a user's own modules called ``contracts``, ``manager`` and
``migrations``: ``orch migrate`` on a scratch database, a manager and a service,
an observer created through the command line that ticks, and the console with its assets.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from orch.cluster import free_port, wait_for
from orch_contracts.topology import Topology, delete_topology
from tests.conftest import RUN, Servers, _admin
from tests.unit.test_import_names import users_modules

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _sources(into: Path) -> None:
    """The project's files as a clean checkout has them (tracked, or new and not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_symlink():  # src/: the links that give the folders their import names
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            (into / name).symlink_to(src.readlink())
        elif src.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, into / name)


def _run(*cmd: str | Path, cwd: Path, env: dict[str, str], timeout: float = 600) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{cmd}: {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@contextlib.contextmanager
def _process(
    *cmd: str | Path, cwd: Path, env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=out, stderr=out)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def test_the_wheel_alone_migrates_serves_runs_and_shows_the_console(
    servers: Servers, tmp_path: Path
) -> None:
    # A bare environment (pip's own settings pass: where this machine finds packages).
    env_base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    env_base |= {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    source, wheels, run_dir = tmp_path / "source", tmp_path / "wheels", tmp_path / "run"
    for d in (source, wheels, run_dir):
        d.mkdir()
    _sources(source)

    # The wheel, built from those files; installed alone into a fresh venv.
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, source,
         cwd=tmp_path, env=env_base)  # fmt: skip
    (wheel,) = wheels.glob("observer_orchestrator-*.whl")
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path, env=env_base)
    _run(venv / "bin" / "pip", "install", "-q", wheel, cwd=tmp_path, env=env_base)
    orch = venv / "bin" / "orch"
    shutil.rmtree(source)  # nothing of the tree is left to import from
    (top_level,) = venv.glob("lib/python*/site-packages/observer_orchestrator-*/top_level.txt")
    assert set(top_level.read_text().split()) == {
        "observer_service", "orch", "orch_bench", "orch_contracts", "orch_manager",
        "orch_migrations", "orch_verify",
    }  # fmt: skip
    # A user's own modules by the folders' short names, first on the path (as a kinds directory
    # is): every command below runs beside them.
    env_base["PYTHONPATH"] = str(users_modules(tmp_path / "users"))
    assert _run(orch, "--version", cwd=run_dir, env=env_base).startswith("observer-orchestrator")

    database = f"orch_t_{RUN}_wheel"
    prefix = f"t{RUN}.wheel"
    token, entry = _token(orch, run_dir, env_base)
    port = free_port()
    env = {
        **env_base,
        "ORCH_DATABASE_URL": servers.database_url(database),
        "ORCH_AMQP_URL": servers.amqp_url,
        "ORCH_PREFIX": prefix,
        "ORCH_API_TOKENS": entry,
        "ORCH_API": f"http://127.0.0.1:{port}",
        "ORCH_TOKEN": token,
    }
    try:
        # Its migrations, from the installed package, on a database that does not exist yet.
        assert "schema is up to date" in _run(orch, "migrate", cwd=run_dir, env=env)
        manager_log, service_log = tmp_path / "manager.log", tmp_path / "service.log"
        with (
            _process(orch, "manager", "--port", str(port), cwd=run_dir, env=env, log=manager_log),
            _process(
                orch,
                "service",
                "--name",
                "w-1",
                "--worker-count",
                "2",
                cwd=run_dir,
                env=env,
                log=service_log,
            ),  # fmt: skip
        ):
            async with httpx.AsyncClient(
                base_url=env["ORCH_API"], headers={"Authorization": f"Bearer {token}"}
            ) as api:
                await wait_for(lambda: _ready(api), timeout=60, what=f"the manager ({manager_log})")
                out = _run(orch, "observers", "create", "wheel-tick", "ticker",
                           "-p", "interval=0.2", "--json", cwd=run_dir, env=env)  # fmt: skip
                oid = uuid.UUID(json.loads(out)["id"])

                async def ticks() -> dict[str, Any] | None:
                    o: dict[str, Any] = (await api.get(f"/observers/{oid}")).json()
                    count = (o.get("checkpoint") or {}).get("count", 0)
                    return o if o["status"] == "processing" and count >= 2 else None

                shown = await wait_for(ticks, timeout=60, what=f"it ticking ({service_log})")
                assert shown["service_id"] is not None
                # The console and its files, from the installed package.
                page = await api.get("/console")
                assert page.status_code == 200
                assert "console.js" in page.text
                for asset in ("console.js", "console.css"):
                    r = await api.get(f"/console/static/{asset}")
                    assert r.status_code == 200, asset
                    assert len(r.content) > 1000, asset
    finally:
        await _admin(servers, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        with contextlib.suppress(Exception):
            await delete_topology(servers.amqp_url, Topology(prefix))


def _token(orch: Path, cwd: Path, env: dict[str, str]) -> tuple[str, str]:
    out = _run(orch, "token", "new", "wheel", "--role", "admin", cwd=cwd, env=env)
    fields = dict(line.split(": ", 1) for line in out.strip().splitlines())
    return fields["token"], fields["ORCH_API_TOKENS entry"]


async def _ready(api: httpx.AsyncClient) -> bool:
    try:
        return (await api.get("/readyz")).status_code == 200
    except httpx.HTTPError:  # not listening yet
        return False
