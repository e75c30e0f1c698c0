"""A service's advert is another process's input (``orch_contracts.adverts``): written here straight
into ``services`` as any process holding the database credentials could, it never makes the
manager exit, fetch, block or show a secret; and a ``read`` token sees an observer's params
masked by its own kind's version, everything masked where no advert tells."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import asyncpg
import pytest

from orch_contracts.settings import asyncpg_dsn
from orch_manager.runtime import ManagerRuntime
from tests.conftest import Servers
from tests.integration.conftest import AuthApi, auth_api

SECRETS = ("cr3ds-value", "hooks.example/T0K3N")
PARAMS = {
    "endpoint": "https://vault.example",
    "creds": "cr3ds-value",
    "webhook": "https://hooks.example/T0K3N",
}


def advert(version: str, properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "description": "",
        "params_schema": {"type": "object", "properties": properties, **more},
        "secret_params": [],
        "restart_policy": {},
        "version": version,
    }


SECRET_STR = {"type": "string", "writeOnly": True, "format": "password"}
VAULT_V1 = advert("1", {"endpoint": {"type": "string"}, "creds": SECRET_STR, "webhook": SECRET_STR})
VAULT_V2 = advert("2", {"endpoint": {"type": "string"}, "webhook": {"type": "string"}})


@pytest.fixture
async def clients(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[AuthApi]:
    async with auth_api(servers, database_url, prefix, "tests.support.kinds") as a:
        yield a


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        yield c
    finally:
        await c.close()


def runtime(clients: AuthApi) -> ManagerRuntime:
    rt: ManagerRuntime = clients.app.state.orch
    return rt


async def join(
    conn: asyncpg.Connection,
    kinds: str | None,
    *,
    name: str | None = None,
    deleted: bool = False,
    age: float = 0.0,
) -> uuid.UUID:
    """A services row, as a process with the database credentials may write one: ``kinds`` is
    the JSON text of its advert (None: a release before adverts)."""
    sid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at, kinds, "
        "is_deleted, created_at) VALUES ($1, $2, 0, $3, now() + interval '1 hour', "
        "CAST($4 AS jsonb), $5, now() - make_interval(secs => $6))",
        sid,
        name or f"s-{sid}",
        secrets.randbits(63),
        kinds,
        deleted,
        age,
    )
    return sid


async def hold(conn: asyncpg.Connection, observer_id: str, service_id: uuid.UUID) -> None:
    """As a take by that service would leave the row."""
    await conn.execute(
        "UPDATE observers SET status = 'processing', service_id = $2, epoch = epoch + 1 "
        "WHERE id = $1",
        uuid.UUID(observer_id),
        service_id,
    )


async def timed(call: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    began = time.perf_counter()
    result = await call()
    return result, time.perf_counter() - began


# ------------------------------------------------------------------------------ the High
async def test_a_read_token_sees_the_secrets_of_the_version_its_observer_runs(
    clients: AuthApi, conn: asyncpg.Connection
) -> None:
    """s1 runs vault 1 (``creds`` and ``webhook`` secret); s2 joins later with vault 2, which
    has neither secret: the observer s1 runs, and one pinned to version 1, stay masked."""
    s1 = await join(conn, json.dumps({"vault": VAULT_V1}), age=60)
    body = {"kind": "vault", "params": PARAMS}
    running = await clients.admin.post("/observers", json={"name": "running", **body})
    pinned = await clients.admin.post("/observers", json={"name": "pinned", "version": "1", **body})
    assert running.status_code == pinned.status_code == 201, running.text
    await hold(conn, running.json()["id"], s1)
    await join(conn, json.dumps({"vault": VAULT_V2}))
    await runtime(clients).read_adverts()
    page = await clients.read.get("/observers", params={"kind": "vault"})
    assert page.status_code == 200
    for secret in SECRETS:
        assert secret not in page.text, f"{secret} shown to a read token: {page.text}"
    for created in (running, pinned):
        one = await clients.read.get(f"/observers/{created.json()['id']}")
        assert one.json()["params"]["creds"] == "***"
        assert one.json()["params"]["endpoint"] == PARAMS["endpoint"], "the rest is shown"
    admin = await clients.admin.get(f"/observers/{running.json()['id']}")
    assert admin.json()["params"] == PARAMS, "an admin sees them as they are"


async def test_params_no_advert_tells_about_are_masked_whole_for_a_read_token(
    clients: AuthApi, conn: asyncpg.Connection
) -> None:
    """A kind nobody advertised, held by a service of a release before adverts (mid-upgrade):
    the manager cannot know its secrets, so a read token sees every value masked."""
    old = await join(conn, None)
    oid = uuid.uuid4()
    await conn.execute(
        "INSERT INTO observers (id, name, kind, params, status, dispatch_id, service_id, epoch) "
        "VALUES ($1, 'old', 'mystery', CAST($2 AS jsonb), 'processing', gen_random_uuid(), "
        "$3, 1)",
        oid,
        json.dumps({"creds": "cr3ds-value", "n": 12345, "on": True, "tags": ["a-tag"]}),
        old,
    )
    await runtime(clients).read_adverts()
    one = await clients.read.get(f"/observers/{oid}")
    assert one.status_code == 200
    assert one.json()["params"] == {"creds": "***", "n": "***", "on": True, "tags": ["***"]}
    admin = await clients.admin.get(f"/observers/{oid}")
    assert admin.json()["params"]["creds"] == "cr3ds-value"


# ------------------------------------------------------------------ adverts as input
DEEP = "[" * 1500 + "]" * 1500


async def test_a_malformed_advert_is_left_out_and_never_stops_the_manager(
    clients: AuthApi, conn: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows whose ``kinds`` is not an object, or nests deeper than any reader should follow,
    live or deleted: the manager logs each, naming the service, and goes on."""
    caplog.set_level(logging.WARNING, logger="orch_manager.runtime")
    await join(conn, '"not an object"', deleted=True)
    await join(conn, "[1, 2]")
    await join(conn, DEEP)
    await join(conn, '{"abyss": ' + DEEP + "}", name="abyss-svc")
    await join(conn, json.dumps({"deep": json.loads("[" * 200 + "]" * 200)}), name="deep-svc")
    await join(conn, json.dumps({"vault": VAULT_V1}))
    rt = runtime(clients)
    began = time.monotonic()
    await rt.read_adverts()
    assert "vault" in rt.advertised, "the good advert beside them is read"
    assert "service deep-svc: its advert of kind 'deep' is left out" in caplog.text
    assert "service abyss-svc: its advert of kind 'abyss' is left out" in caplog.text
    for path in ("/kinds", "/services", "/pools", "/observers"):
        r = await clients.read.get(path)
        assert r.status_code == 200, (path, r.text)
    # The adverts' own loop (and the leader's, which read what services run) keep going.
    async with asyncio.timeout(15):
        while rt._adverts_read < began:  # noqa: ASYNC110 - the loop's own pace
            await asyncio.sleep(0.05)
    assert not rt.fatal.is_set(), rt.error


async def test_a_remote_or_file_ref_is_never_fetched(
    clients: AuthApi, conn: asyncpg.Connection
) -> None:
    """An advert whose schema refers outside itself is refused when read: nothing is fetched,
    no create of that kind reaches the schema, and the manager answers as fast as ever."""
    hits: list[bytes] = []

    async def holding(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hits.append(await reader.read(100))
        await asyncio.sleep(15)  # holds the reply, as the attacker's server did
        writer.close()

    server = await asyncio.start_server(holding, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for kind, ref in (
            ("remote", f"http://127.0.0.1:{port}/s.json"),
            ("local", "file:///etc/passwd"),
        ):
            schema = {"type": "object", "properties": {"x": {"$ref": ref}}}
            await join(conn, json.dumps({kind: {**advert("1", {}), "params_schema": schema}}))
            created, took = await timed(
                lambda kind=kind: clients.admin.post(  # type: ignore[misc]
                    "/observers", json={"name": kind, "kind": kind, "params": {"x": 1}}
                )
            )
            assert created.status_code == 422, created.text
            assert took < 2, f"the create took {took:.1f} s"
        health, took = await timed(lambda: clients.read.get("/healthz"))
        assert health.status_code == 200
        assert took < 1
        assert hits == [], "the manager fetched an advertised $ref"
    finally:
        server.close()


async def test_an_advertised_pattern_is_matched_in_linear_time(
    clients: AuthApi, conn: asyncpg.Connection
) -> None:
    """``^(a+)+$`` takes Python's ``re`` seconds for 27 characters, doubling with each more."""
    schema = {"type": "string", "pattern": "^(a+)+$"}
    await join(conn, json.dumps({"redos": advert("1", {"v": schema})}))
    await runtime(clients).read_adverts()
    body = {"name": "r", "kind": "redos", "params": {"v": "a" * 27 + "!"}}
    created, took = await timed(lambda: clients.admin.post("/observers", json=body))
    assert created.status_code == 422, created.text
    assert "v: fails 'pattern'" in created.text
    assert took < 0.5, f"the check took {took:.1f} s"
    ok = await clients.admin.post("/observers", json={**body, "params": {"v": "aaa"}})
    assert ok.status_code == 201, ok.text


def nested_unions(levels: int, branches: int, keyword: str) -> dict[str, Any]:
    """A schema of ``levels`` nested unions of ``branches`` objects each: a naive walk visits
    branches ** levels paths."""
    defs: dict[str, Any] = {f"L{levels}": {"type": "string"}}
    for i in reversed(range(levels)):
        defs[f"L{i}"] = {
            keyword: [
                {"type": "object", "properties": {"x": {"$ref": f"#/$defs/L{i + 1}"}, f"b{b}": {}}}
                for b in range(branches)
            ]
        }
    return {"$ref": "#/$defs/L0", "$defs": defs}


def nested_params(levels: int) -> dict[str, Any]:
    value: Any = "leaf"
    for _ in range(levels):
        value = {"x": value}
    return value  # type: ignore[no-any-return]


async def test_masking_and_checking_are_linear_in_the_schema_and_the_params(
    clients: AuthApi, conn: asyncpg.Connection
) -> None:
    """A union of 8 branches nested 8 deep: reading the observers as a read token, and checking
    params of ``oneOf`` branches (each tried), take milliseconds, not minutes."""
    for kind, keyword in (("unions", "anyOf"), ("exclusive", "oneOf")):
        schema = {**nested_unions(8, 8, keyword), "type": "object"}
        await join(conn, json.dumps({kind: {**advert("1", {}), "params_schema": schema}}))
    await runtime(clients).read_adverts()
    made = await clients.admin.post(
        "/observers", json={"name": "u", "kind": "unions", "params": nested_params(8)}
    )
    assert made.status_code == 201, made.text
    page, took = await timed(lambda: clients.read.get("/observers"))
    assert page.status_code == 200
    assert took < 1, f"GET /observers took {took:.1f} s for a read token"
    checked, took = await timed(
        lambda: clients.admin.post(
            "/observers", json={"name": "e", "kind": "exclusive", "params": nested_params(8)}
        )
    )
    assert checked.status_code in (201, 422), checked.text
    assert took < 1, f"the check took {took:.1f} s"


async def test_kinds_lists_an_advert_with_fields_of_another_release(
    clients: AuthApi, conn: asyncpg.Connection
) -> None:
    later = advert("3", {"x": {"type": "integer"}})
    later["restart_policy"] = {"max_restarts": 2, "a_field_of_a_later_release": True}
    later["a_key_of_a_later_release"] = {"any": 1}
    await join(conn, json.dumps({"later": later}))
    r = await clients.read.get("/kinds")
    assert r.status_code == 200, r.text
    (entry,) = [k for k in r.json() if k["name"] == "later"]
    assert entry["restart_policy"]["max_restarts"] == 2
    assert entry["versions"] == ["3"]
