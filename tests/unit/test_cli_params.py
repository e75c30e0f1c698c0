"""What ``-p``, ``--params`` and ``observers import`` take: one clear line and exit 2 for a
number JSON does not allow or a key given twice, never a traceback; checked before any request
(the API address given leads nowhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orch.cli import app

NOWHERE = "http://127.0.0.1:1"


def _orch(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300", "ORCH_TOKEN": "x"})
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_a_number_json_does_not_allow_is_refused(value: str) -> None:
    code, output = _orch(
        "observers", "create", "x", "ticker", "-p", f"interval={value}", "--api", NOWHERE
    )
    assert code == 2
    assert f"'interval={value}'" in output
    assert "Traceback" not in output


def test_params_json_with_a_non_finite_number_is_refused() -> None:
    code, output = _orch(
        "observers", "create", "x", "ticker", "--params", '{"interval": NaN}', "--api", NOWHERE
    )
    assert code == 2
    assert "NaN is not a number JSON allows" in output


def test_a_key_given_twice_is_refused() -> None:
    code, output = _orch(
        "observers", "create", "x", "ticker", "-p", "k=1", "-p", "k=2", "--api", NOWHERE
    )
    assert code == 2
    assert "'k' is given twice" in output


def test_text_that_is_not_json_is_taken_as_text() -> None:
    code, output = _orch(
        "observers", "create", "x", "ticker", "-p", "url=https://a.b/c", "--api", NOWHERE
    )
    assert code == 1  # it got as far as the request
    assert "cannot reach the manager" in output


def test_an_import_with_a_non_finite_number_names_it(tmp_path: Path) -> None:
    array = tmp_path / "a.json"
    array.write_text('[{"name": "a", "kind": "ticker", "params": {"interval": Infinity}}]')
    code, output = _orch("observers", "import", str(array), "--api", NOWHERE)
    assert code == 2
    assert "Infinity is not a number JSON allows" in output
    lines = tmp_path / "a.jsonl"
    lines.write_text(json.dumps({"name": "a", "kind": "ticker"}) + "\n" + '{"x": 1e400}\n')
    code, output = _orch("observers", "import", str(lines), "--api", NOWHERE)
    assert code == 1  # the good line reaches for the manager; the bad one is named
    assert "Traceback" not in output


def test_the_command_line_loads_no_server_module_for_an_api_command() -> None:
    """``orch --version`` and the API commands import neither the drivers nor the settings of
    the servers (they took half a second of every call)."""
    import subprocess
    import sys

    heavy = (
        "sqlalchemy",
        "asyncpg",
        "aio_pika",
        "orch_contracts.preflight",
        "orch_contracts.settings",
    )
    probe = (
        "import sys, orch.cli, orch.api_commands; "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]"


def test_a_param_search_is_built_as_containment_json() -> None:
    from orch_manager.api.observers import param_filter

    assert param_filter("symbol=BTC", raw=True) == '{"symbol": "BTC"}'
    assert param_filter("feed.interval=5", raw=True) == '{"feed": {"interval": 5}}'
    assert param_filter('a=["x"]', raw=True) == '{"a": ["x"]}'
    assert param_filter("a=NaN", raw=True) == '{"a": "NaN"}'  # no JSON number: the text
    assert param_filter("url=https://x/?a=b", raw=True) == '{"url": "https://x/?a=b"}'
    assert param_filter(None, raw=False) is None
    from orch_contracts.errors import InvalidInput

    # What PostgreSQL's JSON refuses (a 500 before): NUL, a number past a double's range.
    for bad in ("a=1e999", 'a="\\u0000"', "a\x00=1", "a=x\x00y"):
        with pytest.raises(InvalidInput):
            param_filter(bad, raw=True)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "nothing to change"),
        (("-p", "interval=5", "--unset", "interval"), "'interval' is both set and unset"),
        (("-p", "interval=NaN"), "'interval=NaN'"),
    ],
)
def test_an_edit_with_nothing_or_a_contradiction_is_refused(
    args: tuple[str, ...], says: str
) -> None:
    code, output = _orch("observers", "edit", "btc", *args, "--api", NOWHERE)
    assert code == 2
    assert says in output


def test_an_edit_is_a_merge_patch() -> None:
    from orch_manager.api.observers import merge_patch

    before = {"url": "https://x", "headers": {"a": "1", "b": "2"}, "interval": 5}
    patch = {"headers": {"b": None, "c": "3"}, "interval": None, "timeout": 2}
    after = {"url": "https://x", "headers": {"a": "1", "c": "3"}, "timeout": 2}
    assert merge_patch(before, patch) == after
    assert before["headers"] == {"a": "1", "b": "2"}  # neither side is changed
    assert merge_patch(before, {"headers": ["x"]})["headers"] == ["x"]
