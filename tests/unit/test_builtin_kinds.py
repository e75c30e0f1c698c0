"""The built-in kinds, run with the kit kind authors get (``orch.testing``): on the test's
clock, fenced, cut off from their lease and stopped, without any server."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from orch.testing import KindRun, VirtualClock, run_kind
from orch_contracts.errors import Fenced, LeaseLost
from orch_contracts.kinds import RestartPolicy, observer_kind
from orch_contracts.outputs import MAX_RECORD_BYTES, RecordTooLarge

KindRunner = Callable[..., contextlib.AbstractAsyncContextManager[KindRun]]


async def test_ticker_checkpoints_each_tick_on_the_tests_clock(kind_run: KindRunner) -> None:
    async with kind_run("ticker", {"interval": 5}) as run:
        assert run.checkpoints == [{"count": 1}]  # at once, then every 5 s
        await run.advance(4.9)
        assert run.checkpoints == [{"count": 1}]
        await run.advance(0.1)
        await run.advance(10)
        assert run.checkpoints == [{"count": c} for c in (1, 2, 3, 4)]
        assert not run.stopped


async def test_ticker_resumes_from_its_checkpoint() -> None:
    async with run_kind("ticker", {"interval": 1}, checkpoint={"count": 41}) as run:
        assert run.checkpoints == [{"count": 42}]


async def test_ticker_stops_at_a_fence_and_writes_nothing_after_it(kind_run: KindRunner) -> None:
    async with kind_run("ticker", {"interval": 1}) as run:
        await run.advance(2)
        run.fence()
        await run.advance(1)
        assert run.stopped
        assert isinstance(run.error, Fenced)
        assert run.writes_after_fence == ["checkpoint"]  # refused, and the last it tried
        assert run.checkpoints == [{"count": c} for c in (1, 2, 3)]
        await run.advance(10)
        assert run.writes_after_fence == ["checkpoint"]


async def test_ticker_abandoned_on_a_lost_lease_runs_no_more(kind_run: KindRunner) -> None:
    async with kind_run("ticker", {"interval": 1}) as run:
        await run.lose_lease()
        await run.advance(5)
        assert run.stopped
        assert isinstance(run.error, LeaseLost)
        assert run.checkpoints == [{"count": 1}]


async def test_ticker_stops_in_time_when_asked(kind_run: KindRunner) -> None:
    async with kind_run("ticker", {"interval": 3600}) as run:
        took = await run.stop(timeout=1)
        assert took < 1
        assert run.stopped
        assert run.error is None  # a stop is no error


async def test_the_kit_refuses_params_the_kind_refuses() -> None:
    from orch_contracts.errors import InvalidParams

    with pytest.raises(InvalidParams):
        async with run_kind("ticker", {"interval": 0}):
            pass


async def test_a_kind_that_ignores_a_stop_is_caught(virtual_clock: VirtualClock) -> None:
    from orch_contracts.kinds import KindSpec

    async def stubborn(ctx: Any) -> None:
        try:
            await ctx.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(2)  # cleans up for longer than a stop may take

    spec = KindSpec("stubborn", stubborn)
    async with run_kind(spec, clock=virtual_clock) as run:
        with pytest.raises(TimeoutError, match="did not stop"):
            await run.stop(timeout=0.2)


def test_the_readmes_kit_example_runs_as_written() -> None:
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("### Testing a kind", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ticker passed\n"
    assert done.stderr == "", "nothing more: no 'Task exception was never retrieved'"


# ------------------------------------------------------------------------------ http_poll
class Page:
    """A local HTTP server whose one page the test changes."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.hits = 0
        self.url = ""

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        self.hits += 1
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(self.body)}\r\nConnection: close\r\n\r\n"
        writer.write(head.encode() + self.body)
        await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def serving(body: bytes) -> AsyncIterator[Page]:
    page = Page(body)
    server = await asyncio.start_server(page.answer, "127.0.0.1", 0)
    page.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/price"
    async with server:
        yield page


def _digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


async def test_http_poll_checkpoints_only_what_changed(
    kind_run: KindRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "127.0.0.1:*")
    async with (
        serving(b"one") as page,
        kind_run("http_poll", {"url": page.url, "interval": 10}) as run,
    ):
        await run.until(lambda: run.clock.sleeping)  # polled once, waits for its next turn
        assert [(c["status"], c["hash"]) for c in run.checkpoints] == [(200, _digest(b"one"))]
        await run.advance(10)
        await run.until(lambda: page.hits == 2 and run.clock.sleeping)
        assert len(run.checkpoints) == 1  # the same page: nothing to write
        page.body = b"two"
        await run.advance(10)
        await run.until(lambda: run.clock.sleeping)
        assert [c["hash"] for c in run.checkpoints] == [_digest(b"one"), _digest(b"two")]
        # Another copy took over: the change it sees next is refused, and it stops.
        page.body = b"three"
        run.fence()
        await run.advance(10)
        await run.until(lambda: run.stopped)
        assert isinstance(run.error, Fenced)
        assert run.writes_after_fence == ["checkpoint"]
        assert len(run.checkpoints) == 2


async def test_http_poll_stops_in_time_between_polls(
    kind_run: KindRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "127.0.0.1:*")
    async with serving(b"x") as page, kind_run("http_poll", {"url": page.url}) as run:
        await run.until(lambda: run.clock.sleeping)
        assert await run.stop(timeout=1) < 1
        assert run.error is None


async def test_http_poll_refuses_a_host_the_egress_policy_does_not_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from orch_contracts.errors import InvalidParams

    monkeypatch.delenv("ORCH_HTTP_POLL_ALLOW", raising=False)
    with pytest.raises(InvalidParams, match="its host or its port") as refused:
        async with run_kind("http_poll", {"url": "http://127.0.0.1:8080/"}):
            pass
    assert "ORCH_HTTP_POLL_ALLOW" in str(refused.value), "says what would open it"
    assert "127.0.0.1" not in str(refused.value), "a client's input is not echoed"
    with pytest.raises(InvalidParams, match="ORCH_HTTP_POLL_ALLOW"):
        async with run_kind("websocket", {"url": "ws://127.0.0.1:8080/"}):
            pass


# ------------------------------------------------------------------------------ websocket
class Feed:
    """A local websocket server: each connection gets its subscribe frame read, then the
    test's messages."""

    def __init__(self) -> None:
        self.subscribed: list[str] = []
        self.connections: list[Any] = []
        self.closed = 0

    async def handler(self, ws: Any) -> None:
        self.subscribed.append(await ws.recv())
        self.connections.append(ws)
        await ws.wait_closed()
        self.closed += 1


@contextlib.asynccontextmanager
async def feed() -> AsyncIterator[tuple[Feed, str]]:
    from websockets.asyncio.server import serve

    f = Feed()
    async with serve(f.handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f, f"ws://127.0.0.1:{port}/stream"


async def test_websocket_emits_each_message_and_subscribes_again_after_a_drop(
    kind_run: KindRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "127.0.0.1:*")
    async with (
        feed() as (f, url),
        kind_run(
            "websocket", {"url": url, "subscribe": [{"op": "sub"}], "reconnect_base": 1}
        ) as run,
    ):
        await run.until(lambda: len(f.connections) == 1)
        await f.connections[0].send("m1")
        await run.until(lambda: len(run.outputs) == 1)
        await f.connections[0].close()  # the server drops it: it connects again after a pause
        await run.until(lambda: run.clock.sleeping)
        assert len(f.connections) == 1
        await run.advance(2)
        await run.until(lambda: len(f.connections) == 2)
        await f.connections[1].send(b"\x00m2")
        await run.until(lambda: len(run.outputs) == 2)
        assert f.subscribed == ['{"op": "sub"}'] * 2
        assert run.outputs[0]["data"] == "m1"
        assert run.outputs[1] == {
            "received_at": run.outputs[1]["received_at"],
            "data": "AG0y",
            "binary": True,
        }
        assert run.staged == []  # commit_every: committed on their own


async def test_websocket_abandoned_on_a_lost_lease_closes_its_subscription(
    kind_run: KindRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCH_HTTP_POLL_ALLOW", "127.0.0.1:*")
    async with feed() as (f, url), kind_run("websocket", {"url": url, "subscribe": ["all"]}) as run:
        await run.until(lambda: len(f.connections) == 1)
        await f.connections[0].send("m1")
        await run.until(lambda: len(run.outputs) == 1)
        await run.lose_lease()
        await f.connections[0].send("m2")  # it wakes the copy: abandoned, not run
        await run.until(lambda: f.closed == 1)  # the socket was aborted (ctx.on_abandon)
        await run.until(lambda: run.stopped)
        assert isinstance(run.error, LeaseLost)
        assert [o["data"] for o in run.outputs] == ["m1"]
        assert run.writes_after_fence == []


@observer_kind("test_oversized_emitter", restart=RestartPolicy(max_restarts=0))
async def _oversized(ctx: Any) -> None:
    """Emits one record over the service's limit."""
    await ctx.emit({"data": "x" * MAX_RECORD_BYTES})


async def test_the_kit_refuses_a_record_the_service_would() -> None:
    """``orch.testing`` enforces the service's record limit, so a kind's own tests meet it."""
    async with run_kind("test_oversized_emitter", {}) as run:
        await run.until(lambda: run.stopped)
        assert isinstance(run.error, RecordTooLarge), run.error
        assert run.outputs == []
