"""The project never meets a user's modules: a kinds directory on ``PYTHONPATH`` holding a
``contracts.py``, a ``manager.py`` and an Alembic ``migrations/`` (names the repository's folders
have) breaks nothing, because the project imports those folders as ``orch_contracts``,
``orch_manager`` and ``orch_migrations``. Run as new processes outside the tree (the tree's root
is not on their path), as a user runs ``orch``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

#: Every package the project installs (the wheel test checks the wheel holds these alone).
PACKAGES = (
    "orch.cli",
    "orch_contracts",
    "orch_manager.app",
    "orch_migrations",
    "observer_service.service",
    "orch_bench",
    "orch_verify",
)


def users_modules(into: Path) -> Path:
    """A directory of a user's modules called ``contracts``, ``manager`` and ``migrations``
    (an Alembic folder), each failing loudly if the project ever imports it."""
    for name in ("contracts.py", "manager.py", "migrations/__init__.py"):
        (into / name).parent.mkdir(parents=True, exist_ok=True)
        (into / name).write_text(f"raise ImportError('the user\\'s own {name}, not orch\\'s')\n")
    return into


def _python(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    users = users_modules(tmp_path / "users")
    env = {**os.environ, "PYTHONPATH": str(users)}
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


def test_orch_runs_beside_a_users_contracts_manager_and_migrations(tmp_path: Path) -> None:
    done = _python(tmp_path, "-m", "orch", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("observer-orchestrator")


def test_every_package_imports_beside_them_and_the_users_own_stay_the_users(
    tmp_path: Path,
) -> None:
    code = (
        f"import importlib\nfor name in {PACKAGES!r}: importlib.import_module(name)\n"
        "try:\n    importlib.import_module('contracts')\nexcept ImportError as e:\n    print(e)\n"
    )
    done = _python(tmp_path, "-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "the user's own contracts.py, not orch's"


def test_nothing_of_the_project_imports_a_folder_by_its_short_name() -> None:
    """Inside the repository ``contracts`` still imports (the folder is there): a stray import
    of it, even in a string run by a subprocess, would be a second copy of the package with a
    registry of its own."""
    root = Path(__file__).resolve().parents[2]
    stray = re.compile(r"\b(?:from|import) (?:contracts|manager|migrations)\b")
    folders = [p for p in root.iterdir() if p.is_dir() and p.name not in {"src", ".git", ".venv"}]
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in [root / "README.md", *(f for d in folders for f in d.rglob("*"))]
        if path.suffix in {".py", ".md", ""} and path.is_file() and "__pycache__" not in path.parts
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if stray.search(line)
    ]
    assert not found, f"imports of the short names: {found}"
