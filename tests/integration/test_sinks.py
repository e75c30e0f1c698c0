"""The fences of ``observer_service.sinks`` against the real stores: PostgreSQL, Redis, and an
HTTP service (uvicorn, on a port of its own) that mounts the middleware."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
import redis.asyncio as aioredis
import uvicorn

from contracts.errors import Fenced
from contracts.settings import asyncpg_dsn
from observer_service.egress import EgressPolicy
from observer_service.sinks import (
    FencingMiddleware,
    PostgresFence,
    RedisFence,
    fenced_client,
    idempotency_key,
)
from orch.cluster import free_port, wait_for

REDIS_URL = os.environ.get("ORCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@dataclass(frozen=True)
class Copy:
    observer_id: uuid.UUID
    epoch: int


async def test_postgres_refuses_an_older_epoch_inside_the_writers_transaction(
    database_url: str,
) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    other = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await conn.execute("CREATE TABLE prices (epoch int, n int)")
        fence = PostgresFence()
        await fence.create(conn)
        oid = uuid.uuid4()
        old, new = Copy(oid, 1), Copy(oid, 2)

        async def write(c: asyncpg.Connection, copy: Copy, n: int) -> None:
            async with c.transaction():
                await fence.check(c, copy)
                await c.execute("INSERT INTO prices VALUES ($1, $2)", copy.epoch, n)

        await write(conn, old, 1)
        await write(conn, old, 2)  # the same epoch again: fine
        await write(conn, new, 3)
        with pytest.raises(Fenced, match="epoch 1 is older than 2"):
            await write(conn, old, 4)
        # Two copies at once: the older holds the fence row; the newer waits, then wins; the
        # older, once the newer wrote, is refused.
        oid2 = uuid.uuid4()
        a, b = Copy(oid2, 5), Copy(oid2, 6)
        tx = conn.transaction()
        await tx.start()
        await fence.check(conn, a)
        await conn.execute("INSERT INTO prices VALUES (5, 10)")
        newer = asyncio.create_task(write(other, b, 11))
        await asyncio.sleep(0.2)
        assert not newer.done()  # waiting for the older one's transaction
        await tx.commit()
        await asyncio.wait_for(newer, 5)
        with pytest.raises(Fenced):
            await write(conn, a, 12)
        rows = [tuple(r) for r in await conn.fetch("SELECT epoch, n FROM prices")]
        assert (1, 4) not in rows
        assert (5, 12) not in rows
        assert rows[-2:] == [(5, 10), (6, 11)]
    finally:
        await conn.close()
        await other.close()


@contextlib.asynccontextmanager
async def redis_client() -> AsyncIterator[Any]:
    client = aioredis.from_url(REDIS_URL)
    try:
        await client.ping()
    except OSError as exc:  # the test command starts Redis: not running means a broken setup
        raise AssertionError(f"Redis is not running at {REDIS_URL}: {exc}") from exc
    try:
        yield client
    finally:
        await client.aclose()


async def test_redis_runs_the_command_only_for_the_newest_epoch() -> None:
    async with redis_client() as client:
        prefix = f"orch-test:{uuid.uuid4()}:"
        fence = RedisFence(client, prefix=prefix + "fence:")
        oid = uuid.uuid4()
        key = prefix + "price"
        try:
            assert await fence.execute(Copy(oid, 1), "SET", key, "100") == b"OK"
            assert await fence.execute(Copy(oid, 2), "SET", key, "101") == b"OK"
            with pytest.raises(Fenced, match="epoch 1 is older than 2"):
                await fence.execute(Copy(oid, 1), "SET", key, "99")
            assert await client.get(key) == b"101"
            assert await fence.execute(Copy(oid, 2), "INCR", prefix + "n") == 1
        finally:
            await client.delete(key, prefix + "n", f"{prefix}fence:{oid}")


async def test_an_http_receiver_refuses_a_stale_token_and_the_client_raises_fenced() -> None:
    received: list[tuple[str, str]] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope["headers"])
        received.append(
            (headers[b"orch-fencing-token"].decode(), headers[b"idempotency-key"].decode())
        )
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(FencingMiddleware(app), host="127.0.0.1", port=port, log_level="error")
    )
    serving = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: asyncio.sleep(0, result=server.started), timeout=10, what="uvicorn")
        policy = EgressPolicy.parse(f"127.0.0.1:{port}")
        oid = uuid.uuid4()
        url = f"http://127.0.0.1:{port}/write"
        async with fenced_client(Copy(oid, 2), policy) as new:
            r = await new.post(url, headers=idempotency_key(Copy(oid, 2), 7))
            assert r.status_code == 200
        async with fenced_client(Copy(oid, 1), policy) as old:
            with pytest.raises(Fenced, match="refused epoch 1 as stale"):
                await old.post(url, headers=idempotency_key(Copy(oid, 1), 8))
        assert received == [(f"{oid}:2", f"{oid}:7")]  # the stale one never reached the app
    finally:
        server.should_exit = True
        await serving
