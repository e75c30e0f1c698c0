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

from observer_service.egress import EgressPolicy
from observer_service.sinks import (
    FencingMiddleware,
    PostgresFence,
    RedisFence,
    fenced_client,
    idempotency_key,
)
from orch.cluster import free_port, wait_for
from orch_contracts.errors import Fenced
from orch_contracts.settings import asyncpg_dsn

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


@contextlib.asynccontextmanager
async def receiver(middleware: Any) -> AsyncIterator[int]:
    """``middleware`` served by uvicorn on a port of its own."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            middleware, host="127.0.0.1", port=port, log_level="error", timeout_keep_alive=60
        )
    )
    serving = asyncio.create_task(server.serve())
    try:
        await wait_for(lambda: asyncio.sleep(0, result=server.started), timeout=10, what="uvicorn")
        yield port
    finally:
        server.should_exit = True
        await serving


def applying(applied: list[int]) -> Any:
    """A receiver's app: reads the body, then applies the epoch it names."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        applied.append(int(body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


async def post(port: int, token: str, body: bytes, *, stall: asyncio.Event | None = None) -> int:
    """A raw HTTP/1.1 POST carrying ``token``; with ``stall``, the head and half the body are
    sent, and the rest only once ``stall`` is set (a copy frozen with a write on the wire)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /write HTTP/1.1\r\nHost: receiver\r\nOrch-Fencing-Token: {token}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    half = len(body) // 2
    writer.write(head + body[:half])
    await writer.drain()
    if stall is not None:
        await stall.wait()
    writer.write(body[half:])
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    writer.close()
    return status


async def test_an_http_write_is_fenced_at_the_write_not_at_its_headers() -> None:
    """Epoch 1 sends its headers and stalls; epoch 2 writes; then epoch 1's body arrives: it is
    refused, never applied last."""
    applied: list[int] = []
    heads: dict[str, asyncio.Event] = {}
    fenced = FencingMiddleware(applying(applied))

    async def seen_heads(scope: dict[str, Any], receive: Any, send: Any) -> None:
        """In front of the middleware: tells when a request's head is in."""
        token = dict(scope.get("headers") or []).get(b"orch-fencing-token", b"").decode()
        heads.setdefault(token, asyncio.Event()).set()
        await fenced(scope, receive, send)

    async with receiver(seen_heads) as port:
        oid = uuid.uuid4()
        stall = asyncio.Event()
        old = asyncio.create_task(post(port, f"{oid}:1", b"0001", stall=stall))
        async with asyncio.timeout(5):
            await heads.setdefault(f"{oid}:1", asyncio.Event()).wait()
        assert await post(port, f"{oid}:2", b"0002") == 200
        stall.set()
        assert await old == 409
        assert applied == [2], f"applied in this order: {applied}"


@pytest.mark.parametrize(
    "form", ["upper", "braces", "urn"], ids=["upper case", "{uuid}", "urn:uuid:"]
)
async def test_an_http_fence_keys_on_the_canonical_observer_id(form: str) -> None:
    applied: list[int] = []
    async with receiver(FencingMiddleware(applying(applied))) as port:
        oid = uuid.uuid4()
        assert await post(port, f"{oid}:2", b"2") == 200
        other = {"upper": str(oid).upper(), "braces": f"{{{oid}}}", "urn": oid.urn}[form]
        assert await post(port, f"{other}:1", b"1") == 409
        assert await post(port, f"{oid}:+3", b"3") == 400, "an epoch is plain digits"
        assert applied == [2]


async def test_a_shared_epoch_store_compares_and_sets_atomically() -> None:
    """Two replicas sharing a Redis store advance one observer from many concurrent writes:
    the fence ends at the newest epoch (never lowered), and no two writes were admitted on the
    same sight of it (a get then a set admits both)."""
    from observer_service.sinks import RedisEpochs

    async with redis_client() as one, redis_client() as two:
        prefix = f"orch-test:{uuid.uuid4()}:"
        replicas = [RedisEpochs(one, prefix), RedisEpochs(two, prefix)]
        oid = str(uuid.uuid4())
        epochs = [e for pair in zip(range(1, 101), range(200, 100, -1), strict=True) for e in pair]
        seen = await asyncio.gather(*(replicas[e % 2].advance(oid, e) for e in epochs))
        try:
            assert int(await one.get(prefix + oid)) == 200, "never lowered"
            admitted = [s for e, s in zip(epochs, seen, strict=True) if s is None or e > s]
            assert len(admitted) == len(set(admitted)), "two writes admitted on one sight"
        finally:
            await one.delete(prefix + oid)
