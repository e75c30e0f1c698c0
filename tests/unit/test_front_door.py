"""The front door's decision on a machine without the servers: install them with apt where it
can (root on Debian or Ubuntu), else print the one command that would provide them. Tried with a
PATH that lacks the servers (and, for the apt branch, a dry run)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from orch.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("bash", "sleep", "grep", "sort", "tail", "ls", "cat", "mktemp", "rm", "sed", "env")


def _bin(tmp_path: Path, *, uid: int, apt: bool) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bindir / tool).symlink_to(found)
    (bindir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (bindir / "id").chmod(0o755)
    if apt:
        (bindir / "apt-get").write_text("#!/bin/sh\nexit 0\n")
        (bindir / "apt-get").chmod(0o755)
    return bindir


def _ensure_servers(
    bindir: Path, os_release: str = "ID=debian\n"
) -> subprocess.CompletedProcess[str]:
    release = bindir.parent / "os-release"
    release.write_text(os_release)
    env = {
        "ORCH_OS_RELEASE": str(release),
        "PATH": str(bindir),
        "ORCH_PG_PORT": str(free_port()),
        "ORCH_AMQP_PORT": str(free_port()),
        "ORCH_SERVERS_DRY_RUN": "1",
    }
    return subprocess.run(
        [str(bindir / "bash"), "-c", ". scripts/servers.sh && ensure_servers"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_the_servers_and_without_root_it_prints_the_command(tmp_path: Path) -> None:
    result = _ensure_servers(_bin(tmp_path, uid=1000, apt=True))
    assert result.returncode == 1
    assert "PostgreSQL is not running" in result.stderr
    assert "docker run -d --name orch-postgres" in result.stderr
    assert "docker run -d --name orch-rabbitmq" in result.stderr
    assert "would run" not in result.stdout


def test_as_root_on_debian_it_installs_them_with_apt(tmp_path: Path) -> None:
    result = _ensure_servers(_bin(tmp_path, uid=0, apt=True), os_release="ID=debian\n")
    assert result.returncode == 0, result.stderr
    assert "apt-get install -y -qq postgresql" in result.stdout
    assert "apt-get install -y -qq rabbitmq-server" in result.stdout
    assert "would run: pg_ctlcluster" in result.stdout
    assert "would run: rabbitmq-server -detached" in result.stdout


def test_without_apt_or_on_another_system_it_prints_the_command(tmp_path: Path) -> None:
    no_apt = _ensure_servers(_bin(tmp_path, uid=0, apt=False))
    assert no_apt.returncode == 1
    assert "docker run" in no_apt.stderr
    other = tmp_path / "other"
    other.mkdir()
    fedora = _ensure_servers(_bin(other, uid=0, apt=True), os_release="ID=fedora\n")
    assert fedora.returncode == 1
    assert "docker run" in fedora.stderr
