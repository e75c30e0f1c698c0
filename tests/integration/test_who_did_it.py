"""Who did it: each action asked through the API is recorded in the observer's history with the
name of the token that asked (never its secret), and ``GET /views/actions`` lists the newest
actions, all or one token's. Real PostgreSQL and RabbitMQ; the manager app in this process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import Servers
from tests.integration.conftest import AuthApi, auth_api


@pytest.fixture
async def clients(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[AuthApi]:
    async with auth_api(servers, database_url, prefix, "observer_service.kinds") as a:
        yield a


async def _history(api: AuthApi, oid: str) -> list[tuple[str, Any]]:
    got = await api.read.get(f"/observers/{oid}/events")
    assert got.status_code == 200, got.text
    return [(e["event"], e["actor"]) for e in got.json()]


async def test_each_action_names_the_token_that_asked(clients: AuthApi) -> None:
    # Two creates at once: they share one group commit, written by another task.
    made = await asyncio.gather(
        *(
            clients.admin.post("/observers", json={"name": f"who-{i}", "kind": "ticker"})
            for i in range(2)
        )
    )
    assert all(r.status_code == 201 for r in made), [r.text for r in made]
    first, second = (r.json()["id"] for r in made)
    for action in ("pause", "resume"):
        done = await clients.admin.post(f"/observers/{first}/{action}")
        assert done.status_code in (200, 202), done.text
    assert (await clients.admin.delete(f"/observers/{second}")).status_code == 202
    refused = await clients.read.post(f"/observers/{first}/pause")  # a read token may not
    assert refused.status_code == 403

    history = await _history(clients, first)
    assert history[0] == ("created", "ops")
    assert ("paused", "ops") in history
    assert ("resumed", "ops") in history
    assert all(actor in {"ops", None} for _, actor in history), history
    assert (await _history(clients, second))[0] == ("created", "ops")

    mine = (await clients.read.get("/views/actions", params={"by": "ops"})).json()
    assert [(a["event"], a["observer_name"]) for a in mine][:3] == [
        ("deleted", "who-1"),
        ("resumed", "who-0"),
        ("paused", "who-0"),
    ]
    assert {a["actor"] for a in mine} == {"ops"}
    assert {("created", "who-0"), ("created", "who-1")} <= {
        (a["event"], a["observer_name"]) for a in mine
    }
    assert (await clients.read.get("/views/actions", params={"by": "reader"})).json() == []
    everyone = (await clients.read.get("/views/actions", params={"limit": 2})).json()
    assert len(everyone) == 2
    assert everyone == mine[:2]
