"""The egress policy through real processes: an http_poll observer aimed at the database's port
(directly, or by a redirect) is refused by the service and never connects to it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest

from orch_contracts.errors import split_error
from orch_verify.proxy import Proxy
from tests.support.cluster import Cluster, wait_for

#: Every test here needs processes of its own (faults, or what one process holds).
pytestmark = pytest.mark.processes

REFUSED = "refused by the egress policy"
SECRET = "K-s3cret"


class CountingProxy(Proxy):
    """The database's port, as seen through a proxy that counts who connects."""

    accepted = 0

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await super()._accept(reader, writer)


@pytest.fixture
async def db_port(cluster: Cluster) -> AsyncIterator[CountingProxy]:
    parts = urlsplit(cluster.database_url)
    proxy = CountingProxy(parts.hostname or "127.0.0.1", parts.port or 5432)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()


async def _last_error(cluster: Cluster, oid: str) -> str:
    async def refused() -> str | None:
        error = (await cluster.observer(oid))["last_error"]
        return error if error and REFUSED in error else None

    error = await wait_for(refused, timeout=20, what="refused by the egress policy")
    assert isinstance(error, str)
    return error


async def test_an_observer_aimed_at_the_database_is_refused_and_never_connects(
    cluster: Cluster, db_port: CountingProxy
) -> None:
    # The manager validates with a policy that lets it through (a manager configured apart, or
    # an observer created before the policy): the service's own check is what stops it.
    await cluster.start_manager(http_poll_allow=f"127.0.0.1:{db_port.port}")
    svc = await cluster.start_service("a", worker_count=2)
    async with cluster.api() as c:
        refused = await c.post(
            "/observers",
            json={"name": "pg", "kind": "http_poll", "params": {"url": "http://127.0.0.1:1/"}},
        )
    assert refused.status_code == 422, refused.text
    assert REFUSED in refused.text
    assert "ORCH_HTTP_POLL_ALLOW" in refused.text  # what opens it

    body = await cluster.create(
        "db", "http_poll", url=f"http://127.0.0.1:{db_port.port}/?api_key={SECRET}", interval=0.2
    )
    error = await _last_error(cluster, body["id"])
    await cluster.wait_status(body["id"], "failed", timeout=10)
    assert f"127.0.0.1:{db_port.port}" in error
    assert SECRET not in error
    assert db_port.accepted == 0
    assert SECRET not in svc.tail(10_000)


async def test_a_redirect_to_the_database_is_refused_and_never_connects(
    cluster: Cluster, db_port: CountingProxy
) -> None:
    async def redirect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            f"HTTP/1.1 302 Found\r\nLocation: http://2130706433:{db_port.port}/?token={SECRET}"
            "\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        writer.close()

    site = await asyncio.start_server(redirect, "127.0.0.1", 0)
    port = site.sockets[0].getsockname()[1]
    try:
        allow = f"127.0.0.1:{port}"
        await cluster.start_manager(http_poll_allow=allow)
        svc = await cluster.start_service("a", worker_count=2, http_poll_allow=allow)
        body = await cluster.create(
            "hop", "http_poll", url=f"http://127.0.0.1:{port}/?api_key={SECRET}", interval=0.2
        )
        error = await _last_error(cluster, body["id"])
        # Its line (the traceback follows it, and quotes no secret either).
        assert split_error(error)[0] == f"EgressRefused: {REFUSED}: 2130706433:{db_port.port}"
        assert SECRET not in error
        assert (await cluster.observer(body["id"]))["status"] == "processing"  # restarting
        assert db_port.accepted == 0
        assert SECRET not in svc.tail(10_000)
    finally:
        site.close()
