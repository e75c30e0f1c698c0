"""Each mutant of ``scripts/mutants`` still names code that exists, once, and tests that exist:
a statement reworded since its mutant was written makes the mutant apply to nothing, and the
hand-run check reports it "alive" with nothing learned (two had gone stale that way)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mutants() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutants", ROOT / "scripts" / "mutants.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mutants", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


MUTANTS = _mutants().MUTANTS


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_mutant_applies_once_and_names_tests_that_exist(mutant: object) -> None:
    source = (ROOT / mutant.path).read_text()  # type: ignore[attr-defined]
    assert source.count(mutant.old) == 1, f"{mutant.path}: the code to mutate is not found once"  # type: ignore[attr-defined]
    for test in mutant.tests:  # type: ignore[attr-defined]
        path, _, name = test.partition("::")
        assert (ROOT / path).is_file(), test
        if name:  # a whole file, or one test of it
            assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), test
