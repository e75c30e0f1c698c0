"""Secret params of any shape (a list of secrets, a dict of them, a secret number, a nested
model) never reach a ``read`` token: not in params, not quoted in an error or its traceback;
and a checkpoint is masked for it as errors are (URL passwords, secret query values, the
observer's secret values)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel, ConfigDict, Secret, SecretStr

from orch_contracts.kinds import observer_kind
from orch_contracts.settings import asyncpg_dsn
from tests.conftest import Servers
from tests.integration.conftest import AuthApi, auth_api


class Login(BaseModel):
    user: str
    password: SecretStr


class ShapesParams(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    keys: list[SecretStr] = []
    headers: dict[str, SecretStr] = {}
    pin: Secret[int] | None = None
    logins: list[Login] = []
    label: str = ""


@observer_kind("test_shapes", params=ShapesParams)
async def shapes_kind(ctx: Any) -> None:  # never run here: the manager only validates
    """A kind with secrets of every shape (for these tests)."""


PARAMS = {
    "keys": ["K3y-one-value", "K3y-two-value"],
    "headers": {"Authorization": "Bearer-H34der-value"},
    "pin": 98765,
    "logins": [{"user": "bob", "password": "L0gin-pw-value"}],
    "label": "shown",
}
SECRETS = ("K3y-one-value", "K3y-two-value", "Bearer-H34der-value", "98765", "L0gin-pw-value")


@pytest.fixture
async def clients(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[AuthApi]:
    async with auth_api(servers, database_url, prefix, __name__) as a:
        yield a


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        yield c
    finally:
        await c.close()


async def test_secrets_of_any_shape_are_masked_in_params_errors_and_checkpoints(
    clients: AuthApi, conn: asyncpg.Connection
) -> None:
    made = await clients.admin.post(
        "/observers", json={"name": "s", "kind": "test_shapes", "params": PARAMS}
    )
    assert made.status_code == 201, made.text
    oid = uuid.UUID(made.json()["id"])
    # An error quoting every secret, as a service of an earlier release wrote it, and a
    # checkpoint holding a URL's password and a secret query value.
    quoted = f"ValueError: refused {PARAMS!r}"
    checkpoint = {
        "next": "https://bob:Ch3ck-pw@example.com/feed?api_key=Ch3ck-key&page=2",
        "token": "Ch3ck-token",
        "seen": ["K3y-one-value"],
        "count": 3,
    }
    await conn.execute(
        "UPDATE observers SET last_error = $2, checkpoint = CAST($3 AS jsonb) WHERE id = $1",
        oid,
        quoted + "\nTraceback (most recent call last):\n  " + quoted,
        json.dumps(checkpoint),
    )
    for path in (f"/observers/{oid}", "/observers", "/views/observers", f"/observers/{oid}/events"):
        r = await clients.read.get(path)
        assert r.status_code == 200, r.text
        for secret in (*SECRETS, "Ch3ck-pw", "Ch3ck-key", "Ch3ck-token"):
            assert secret not in r.text, f"{secret} shown by {path}: {r.text}"
    one = (await clients.read.get(f"/observers/{oid}")).json()
    assert one["params"]["label"] == "shown"
    assert one["checkpoint"]["count"] == 3, "what is no secret is shown"
    assert one["checkpoint"]["next"] == "https://***@example.com/feed?api_key=***&page=2"
    admin = (await clients.admin.get(f"/observers/{oid}")).json()
    assert admin["checkpoint"] == checkpoint, "an admin sees it as it is"
