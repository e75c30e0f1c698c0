"""A copy frozen past its lease with a write on the wire: the store refuses that write when it
arrives, after the next copy wrote. Judged from the store's own contents.

The service runs a ``fenced_writer`` whose store is reached through a proxy of the test's own.
The proxy holds the bytes of the connection open at the time (the copy's next write is sent,
not applied: on the wire), the service is frozen, another service takes the observer over and
writes (on a new connection, which flows), then the held bytes go on and the frozen service
wakes. No record of the old epoch may follow one of the new in the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
import redis.asyncio as aioredis
import uvicorn

from observer_service.sinks import FencingMiddleware
from orch.cluster import free_port
from orch_contracts.settings import asyncpg_dsn
from orch_verify.proxy import Proxy
from tests.integration.test_sinks import REDIS_URL
from tests.support.cluster import Cluster, wait_for

#: Every test here needs processes of its own (faults, or what one process holds).
pytestmark = pytest.mark.processes


class Store:
    """One store under test, reached through ``proxy``."""

    target: str
    allow: str = ""

    async def epochs(self) -> list[int]:
        """The epochs of the writes, in the order the store applied them."""
        raise NotImplementedError


@contextlib.asynccontextmanager
async def postgres(database_url: str, table: str) -> AsyncIterator[tuple[Proxy, Store]]:
    dsn = asyncpg_dsn(database_url)
    parts = urlsplit(dsn)
    proxy = await Proxy(parts.hostname or "127.0.0.1", parts.port or 5432).start()
    conn = await asyncpg.connect(dsn)

    class Pg(Store):
        target = dsn.replace(f"{parts.hostname}:{parts.port or 5432}", f"127.0.0.1:{proxy.port}")

        async def epochs(self) -> list[int]:
            try:
                return [
                    r["epoch"] for r in await conn.fetch(f"SELECT epoch FROM {table} ORDER BY id")
                ]
            except asyncpg.UndefinedTableError:
                return []

    try:
        yield proxy, Pg()
    finally:
        await conn.close()
        await proxy.close()


@contextlib.asynccontextmanager
async def redis(key: str) -> AsyncIterator[tuple[Proxy, Store]]:
    parts = urlsplit(REDIS_URL)
    proxy = await Proxy(parts.hostname or "127.0.0.1", parts.port or 6379).start()
    client = aioredis.from_url(REDIS_URL)

    class Rd(Store):
        target = f"redis://127.0.0.1:{proxy.port}{parts.path}"

        async def epochs(self) -> list[int]:
            entries: list[bytes] = await client.lrange(key, 0, -1)  # type: ignore[assignment]
            return [int(e.split(b":")[0]) for e in entries]

    try:
        yield proxy, Rd()
    finally:
        await client.delete(key, *[k async for k in client.scan_iter(f"{key}:fence:*")])
        await client.aclose()
        await proxy.close()


@contextlib.asynccontextmanager
async def http() -> AsyncIterator[tuple[Proxy, Store]]:
    applied: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        applied.append(int(json.loads(body)["epoch"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    port = free_port()
    # The held request's connection must outlive the freeze: with uvicorn's default keep-alive
    # (5 s) the server closed it meanwhile, the held bytes went nowhere, and the test passed
    # without the fence.
    config = uvicorn.Config(
        FencingMiddleware(app),
        host="127.0.0.1",
        port=port,
        log_level="error",
        timeout_keep_alive=600,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    await wait_for(lambda: asyncio.sleep(0, result=server.started), timeout=10, what="uvicorn")
    proxy = await Proxy("127.0.0.1", port).start()

    class Http(Store):
        target = f"http://127.0.0.1:{proxy.port}/write"
        allow = f"127.0.0.1:{proxy.port}"

        async def epochs(self) -> list[int]:
            return list(applied)

    try:
        yield proxy, Http()
    finally:
        await proxy.close()
        server.should_exit = True
        await serving


@pytest.mark.parametrize("sink", ["postgres", "redis", "http"])
async def test_a_write_on_the_wire_of_a_frozen_copy_is_refused_by_the_store(
    cluster: Cluster, database_url: str, sink: str
) -> None:
    name = f"sink_{uuid.uuid4().hex[:8]}"
    stores = {
        "postgres": lambda: postgres(database_url, name),
        "redis": lambda: redis(name),
        "http": http,
    }
    async with stores[sink]() as (proxy, store):
        await cluster.start_manager()
        a = await cluster.start_service("a", worker_count=5)
        body = await cluster.create(
            "writer",
            "fenced_writer",
            sink=sink,
            target=store.target,
            key=name,
            allow=store.allow,
            interval=0.02,
        )
        oid = uuid.UUID(body["id"])

        async def written(epoch: int, n: int = 5) -> bool:
            return sum(1 for e in await store.epochs() if e == epoch) >= n

        await wait_for(lambda: written(1), timeout=20, what="the first copy writing")
        b = await cluster.start_service("b", worker_count=5)
        b_id = await cluster.service_id(b)
        proxy.hold_open()  # the first copy's next write is sent and held
        await wait_for(lambda: asyncio.sleep(0, result=proxy.held > 0), timeout=10, what="held")

        async def taken_over() -> bool:
            row = await cluster.observer(oid)
            return bool(row["service_id"] == b_id and row["epoch"] == 2)

        async with cluster.frozen(a, before_waking=proxy.release):
            await wait_for(taken_over, timeout=cluster.lease_ttl + 10, what="taken over")
            # The second copy writes before the held write goes on, unless it waits for the
            # first one's transaction (PostgreSQL: the fence row's lock), whose end is held.
            with contextlib.suppress(TimeoutError):
                await wait_for(lambda: written(2, 3), timeout=3, what="the second copy writing")
        await wait_for(lambda: written(2, 20), timeout=20, what="the second copy writing")
        # The first copy woke and its held write arrived meanwhile; a few more of the second's.
        await wait_for(lambda: written(2, 40), timeout=20, what="more of the second copy")
        epochs = await store.epochs()
        first_new = epochs.index(2)
        assert 1 not in epochs[first_new:], (
            f"a write of epoch 1 was applied after epoch 2 wrote: {epochs[first_new - 3 :]}"
        )
        assert (await cluster.observer(oid))["epoch"] == 2
