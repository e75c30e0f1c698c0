"""Numbers in params: every one finite and an integer within ±2^53, else a 422 naming the field
(never a 500, never a stored row); and rows an earlier release stored with such numbers stay
listable, readable and deletable."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from orch_contracts.settings import asyncpg_dsn
from tests.conftest import Servers
from tests.integration.conftest import AuthApi, auth_api

HUGE = "1" + "0" * 400


@pytest.fixture
async def clients(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[AuthApi]:
    async with auth_api(servers, database_url, prefix, "") as a:
        yield a


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        yield c
    finally:
        await c.close()


def websocket(subscribe: str) -> bytes:
    """A create's body as raw JSON (a number no encoder of ours would write)."""
    return (
        '{"name": "ws", "kind": "websocket", "params": {"url": "wss://example.com/feed", '
        f'"subscribe": [{{"op": "sub", "n": {subscribe}}}]}}}}'
    ).encode()


@pytest.mark.parametrize(
    "number", [HUGE, "-" + HUGE, "9007199254740993", "NaN", "Infinity", "1e400"]
)
async def test_a_number_out_of_bounds_is_a_422_naming_the_field_and_stores_nothing(
    clients: AuthApi, conn: asyncpg.Connection, number: str
) -> None:
    for path in ("/observers", "/observers/batch"):
        body = websocket(number)
        if path.endswith("batch"):
            body = b'{"observers": [' + body + b"]}"
        r = await clients.admin.post(
            path, content=body, headers={"Content-Type": "application/json"}
        )
        assert r.status_code in (200, 422), r.text
        assert "params.subscribe[0].n" in r.text, r.text
    assert await conn.fetchval("SELECT count(*) FROM observers") == 0


async def test_a_number_within_bounds_is_taken(clients: AuthApi) -> None:
    r = await clients.admin.post(
        "/observers",
        content=websocket("9007199254740992"),
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 201, r.text


async def test_a_row_stored_earlier_with_such_a_number_stays_listable_and_deletable(
    clients: AuthApi, conn: asyncpg.Connection
) -> None:
    oid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO observers (id, name, kind, params, checkpoint, status, dispatch_id) "
        "VALUES ($1, 'old', 'websocket', CAST($2 AS jsonb), CAST($3 AS jsonb), 'created', "
        "gen_random_uuid())",
        oid,
        f'{{"url": "wss://example.com/", "subscribe": [{{"n": {HUGE}}}]}}',
        f'{{"seen": {HUGE}, "at": -{HUGE}.5}}',
    )
    for client in (clients.read, clients.admin):
        page = await client.get("/observers")
        assert page.status_code == 200, page.text
        assert page.json()["items"][0]["id"] == str(oid)
        one = await client.get(f"/observers/{oid}")
        assert one.status_code == 200, one.text
        view = await client.get("/views/observers")
        assert view.status_code == 200, view.text
    shown = (await clients.admin.get(f"/observers/{oid}")).json()
    assert shown["params"]["subscribe"] == [{"n": HUGE}], "its digits, as a string"
    gone = await clients.admin.delete(f"/observers/{oid}")
    assert gone.status_code == 202, gone.text
    assert gone.json()["status"] == "deleted"
