"""The API docs (``ORCH_API_DOCS=true``) with no internet: /docs and /redoc load Swagger UI's and
ReDoc's files from the manager itself, under a CSP of 'self', and render in a real headless
browser (Debian's chromium, driven by Playwright) that may reach the manager alone."""

from __future__ import annotations

import gzip
import re
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from playwright.async_api import Browser, ConsoleMessage, Route

from orch_manager.app import create_app
from orch_manager.settings import ManagerSettings
from tests.support.browser import browser, screenshot_dir, shot
from tests.support.cluster import Cluster

__all__ = ["browser"]  # the fixture

TYPES = {".js": "text/javascript", ".css": "text/css"}


def _references(html: str) -> list[str]:
    return re.findall(r"""<(?:script|link)\b[^>]*\b(?:src|href)="([^"]*)\"""", html)


async def test_the_docs_reference_no_other_host_and_their_files_are_served() -> None:
    app = create_app(ManagerSettings(api_docs=True, auth="disabled"))
    # No lifespan: nothing connects; the docs need no runtime.
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://manager") as c:
        for path, wanted in (
            ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "swagger-init.js"}),
            ("/redoc", {"redoc.standalone.js"}),
        ):
            r = await c.get(path)
            assert r.status_code == 200, path
            assert r.headers["x-frame-options"] == "DENY"
            csp = r.headers["content-security-policy"]
            assert "default-src 'none'" in csp
            assert "script-src 'self';" in csp  # this origin's files, no inline script
            if path == "/docs":
                assert "style-src 'self';" in csp
            assert "frame-ancestors 'none'" in csp
            assert "http" not in csp, csp  # no other host
            assert not re.search(r"<script>|<script [^>]*>[^<]", r.text), "an inline script"
            refs = _references(r.text)
            assert not re.search(r"(?:https?:)?//", " ".join(refs)), refs
            assert {urlsplit(u).path.rsplit("/", 1)[-1] for u in refs if u != "data:,"} == wanted
            for url in refs:
                if url == "data:,":  # the empty favicon
                    continue
                assert url.startswith("/docs/assets/"), url
                assert re.search(r"\?v=[0-9a-f]{16}$", url), url  # its digest: cached for good
                a = await c.get(url, headers={"accept-encoding": "identity"})
                assert a.status_code == 200, url
                suffix = "." + urlsplit(url).path.rsplit(".", 1)[-1]
                assert a.headers["content-type"].startswith(TYPES[suffix]), url
                assert "max-age=31536000" in a.headers["cache-control"], url
                assert a.headers["x-content-type-options"] == "nosniff"
                assert "content-encoding" not in a.headers
                zipped = await c.get(url, headers={"accept-encoding": "gzip, br"})
                assert zipped.content == a.content  # httpx unzips it
                if len(a.content) > 100_000:  # Swagger UI's and ReDoc's, not the start
                    assert zipped.headers["content-encoding"] == "gzip"
                    assert int(zipped.headers["content-length"]) < len(a.content) / 3
                    assert gzip.decompress(await _raw(c, url)) == a.content
                refused = await c.get(url, headers={"accept-encoding": "gzip;q=0"})
                assert "content-encoding" not in refused.headers
            assert (await c.head(refs[-1])).status_code == 200
        assert (await c.get("/docs/assets/swagger-ui-bundle.js")).status_code == 200  # no ?v
        missing = await c.get("/docs/assets/..%2Fapp.py")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/problem+json"
        assert (await c.get("/docs/assets/index.html")).status_code == 404


async def _raw(c: httpx.AsyncClient, url: str) -> bytes:
    """The gzipped body as sent."""
    async with c.stream("GET", url, headers={"accept-encoding": "gzip"}) as r:
        return b"".join([part async for part in r.aiter_raw()])


async def test_the_docs_are_off_without_the_setting() -> None:
    app = create_app(ManagerSettings(auth="disabled"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://manager") as c:
        for path in ("/docs", "/redoc", "/docs/assets/swagger-ui-bundle.js"):
            assert (await c.get(path)).status_code == 404, path


async def test_swagger_ui_and_redoc_render_with_no_other_host(
    cluster: Cluster, browser: Browser, tmp_path: Path
) -> None:
    manager = await cluster.start_manager(api_docs="true")
    origin = f"http://127.0.0.1:{manager.port}"
    elsewhere: list[str] = []  # requests for any other host, aborted as offline
    problems: list[str] = []  # page errors, CSP refusals, failed loads

    async def offline(route: Route) -> None:
        url = route.request.url
        if url.startswith(origin + "/") or url.startswith(("data:", "blob:")):
            await route.continue_()
        else:
            elsewhere.append(url)
            await route.abort("internetdisconnected")

    def console(msg: ConsoleMessage) -> None:
        if msg.type == "error":
            problems.append(f"console: {msg.text}")

    where = screenshot_dir(tmp_path)
    context = await browser.new_context(viewport={"width": 1360, "height": 900})
    await context.route("**/*", offline)
    try:
        page = await context.new_page()
        page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        page.on("console", console)
        page.on("requestfailed", lambda r: problems.append(f"failed: {r.url} {r.failure}"))

        await page.goto(f"{origin}/docs")
        await page.wait_for_selector(".opblock", timeout=30_000)
        ops = await page.locator(".opblock").count()
        assert ops >= 10, ops  # the operations list
        assert await page.locator(".opblock-summary-path", has_text="/observers").count() > 0
        title = await page.locator(".info .title").inner_text()
        assert "observer-orchestrator" in title
        assert await page.locator(".swagger-ui .info").is_visible()
        # Swagger UI's own styles: an operation's method badge is coloured.
        colour = await page.locator(".opblock-get .opblock-summary-method").first.evaluate(
            "e => getComputedStyle(e).backgroundColor"
        )
        assert colour not in ("rgba(0, 0, 0, 0)", "transparent"), colour
        await shot(page, where, "docs-swagger-offline")
        # An operation opens, and is tried (a call to the manager, under the CSP).
        health = page.locator(".opblock", has_text="/healthz")
        await health.locator(".opblock-summary").click()
        await health.locator(".try-out__btn").click()
        await health.locator(".execute").click()
        status = health.locator(".live-responses-table tbody .response-col_status").first
        await status.wait_for()
        assert (await status.inner_text()).strip() == "200"
        await status.scroll_into_view_if_needed()
        await shot(page, where, "docs-swagger-offline-tried")

        await page.goto(f"{origin}/redoc")
        await page.wait_for_selector("[data-section-id^='operation/']", timeout=30_000)
        assert await page.locator("[data-section-id^='operation/']").count() >= 10
        await shot(page, where, "docs-redoc-offline")
    finally:
        await context.close()
    assert not elsewhere, elsewhere
    # ReDoc's side menu shows Redocly's logo from their CDN, with no option to leave it out: the
    # CSP refuses it before any request (so it is not in ``elsewhere``) and ReDoc hides it.
    logo = "https://cdn.redoc.ly/redoc/logo-mini.svg"
    assert not [p for p in problems if logo not in p], problems
