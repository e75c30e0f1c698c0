"""Search by params: ``param=PATH=VALUE`` on ``GET /observers`` and the console's view takes the
observers whose params hold that value there, for an admin token; a read token, which sees
secret params masked, is refused (its searches would tell a secret one guess at a time). Real
PostgreSQL and RabbitMQ; the manager app in this process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.conftest import Servers
from tests.integration.conftest import AuthApi, auth_api


@pytest.fixture
async def clients(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[AuthApi]:
    async with auth_api(servers, database_url, prefix, "observer_service.kinds") as a:
        yield a


async def test_observers_are_found_by_a_value_of_their_params(clients: AuthApi) -> None:
    for name, interval in (("slow", 30), ("fast", 1.5), ("also-slow", 30)):
        made = await clients.admin.post(
            "/observers", json={"name": name, "kind": "ticker", "params": {"interval": interval}}
        )
        assert made.status_code == 201, made.text

    async def names(path: str, param: str) -> list[str]:
        got = await clients.admin.get(path, params={"param": param})
        assert got.status_code == 200, got.text
        return sorted(o["name"] for o in got.json()["items"])

    assert await names("/observers", "interval=30") == ["also-slow", "slow"]
    assert await names("/observers", "interval=1.5") == ["fast"]
    assert await names("/observers", 'interval="30"') == []  # JSON: the text "30" is no number
    view = await clients.admin.get("/views/observers", params={"param": "interval=30"})
    assert view.json()["total"] == 2
    assert sorted(o["name"] for o in view.json()["items"]) == ["also-slow", "slow"]
    assert await names("/views/observers", "nothing.here=1") == []

    refused = await clients.read.get("/observers", params={"param": "interval=30"})
    assert refused.status_code == 403
    assert "admin token" in refused.json()["detail"]
    for bad in ("interval", "=30", "a..b=1"):
        wrong = await clients.admin.get("/observers", params={"param": bad})
        assert wrong.status_code == 422, (bad, wrong.text)
        assert "PATH=VALUE" in wrong.json()["detail"]
