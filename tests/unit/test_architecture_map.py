"""docs/architecture.md's map lists every module; docs/glossary.md links only modules that exist.

No servers: files are read, never imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PACKAGES = ("contracts", "manager", "observer_service", "orch", "orch_bench", "orch_verify")
#: Listed as folders, one row each: migrations/ and every subfolder of tests/.
FOLDERS = ("migrations",)


def _holds_code(path: Path) -> bool:
    """Anything in the module besides its docstring."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def modules() -> list[str]:
    """Every module of the packages, as a path from the repository's root (``manager/app.py``);
    an ``__init__.py`` only when it holds code."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            if path.name == "__init__.py" and not _holds_code(path):
                continue
            found.append(path.relative_to(ROOT).as_posix())
    return found


def folders() -> list[str]:
    """The folders the map lists as one row each: ``migrations/`` and ``tests/<sub>/``."""
    subs = [
        f"tests/{d.name}/"
        for d in sorted((ROOT / "tests").iterdir())
        if d.is_dir() and not d.name.startswith(("_", ".")) and any(d.glob("*.py"))
    ]
    return [f"{f}/" for f in FOLDERS] + subs


def map_section() -> str:
    """The text of architecture.md's *Map* section, up to the next second-level heading."""
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    start = text.index("\n## Map\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_packages_are_there() -> None:
    assert len(modules()) > 50
    assert "manager/api/views.py" in modules()
    assert "manager/__init__.py" not in modules()  # a docstring alone


def test_every_module_is_on_the_map() -> None:
    section = map_section()
    missing = [m for m in [*modules(), *folders()] if f"`{m}`" not in section]
    assert not missing, "missing from docs/architecture.md's map:\n" + "\n".join(missing)


def test_the_map_names_no_module_that_is_gone() -> None:
    named = re.findall(r"`([\w/.]+(?:\.py|/))`", map_section())
    assert len(named) > 50
    gone = [n for n in named if not (ROOT / n).exists()]
    assert not gone, "on the map but not in the tree:\n" + "\n".join(gone)


def test_architecture_links_the_glossary() -> None:
    head = (DOCS / "architecture.md").read_text(encoding="utf-8")[:1000]
    assert "(glossary.md)" in head


def test_glossary_links_modules_that_exist() -> None:
    text = (DOCS / "glossary.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert len(local) > 40
    broken = sorted({link for link in local if not (DOCS / link).resolve().is_file()})
    assert not broken, "docs/glossary.md links what does not exist:\n" + "\n".join(broken)
