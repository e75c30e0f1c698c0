"""``scripts/up`` installs what running the system needs, not the dev tools (``scripts/test``
does): tried with a python3 and a pip that only record what they were asked."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
# python3 -m venv .venv: a venv whose pip records its arguments and "installs" orch.
mkdir -p .venv/bin
cat > .venv/bin/pip <<'PIP'
#!/bin/sh
echo "$*" >> .venv/pip.log
touch .venv/bin/orch && chmod +x .venv/bin/orch
PIP
chmod +x .venv/bin/pip
printf '#!/bin/sh\\n' > .venv/bin/python && chmod +x .venv/bin/python
"""


def _checkout(tmp_path: Path) -> Path:
    work = tmp_path / "checkout"
    (work / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "servers.sh", work / "scripts" / "servers.sh")
    (work / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(FAKE_PYTHON)
    (bindir / "python3").chmod(0o755)
    return work


def _run(work: Path, function: str) -> list[str]:
    bindir = work.parent / "bin"
    path = f"{bindir}{os.pathsep}{os.environ['PATH']}"
    subprocess.run(
        ["bash", "-c", f". scripts/servers.sh && {function}"],
        cwd=work,
        env={"PATH": path},
        check=True,
        timeout=60,
    )
    log = work / ".venv" / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


def test_running_installs_the_project_without_its_dev_extras(tmp_path: Path) -> None:
    work = _checkout(tmp_path)
    installs = [line for line in _run(work, "ensure_run_venv") if "-e" in line.split()]
    assert installs == ["install --quiet -e ."]
    assert "ensure_run_venv" in (ROOT / "scripts" / "up").read_text()
    # Again: nothing to do.
    assert [line for line in _run(work, "ensure_run_venv") if "-e" in line.split()] == installs


def test_the_tests_still_get_the_dev_extras_and_running_needs_nothing_more(
    tmp_path: Path,
) -> None:
    work = _checkout(tmp_path)
    _run(work, "ensure_run_venv")
    log = _run(work, "ensure_venv")
    assert log[-1] == "install --quiet -e .[dev]", "a run venv is completed for the tests"
    before = len(log)
    assert len(_run(work, "ensure_run_venv")) == before, "a dev venv can run the system"
    assert "ensure_venv" in (ROOT / "scripts" / "test").read_text()
