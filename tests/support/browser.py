"""A headless chromium (Debian's, driven by Playwright) for the browser tests, and their
screenshots (kept in ``ORCH_SCREENSHOTS`` when set)."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, Page, async_playwright

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


def screenshot_dir(tmp_path: Path) -> Path:
    where = Path(os.environ.get("ORCH_SCREENSHOTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


async def shot(page: Page, where: Path, name: str) -> None:
    path = where / f"{name}.png"
    await page.screenshot(path=str(path), full_page=False)
    assert os.path.getsize(path) > 10_000  # noqa: ASYNC240
