"""``orch verify`` catches kinds that break the rules, each with its verdict line.

Two runs of the real command over kinds made to misbehave (``tests.support.bad_kinds``): one
with services stopped and drained under them (a kind that ignores cancellation, a kind whose
thread writes on after its copy stopped), one without faults (a kind that blocks the event
loop, a kind that leaks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser

from orch_verify.judge import GROWTH_FLAG
from tests.conftest import Servers
from tests.support.browser import browser, screenshot_dir, shot
from tests.support.cluster import Cluster

__all__ = ["browser"]  # the fixture

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    code: int
    output: str
    verdict: dict[str, Any]
    report: str

    def line(self, start: str) -> str:
        found = [line for line in self.output.splitlines() if line.startswith(start)]
        assert found, f"no line starting {start!r} in:\n{self.output[-4000:]}"
        return found[0]


def _verify(servers: Servers, tmp: Path, name: str, *args: str, **env: str) -> Run:
    out = tmp / f"{name}.json"
    report = tmp / f"{name}.html"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orch",
            "verify",
            "--kinds",
            "tests.support.bad_kinds",
            "--json",
            str(out),
            "--report",
            str(report),
            *args,
        ],
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "ORCH_DATABASE_URL": servers.database_url("postgres"),
            "ORCH_AMQP_URL": servers.amqp_url,
            "COLUMNS": "200",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert out.exists(), output[-4000:]
    return Run(proc.returncode, output, json.loads(out.read_text())["verdict"], report.read_text())


@pytest.fixture(scope="module")
def moved(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Services stopped gracefully and drained under a swallower and a thread writer."""
    return _verify(
        servers,
        tmp_path_factory.mktemp("verify"),
        "moved",
        *("--observer", "swallower*2", "--observer", "thread_writer*4"),
        *("--faults", "term=3,drain=1", "--every", "4", "--seconds", "20"),
        *("--services", "2", "--seed", "5"),
        ORCH_SHUTDOWN_TIMEOUT="3",
        ORCH_LEASE_TTL="2",
    )


@pytest.fixture(scope="module")
def steady(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """No faults: a kind that blocks the loop and one that leaks, measured."""
    return _verify(
        servers,
        tmp_path_factory.mktemp("verify"),
        "steady",
        *("--observer", "loop_blocker*2", "--observer", "leaky*2"),
        *("--faults", "none", "--seconds", "35", "--services", "1", "--seed", "1"),
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_kind_that_swallows_cancellation_is_reported(moved: Run) -> None:
    line = moved.line("IGNORED CANCELLATION swallower")
    assert "gave up waiting" in line or "never ended" in line
    assert moved.verdict["kinds"]["swallower"]["ignored_cancellation"]
    assert not moved.verdict["stopped_in_time"]
    assert moved.code == 1


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_thread_writing_outside_the_guard_is_an_overlap_seen_by_the_witness(
    moved: Run,
) -> None:
    line = moved.line("OVERLAP thread_writer")
    assert "ran at once" in line
    overlap = next(o for o in moved.verdict["overlaps"] if o["kind"] == "thread_writer")
    a, b = overlap["copies"]
    assert a["epoch"] != b["epoch"]
    assert not moved.verdict["promise_held"]
    assert 'stroke="#d00"' in moved.report  # the overlap drawn in red on the timeline


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_kind_that_blocks_the_loop_is_a_stall_with_the_observer_named(steady: Run) -> None:
    line = steady.line("STALL loop_blocker")
    blocker = steady.verdict["kinds"]["loop_blocker"]
    assert blocker["longest_stall_seconds"] >= 1.9
    assert blocker["stalled_observer"] in line
    assert "leaky" not in {
        line.split()[1] for line in steady.output.splitlines() if line.startswith("STALL")
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_kind_that_leaks_is_reported_with_its_growth(steady: Run) -> None:
    steady.line("MEMORY GROWTH leaky")
    kinds = steady.verdict["kinds"]
    assert kinds["leaky"]["memory_growth_bytes_per_observer_per_minute"] > GROWTH_FLAG
    assert (kinds["loop_blocker"]["memory_growth_bytes_per_observer_per_minute"] or 0) < GROWTH_FLAG
    # No fault, nothing lost, nothing overlapping: the promise held for these kinds.
    assert steady.verdict["promise_held"], steady.output[-3000:]
    assert steady.code == 0, steady.output[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_the_report_shows_the_overlap_and_the_console_links_to_it(
    moved: Run, cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    report = tmp_path / "orch-verify-report.html"
    report.write_text(moved.report)
    await cluster.start_manager(verify_report=str(report))
    page = await browser.new_page(viewport={"width": 1360, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"http://127.0.0.1:{cluster.api_port}/console")
    await page.fill("#login-token", cluster.token or "")
    await page.click("#login-go")
    link = page.locator("#verify-report")
    await link.wait_for(state="visible")
    async with page.context.expect_page() as opened:
        await link.click()
    shown = await opened.value
    await shown.wait_for_load_state()
    assert "orch verify, seed 5" in await shown.title()
    overlap = shown.locator('svg rect[stroke="#d00"]').first
    assert await overlap.is_visible()
    assert await shown.locator("text=OVERLAP thread_writer").count() > 0
    await shot(shown, screenshot_dir(tmp_path), "verify")
    assert errors == []
