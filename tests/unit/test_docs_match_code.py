"""What the README and the docstrings say of the client and the test kit, against the code:
every public action named, every option of ``run_kind`` told, the examples as they run."""

from __future__ import annotations

import asyncio
import inspect
import textwrap
from pathlib import Path

import orch.testing
from orch.client import AsyncClient, Client
from orch.testing import run_kind

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()

#: The command line's own calls (an API path, its JSON as it is), and closing.
NOT_ACTIONS = {"request", "get_json", "post_json", "close", "aclose"}


def _section(title: str) -> str:
    return README.split(title, 1)[1].split("\n## ", 1)[0]


def test_every_public_method_of_the_clients_is_in_the_readme() -> None:
    section = _section("## From Python")
    for client in (Client, AsyncClient):
        public = {n for n, _ in inspect.getmembers(client, callable) if not n.startswith("_")}
        missing = sorted(n for n in public - NOT_ACTIONS if f"`{n}`" not in section)
        assert not missing, f"{client.__name__}: {missing} not in the README's From Python"


def test_every_option_of_run_kind_is_in_the_readme() -> None:
    section = _section("### Testing a kind")
    options = [
        p.name
        for p in inspect.signature(run_kind).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    missing = [o for o in options if f"{o}=" not in section]
    assert not missing, f"run_kind's {missing} not in the README's Testing a kind"


def test_the_kits_docstring_example_runs() -> None:
    """``orch.testing``'s own example says what a fenced copy leaves, as the README does."""
    doc = orch.testing.__doc__ or ""
    block = []
    for line in doc.split("::\n", 1)[1].splitlines():
        if line and not line.startswith("    "):
            break  # the indented block ends
        block.append(line)
    code = textwrap.dedent("\n".join(block))
    space: dict[str, object] = {}
    exec(code, space)  # defines test_my_kind_counts, with the kit imported
    test = space["test_my_kind_counts"]
    assert inspect.iscoroutinefunction(test)
    asyncio.run(test())


def test_the_readmes_failover_time_says_when_it_holds() -> None:
    """Tens of milliseconds for starts the broker gives back; not for directed ones (a drain's,
    a rebalance's), nor while an alarm blocks publishing."""
    after_kill = README.split("kill -9 <pid of local-1>", 1)[1].split("\n## ", 1)[0]
    said = " ".join(after_kill.split())
    assert "tens of milliseconds" in said
    assert "directed start" in said
    assert "alarm" in said
