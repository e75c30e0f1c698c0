"""The ``websocket`` kind against a real websocket server the test starts (the ``websockets``
library's own), through restarts, dropped connections, a server that stops answering, and
oversized and binary frames.

The orchestrator's context is a stand-in here (``Ctx``: ``emit`` appends to a list): what is
under test is the kind's conduct toward the server. Its records' path through the orchestrator
is tested in tests/acceptance/test_outputs.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from observer_service.kinds.websocket import WebsocketParams, websocket
from observer_service.outputs import checkpoint_json
from orch.cluster import free_port, wait_for
from orch_contracts.errors import InvalidParams
from orch_contracts.kinds import load_kinds
from orch_contracts.outputs import check_record
from orch_verify.proxy import Proxy


class Ctx:
    """What the kind uses of ``ObserverContext``."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.observer_id = uuid.uuid4()
        self.epoch = 1
        self.params = WebsocketParams.model_validate(params)
        self.records: list[dict[str, Any]] = []
        self.logger = logging.LoggerAdapter(logging.getLogger("test.websocket"), {})
        self.stopping = asyncio.Event()

    async def emit(self, record: Any) -> None:
        check_record(checkpoint_json(record))  # what the orchestrator refuses, as it does
        self.records.append(record)

    def ensure_alive(self) -> None:
        pass

    def on_abandon(self, release: Any) -> Any:
        return lambda: None

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def data(self) -> list[Any]:
        return [r["data"] for r in self.records if "data" in r]


class Server:
    """A websocket server on a port of its own: it records what clients send and sends what
    the test pushes to every client connected."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.received: list[str] = []
        self.connections: list[ServerConnection] = []
        self.handshakes: list[dict[str, str]] = []
        self._server: Any = None

    async def _handler(self, ws: ServerConnection) -> None:
        self.connections.append(ws)
        self.handshakes.append(dict(ws.request.headers) if ws.request else {})
        with contextlib.suppress(Exception):
            async for message in ws:
                self.received.append(str(message))

    async def start(self) -> None:
        self._server = await serve(self._handler, "127.0.0.1", self.port, max_size=None)

    async def stop(self) -> None:
        self._server.close()
        await self._server.wait_closed()
        self.connections.clear()

    async def push(self, message: str | bytes) -> None:
        for ws in list(self.connections):
            with contextlib.suppress(Exception):
                await ws.send(message)

    def live(self) -> int:
        return sum(1 for ws in self.connections if ws.state.name == "OPEN")


@contextlib.asynccontextmanager
async def running(ctx: Ctx) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(websocket(ctx))  # type: ignore[arg-type]  # a stand-in
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def allow(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """The egress policy lets the kind reach this local port."""
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", f"127.0.0.1:{port}")


def _params(port: int, **more: Any) -> dict[str, Any]:
    return {
        "url": f"ws://127.0.0.1:{port}/stream",
        "subscribe": [{"op": "subscribe", "channel": "btc"}, "hello"],
        "reconnect_base": 0.05,
        "reconnect_max": 0.2,
        **more,
    }


async def _until(check: Any, what: str, timeout: float = 10) -> None:
    await wait_for(lambda: asyncio.sleep(0, result=check()), timeout=timeout, what=what)


async def test_it_subscribes_emits_text_and_binary_and_sends_its_secret_headers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    allow(monkeypatch, port)
    server = Server(port)
    await server.start()
    ctx = Ctx(_params(port, headers={"Authorization": "Bearer s3cret"}))
    try:
        async with running(ctx):
            await _until(lambda: len(server.received) == 2, "the subscribe frames")
            assert server.received == ['{"op": "subscribe", "channel": "btc"}', "hello"]
            assert server.handshakes[0]["authorization"] == "Bearer s3cret"
            await server.push("tick 1")
            await server.push(b"\x00\x01")
            await _until(lambda: len(ctx.records) == 2, "two records")
        assert ctx.records[0]["data"] == "tick 1"
        assert ctx.records[1] == {
            "received_at": ctx.records[1]["received_at"],
            "data": "AAE=",
            "binary": True,
        }
        assert ctx.records[0]["received_at"] <= ctx.records[1]["received_at"]
        assert "s3cret" not in repr(ctx.params)  # a secret header prints masked
    finally:
        await server.stop()


async def test_it_connects_and_subscribes_again_after_a_restart_and_a_dropped_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    allow(monkeypatch, port)
    server = Server(port)
    await server.start()
    ctx = Ctx(_params(port))
    try:
        async with running(ctx):
            await _until(lambda: len(server.received) == 2, "subscribed")
            await server.stop()  # a server restart
            await server.start()
            await _until(lambda: len(server.received) == 4, "subscribed again after a restart")
            for ws in list(server.connections):  # the server drops the connection
                await ws.close()
            await _until(lambda: len(server.received) == 6, "subscribed again after a drop")
            await server.push("after")
            await _until(lambda: "after" in ctx.data(), "a message after all that")
            assert server.live() == 1  # one subscription, never two
    finally:
        await server.stop()


async def test_a_server_that_stops_answering_is_left_and_connected_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    server = Server(port)
    await server.start()
    proxy = await Proxy("127.0.0.1", port).start()
    allow(monkeypatch, proxy.port)
    ctx = Ctx(_params(proxy.port, ping_interval=0.5, ping_timeout=0.5))
    try:
        async with running(ctx):
            await _until(lambda: len(server.received) == 2, "subscribed")
            proxy.hold_open()  # nothing gets through on that connection any more: pings too
            await _until(lambda: len(server.received) == 4, "subscribed on a new connection")
            proxy.release()
            await server.push("fresh")
            await _until(lambda: "fresh" in ctx.data(), "a message on the new connection")
    finally:
        await proxy.close()
        await server.stop()


async def test_an_oversized_frame_closes_the_connection_and_the_next_ones_arrive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = free_port()
    allow(monkeypatch, port)
    server = Server(port)
    await server.start()
    ctx = Ctx(_params(port, max_size=1024))
    try:
        async with running(ctx):
            await _until(lambda: len(server.received) == 2, "subscribed")
            await server.push("x" * 5000)
            await _until(lambda: len(server.received) == 4, "connected again after the frame")
            await server.push("small")
            await _until(lambda: "small" in ctx.data(), "the next message")
        assert all(len(d) <= 1024 for d in ctx.data())
    finally:
        await server.stop()


def test_a_url_the_egress_policy_refuses_is_a_4xx_at_create_without_the_url() -> None:
    spec = load_kinds()["websocket"]
    assert spec.commit_every == 0.005
    with pytest.raises(InvalidParams) as info:
        spec.validate_params({"url": "ws://10.0.0.5:9000/feed?token=hunter2"})
    assert "egress" in str(info.value)
    assert "hunter2" not in str(info.value)
    with pytest.raises(InvalidParams, match="ws://host"):
        spec.validate_params({"url": "http://example.com/"})


async def test_a_frame_under_max_size_whose_record_emit_refuses_never_fails_the_observer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An 800 KiB binary frame is under the default ``max_size`` (1 MiB) but over 1 MiB once
    base64-encoded: the kind's frame limit is what ``emit`` carries, so the connection closes
    and opens again (the observer goes on); a text frame that only grows past the limit once
    JSON-escaped is left out with a record saying so."""
    port = free_port()
    allow(monkeypatch, port)
    server = Server(port)
    await server.start()
    ctx = Ctx(_params(port))
    try:
        async with running(ctx) as task:
            await _until(lambda: len(server.received) == 2, "subscribed")
            await server.push(b"\x00" * (800 << 10))
            await _until(lambda: len(server.received) == 4, "connected again after the frame")
            await server.push("\x01" * (300 << 10))
            await _until(lambda: any(r.get("left_out") for r in ctx.records), "left out")
            await server.push("small")
            await _until(lambda: "small" in ctx.data(), "the next message")
            assert not task.done(), task
        (left,) = [r for r in ctx.records if r.get("left_out")]
        assert left["bytes"] == 300 << 10
    finally:
        await server.stop()
