"""``orch.client`` against a real manager and service: every action, typed answers, and each
failure raised as the error of the project's tree that it is.

The retry of a 503 is the client's own policy; it is shown against a stand-in that answers
503 with ``Retry-After`` twice (a manager answers so only while its database or broker is
away), and the manager's own 503 carries that header (``tests/integration``: the problems).
"""

from __future__ import annotations

import asyncio
import http.server
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from orch import client as oc
from orch_contracts import errors
from orch_manager.auth import Role, new_token
from tests.support.cluster import Cluster


async def test_the_client_does_every_action_and_raises_the_trees_errors(cluster: Cluster) -> None:
    read, read_entry = new_token("reader", Role.READ)
    await cluster.start_manager(api_tokens=f"{cluster.env['ORCH_API_TOKENS']},{read_entry}")
    await cluster.start_service("svc", worker_count=10)
    url = f"http://127.0.0.1:{cluster.api_port}"

    def blocking() -> None:
        with oc.Client(url, cluster.token) as api:
            o = api.create("tick-0", "ticker", params={"interval": 0.2})
            assert isinstance(o, oc.Observer)
            assert isinstance(o.id, uuid.UUID)
            assert isinstance(o.created_at, datetime)
            assert o.pool == "default"
            with pytest.raises(oc.NameTaken) as taken:
                api.create("tick-0", "ticker")
            assert isinstance(taken.value, errors.NameTaken)  # the tree's, too
            assert isinstance(taken.value, oc.Conflict)
            assert taken.value.status == 409
            with pytest.raises(oc.InvalidParams) as bad:
                api.create("bad", "ticker", params={"interval": "soon"})
            assert isinstance(bad.value, errors.InvalidParams)
            with pytest.raises(oc.UnknownKind):
                api.create("nope", "no_such_kind")
            with pytest.raises(oc.NotFound):
                api.get(uuid.uuid4())
            with pytest.raises(oc.NotFound):
                api.get("nobody-has-this-name")
            # By id or by name; a page at a time, or every page.
            assert api.get("tick-0").id == o.id
            made = api.create_many([{"name": f"tick-{i}", "kind": "ticker"} for i in range(1, 7)])
            assert (made.created, made.failed) == (6, 0)
            again = api.create_many(
                [{"name": "tick-1", "kind": "ticker"}, {"name": "x", "kind": 1}]
            )
            assert again.failed == 2
            assert isinstance(again.items[0].error, oc.NameTaken)
            assert isinstance(again.items[1].error, oc.InvalidInput)
            page = api.list(kind="ticker", limit=3)
            assert len(page.items) == 3
            assert page.next_offset == 3
            assert {x.name for x in api.observers(kind="ticker", page_size=3)} == {
                f"tick-{i}" for i in range(7)
            }
            running = wait_for_sync(
                lambda: api.get(o.id).status == "processing" and api.get(o.id).waiting is None,
                "tick-0 running",
            )
            assert running
            assert api.get(o.id).service_id is not None
            # One at a time, and by selector.
            assert api.pause("tick-0").status in ("pausing", "paused")
            wait_for_sync(lambda: api.get(o.id).status == "paused", "paused")
            with pytest.raises(oc.Conflict):
                api.restart(o.id)  # only a failed one restarts
            assert api.resume(o.id).status in ("created", "processing")
            acted = api.act("pause", kind="ticker", name_prefix="tick-", limit=3)
            assert (acted.matched, acted.done, acted.more) == (3, 3, True)
            assert all(i.observer is not None for i in acted.items)
            events = api.events("tick-0")
            assert [e.event for e in events][:2] == ["created", "taken"]
            with pytest.raises(oc.InvalidInput):
                api.move(to_pool="nowhere", kind="ticker")
            # The cluster.
            (service,) = api.services()
            assert service.name == "svc"
            assert service.worker_count == 10
            assert "ticker" in {k.name for k in api.kinds()}
            assert [p.name for p in api.pools()] == ["default"]
            totals = api.totals()
            assert totals.slots == 10
            assert totals.by_status
            assert api.drain(service.id).draining
            assert not api.undrain(service.id).draining
            # A live service's name serves as its id (as an observer's does).
            assert api.drain("svc").id == service.id
            assert not api.undrain("svc").draining
            with pytest.raises(oc.NotFound):
                api.drain("no-such-service")
            assert api.delete("tick-6").status in ("on_deleting", "deleted")
        with oc.Client(url, read) as reader:
            assert reader.get("tick-0").name == "tick-0"
            with pytest.raises(oc.Forbidden):
                reader.create("mine", "ticker")
        with oc.Client(url, "not-a-token") as stranger, pytest.raises(oc.Unauthorized):
            stranger.services()
        with pytest.raises(oc.Unavailable) as away:
            oc.Client("http://127.0.0.1:1", cluster.token).services()
        assert away.value.status is None

    await asyncio.to_thread(blocking)

    async with oc.AsyncClient(url, cluster.token) as api:
        o = await api.create("async-0", "ticker", params={"interval": 0.2})
        assert isinstance(o.id, uuid.UUID)
        with pytest.raises(oc.NameTaken):
            await api.create("async-0", "ticker")
        assert (await api.get("async-0")).id == o.id
        names = [x.name async for x in api.observers(name="async-", page_size=1)]
        assert names == ["async-0"]
        assert (await api.totals()).slots == 10
        assert (await api.delete(o.id)).status in ("on_deleting", "deleted")


def wait_for_sync(check: object, what: str, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    assert callable(check)
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return True


README = Path(__file__).resolve().parents[2] / "README.md"


class _Busy(http.server.BaseHTTPRequestHandler):
    """503 with Retry-After twice, then an answer: how a manager sounds while its database
    comes back."""

    answered = 0
    at: list[float] = []

    def do_GET(self) -> None:
        type(self).at.append(time.monotonic())
        type(self).answered += 1
        if type(self).answered <= 2:
            body = b'{"title": "Service Unavailable", "status": 503, "detail": "try again"}'
            self.send_response(503)
            self.send_header("Retry-After", "0.3")
        else:
            body = b"[]"
            self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def busy() -> Iterator[str]:
    _Busy.answered, _Busy.at = 0, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()


def test_a_503_is_tried_again_after_its_retry_after_and_no_more_than_asked(busy: str) -> None:
    assert oc.Client(busy, "t").services() == []
    assert _Busy.answered == 3
    gaps = [b - a for a, b in zip(_Busy.at, _Busy.at[1:], strict=False)]
    assert all(g >= 0.3 for g in gaps), gaps
    _Busy.answered, _Busy.at = 0, []
    with pytest.raises(oc.Unavailable) as gave_up:
        oc.Client(busy, "t", retries=1).services()
    assert gave_up.value.retry_after == 0.3
    assert _Busy.answered == 2


async def test_the_readmes_example_runs_as_written(cluster: Cluster) -> None:
    """The README's "From Python" example, run as it is written, against a real cluster."""
    await cluster.start_manager()
    await cluster.start_service("svc", worker_count=4)
    section = README.read_text().split("## From Python", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    env = {
        **os.environ,
        "ORCH_API": f"http://127.0.0.1:{cluster.api_port}",
        "ORCH_TOKEN": cluster.token or "",
    }
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-2] == "1 paused; []", lines
    assert lines[-1].endswith("slots used, 0 waiting"), lines
