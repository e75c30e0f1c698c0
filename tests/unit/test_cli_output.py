"""What the command line prints from data it does not control (names, errors, params): shown
literally, never as Rich markup or terminal control; ids whole, however narrow the terminal."""

from __future__ import annotations

import io
import sys
import uuid

import pytest
from rich.console import Console

from orch.api_commands import UNBOUNDED, _observer_table, console, shown
from orch.client import problem_text


def _row(**fields: object) -> dict[str, object]:
    return {
        "id": str(uuid.uuid4()),
        "name": "n",
        "kind": "ticker",
        "status": "processing",
        "service_id": str(uuid.uuid4()),
        "epoch": 1,
        "restart_count": 0,
        "checkpointed_at": None,
        **fields,
    }


def _render(renderable: object, width: int = 80) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_markup_and_control_characters_are_shown_as_they_are() -> None:
    rows = [
        _row(name="x[/red]"),
        _row(name="[link=http://127.0.0.1/]click[/link]"),
        _row(name="esc\x1b[31mRED", kind="bidi\u202eevil"),
    ]
    text = _render(_observer_table(rows), width=200)
    assert "x[/red]" in text
    assert "[link=http://127.0.0.1/]click[/link]" in text
    assert "esc\\x1b[31mRED" in text
    assert "bidi\\u202eevil" in text
    assert "\x1b" not in text
    assert "\u202e" not in text


def test_shown_escapes_markup_and_controls_only() -> None:
    assert shown("plain name") == "plain name"
    assert shown("[bold]x[/bold]") == "\\[bold]x\\[/bold]"
    assert shown("a\x1b[2Jb\x07") == "a\\x1b[2Jb\\x07"


def test_observer_ids_are_whole_at_80_columns() -> None:
    rows = [_row(name="a-rather-long-observer-name-" * 3, status="failed", restart_count=3)]
    text = _render(_observer_table(rows), width=80)
    assert str(rows[0]["id"]) in text
    wide = _render(_observer_table(rows, wide=True), width=200)
    assert str(rows[0]["service_id"]) in wide


def test_a_batch_items_problem_names_each_field() -> None:
    problem = {
        "title": "Unprocessable Content",
        "status": 422,
        "detail": "the observer is not valid",
        "errors": [
            {"loc": ["body", "observers", 4, "name"], "msg": "Field required", "type": "missing"},
            {"loc": ["body", "observers", 4, "kind"], "msg": "too long", "type": "x"},
        ],
    }
    assert problem_text(problem, under=2) == (
        "the observer is not valid: name: Field required; kind: too long"
    )


def test_without_a_terminal_tables_are_as_wide_as_their_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stdout", captured)
    piped = console()
    assert piped.width == UNBOUNDED
    rows = [_row(name="n" * 120)]
    piped.print(_observer_table(rows, wide=True))
    assert "n" * 120 in captured.getvalue()
    monkeypatch.setenv("COLUMNS", "100")
    assert console().width == 100
