"""An observer whose error quotes its secret param: the secret is in no response of any route
to a ``read`` token, and in no line of the service's log.

A real service (a process) runs the kind and records its error; the manager runs in process,
auth on, over the same database. Every GET route of the app is called (found by walking the
app's routes, so a new route is covered the day it is added), with the filters that find the
observer. A second observer's error is written straight into its row, as a service that did
not mask it yet wrote it: the read side masks that one too.
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.routing import Route

from tests.conftest import Servers
from tests.integration.conftest import AuthApi, auth_api
from tests.support.cluster import Cluster

#: What a path parameter of that name is filled with (a new one fails the walk: add it here).
PATH_PARAMS = {"observer_id", "service_id"}


def get_routes(app: FastAPI) -> Iterator[tuple[str, set[str], set[str]]]:
    """(path, methods, query parameter names) of every route of the app, included routers'
    too; mounted static files aside."""
    for route in app.routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if contexts is not None:
            for c in contexts():
                queries = {p.alias for p in c.dependant.query_params}
                yield c.path, set(c.methods or ()), queries
        elif isinstance(route, Route):
            yield route.path, set(route.methods or ()), set()


@pytest.fixture
async def api(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[AuthApi]:
    async with auth_api(servers, database_url, prefix, "tests.support.kinds") as a:
        yield a


async def _create(api: AuthApi, name: str, key: str) -> dict[str, Any]:
    r = await api.admin.post(
        "/observers", json={"name": name, "kind": "quotes_its_key", "params": {"api_key": key}}
    )
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_a_secret_quoted_by_an_error_is_shown_by_no_route_and_logged_nowhere(
    api: AuthApi, cluster: Cluster
) -> None:
    key = f"sk_live_{secrets.token_hex(8)}"
    old_key = f"sk_old_{secrets.token_hex(8)}"
    service = await cluster.start_service("svc", 2)
    quoting = await _create(api, "quoting", key)
    older = await _create(api, "older", old_key)
    await cluster.wait_status(quoting["id"], "failed", timeout=30)
    # The second one's error as a service that did not mask it would have written it.
    db = await cluster.connect()
    await db.execute(
        "UPDATE observers SET last_error = $2 WHERE id = $1",
        uuid.UUID(older["id"]),
        f"RuntimeError: upstream refused key {old_key}",
    )
    (sid,) = {r["id"] for r in await db.fetch("SELECT id FROM services")}

    fills = {"observer_id": quoting["id"], "service_id": str(sid)}
    finds = {"q": "quot", "kind": "quotes_its_key", "status": "failed", "name": "quot"}
    called = []
    for path, methods, queries in get_routes(api.app):
        if "GET" not in methods:
            continue
        names = set(re.findall(r"{(\w+)(?::\w+)?}", path))
        assert names <= PATH_PARAMS, f"{path}: teach this test what {names} are"
        for oid in (quoting["id"], older["id"]):
            url = path
            for name, value in {**fills, "observer_id": oid}.items():
                url = re.sub(rf"{{{name}(?::\w+)?}}", value, url)
            for params in ({}, {k: v for k, v in finds.items() if k in queries}):
                r = await api.read.get(url, params=params)
                called.append((url, r.status_code))
                assert r.status_code < 500, (url, r.text)
                assert key not in r.text, (url, params)
                assert old_key not in r.text, (url, params)
    # The walk reached the routes that show the error (and so could have shown the key).
    assert (f"/observers/{quoting['id']}", 200) in called
    assert (f"/observers/{older['id']}/events", 200) in called
    assert ("/views/observers", 200) in called
    for name in ("quot", "older"):
        view = (await api.read.get("/views/observers", params={"q": name})).json()
        (row,) = view["items"]
        assert row["last_error"] == "RuntimeError: upstream refused key ***", name
    # The traceback, masked as well: where the kind raised, and the error's line again.
    shown = (await api.read.get(f"/observers/{quoting['id']}")).json()
    assert shown["last_error"] == "RuntimeError: upstream refused key ***"
    trace = shown["traceback"]
    assert trace.startswith("Traceback (most recent call last):\n"), trace
    assert ", in quotes_its_key\n" in trace, trace
    assert trace.endswith("RuntimeError: upstream refused key ***\n"), trace

    # The service's log: its warning line about the error, and the kind's own line with the
    # key, both written with the key masked.
    await service.wait_log("raised (RuntimeError: upstream refused key ***)")
    await service.wait_log("calling upstream with key ***")
    assert service.log is not None
    log = service.log.read_text(errors="replace")
    assert key not in log
    # And the error as the service recorded it (what the error queue and history carry).
    stored = await db.fetchval(
        "SELECT last_error FROM observers WHERE id = $1", uuid.UUID(quoting["id"])
    )
    assert stored.startswith("RuntimeError: upstream refused key ***\n\nTraceback"), stored
    assert key not in stored
    details = await db.fetch(
        "SELECT detail FROM observer_events WHERE observer_id = $1 AND detail IS NOT NULL",
        uuid.UUID(quoting["id"]),
    )
    assert details
    assert all(key not in d["detail"] for d in details)
    # A history row keeps the error's line alone.
    assert all("Traceback" not in d["detail"] for d in details), details
