"""The live console in a real headless browser (Debian's chromium, driven by Playwright) against
a real cluster: it shows an observer move after its service is killed, without a reload, and
its actions work. ``scripts/test`` installs chromium; set ``ORCH_SCREENSHOT`` to keep the
screenshot somewhere (the README's is made this way)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, Dialog, Page, async_playwright

from tests.support.cluster import Cluster, wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not os.path.exists(CHROMIUM):  # noqa: ASYNC240 - once, before the browser starts
        pytest.fail("chromium is not installed: scripts/test installs Debian's chromium")
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            await b.close()


async def _cell(page: Page, observer_id: str, column: int) -> str:
    locator = page.locator(f'#observers tr[data-id="{observer_id}"] td').nth(column)
    return (await locator.inner_text()).strip()


async def test_the_console_follows_a_move_and_acts(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    await cluster.start_manager()
    a = await cluster.start_service("alpha", worker_count=10)
    ids = await cluster.create_recorders(4, interval=0.1)
    await cluster.wait_all_running(ids, timeout=15)
    await cluster.start_service("beta", worker_count=10)
    failing = uuid.UUID((await cluster.create("always-fails", kind="always_fails"))["id"])
    page = await browser.new_page(viewport={"width": 1280, "height": 900})
    prompts: list[str] = []

    async def answer(dialog: Dialog) -> None:
        if dialog.type == "prompt":  # the console asks for the API token once
            prompts.append(dialog.message)
            await dialog.accept(cluster.token or "")
        else:
            await dialog.accept()  # "are you sure?"

    page.on("dialog", answer)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"http://127.0.0.1:{cluster.api_port}/console")
    await page.wait_for_selector("#services tbody tr")
    watched = str(ids[0])
    await page.wait_for_selector(f'#observers tr[data-id="{watched}"]')
    assert await _cell(page, watched, 3) == "alpha"
    assert await _cell(page, watched, 2) == "processing"

    # SIGKILL its service: the page shows it on beta by itself (no reload).
    a.signal(signal.SIGKILL)

    async def moved() -> bool:
        return await _cell(page, watched, 3) == "beta"

    await wait_for(moved, timeout=20, what="the console to show the observer on beta")
    await wait_for(
        lambda: _has(page, f'#observers tr.failed[data-id="{failing}"]'),
        timeout=20,
        what="the failed observer highlighted",
    )
    shot = Path(os.environ.get("ORCH_SCREENSHOT") or tmp_path / "console.png")
    await page.screenshot(path=str(shot), full_page=True)
    assert os.path.getsize(shot) > 10_000  # noqa: ASYNC240

    # Its page: checkpoint, history, and the pause button (confirmed in the dialog).
    await page.click(f'#observers tr[data-id="{watched}"] a')
    await page.wait_for_selector("#o-events tbody tr")
    assert '"count"' in await page.inner_text("#o-checkpoint")
    await page.click("#o-actions button:text('Pause')")

    async def paused() -> bool:
        return (await page.inner_text("#o-field-status")).strip() == "paused"

    await wait_for(paused, timeout=15, what="the observer paused")
    assert (await cluster.observer(watched))["status"] == "paused"
    await page.click("#o-actions button:text('Resume')")
    await wait_for(lambda: _status_is(cluster, watched, "processing"), timeout=15, what="resumed")
    assert errors == [], f"the page raised: {errors}"
    assert len(prompts) == 1, f"asked for the token {len(prompts)} times"
    assert "wants an API token" in prompts[0]


async def _has(page: Page, selector: str) -> bool:
    return await page.locator(selector).count() > 0


async def _status_is(cluster: Cluster, oid: str, status: str) -> bool:
    return bool((await cluster.observer(oid))["status"] == status)


async def test_the_console_creates_many_and_shows_each_failure(
    cluster: Cluster, browser: Browser
) -> None:
    await cluster.start_manager()
    tag = uuid.uuid4().hex[:6]
    lines = [
        {"name": f"{tag}-1", "kind": "ticker", "params": {"interval": 3600}},
        {"name": f"{tag}-2", "kind": "ticker", "params": {"interval": 3600}},
        {"name": f"{tag}-2", "kind": "ticker"},  # the same name again
        {"name": f"{tag}-3", "kind": "no-such-kind"},
        {"name": f"{tag}-4", "kind": "ticker"},
    ]
    page = await browser.new_page()
    page.on("dialog", lambda d: d.accept(cluster.token or ""))
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    await page.goto(f"http://127.0.0.1:{cluster.api_port}/console")
    await page.wait_for_selector("#observers")
    await page.click("#create summary")
    await page.fill("#create-text", "\n".join(json.dumps(x) for x in lines))  # JSON lines
    await page.click("#create-go")

    async def done() -> bool:
        return "3 of 5 created, 2 failed" in await page.inner_text("#create-progress")

    await wait_for(done, timeout=15, what="the console to report the bulk create")
    failures = await page.locator("#create-failures li").all_inner_texts()
    assert failures[0].startswith("#3: 409"), failures
    assert failures[1].startswith("#4: 422"), failures
    assert "kind" in failures[1], "the field that is wrong is named"
    created = await (await cluster.connect()).fetchval(
        "SELECT count(*) FROM observers WHERE name LIKE $1", f"{tag}-%"
    )
    assert created == 3
    assert errors == [], f"the page raised: {errors}"
