"""The HTTP API in process, on a real database and broker: every 4xx has a message, no 500."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from manager.app import create_app
from manager.settings import ManagerSettings
from tests.conftest import Servers


@pytest.fixture
async def api(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[httpx.AsyncClient]:
    settings = ManagerSettings(
        database_url=database_url,
        amqp_url=servers.amqp_url,
        prefix=prefix,
        kind_modules="observer_service.kinds.recorder",
        auth="disabled",
        max_body_bytes=4096,
        max_params_bytes=512,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


async def test_create_get_list_and_events(api: httpx.AsyncClient) -> None:
    r = await api.post("/observers", json={"name": "a", "kind": "ticker", "params": {}})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["status"] == "created"
    assert body["params"] == {"interval": 1.0}, "params are stored as the kind validated them"
    for field in (
        "id",
        "name",
        "kind",
        "params",
        "status",
        "service_id",
        "epoch",
        "checkpoint",
        "restart_count",
        "last_error",
        "created_at",
        "modified_at",
    ):
        assert field in body
    got = await api.get(f"/observers/{body['id']}")
    assert got.json()["id"] == body["id"]
    await api.post("/observers", json={"name": "b", "kind": "ticker"})
    page = (await api.get("/observers", params={"limit": 1})).json()
    assert len(page["items"]) == 1
    assert page["next_offset"] == 1
    assert len((await api.get("/observers", params={"kind": "ticker"})).json()["items"]) == 2
    assert (await api.get("/observers", params={"status": "failed"})).json()["items"] == []
    events = (await api.get(f"/observers/{body['id']}/events")).json()
    assert [e["event"] for e in events] == ["created"]


@pytest.mark.parametrize(
    ("payload", "code", "needle"),
    [
        ({"name": "x", "kind": "nope"}, 422, "unknown kind 'nope'"),
        ({"name": "x", "kind": "ticker", "params": {"interval": -1}}, 422, "interval"),
        ({"name": "x", "kind": "ticker", "params": {"bogus": 1}}, 422, "bogus"),
        ({"name": "", "kind": "ticker"}, 422, "name"),
        ({"kind": "ticker"}, 422, "name"),
        ({"name": "x", "kind": "ticker", "extra": 1}, 422, "extra"),
        ({"name": "x", "kind": "http_poll", "params": {"url": "ftp://x"}}, 422, "url"),
        ({"name": "x", "kind": "recorder", "params": {"dir": "d" * 600}}, 413, "params"),
        (
            {"name": "x", "kind": "ticker", "restart_policy": {"max_restarts": -1}},
            422,
            "max_restarts",
        ),
    ],
)
async def test_bad_input_is_a_4xx_with_a_message(
    api: httpx.AsyncClient, payload: dict[str, object], code: int, needle: str
) -> None:
    r = await api.post("/observers", json=payload)
    assert r.status_code == code, r.text
    assert needle in r.text


async def test_body_size_limits(api: httpx.AsyncClient) -> None:
    big = {"name": "x", "kind": "ticker", "params": {"pad": "x" * 10_000}}
    r = await api.post("/observers", json=big)
    assert r.status_code == 413
    assert "larger than" in r.json()["detail"]


async def test_malformed_json_and_bad_ids(api: httpx.AsyncClient) -> None:
    r = await api.post("/observers", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert (await api.get("/observers/not-a-uuid")).status_code == 422
    missing = uuid.uuid4()
    for method, path in (
        ("GET", f"/observers/{missing}"),
        ("DELETE", f"/observers/{missing}"),
        ("POST", f"/observers/{missing}/restart"),
        ("GET", f"/observers/{missing}/events"),
    ):
        r = await api.request(method, path)
        assert r.status_code == 404, (method, path)
        assert str(missing) in r.json()["detail"]
    assert (await api.get("/observers", params={"limit": 0})).status_code == 422
    assert (await api.get("/observers", params={"status": "zzz"})).status_code == 422


async def test_name_conflict_until_deleted(api: httpx.AsyncClient) -> None:
    first = (await api.post("/observers", json={"name": "dup", "kind": "ticker"})).json()
    r = await api.post("/observers", json={"name": "dup", "kind": "ticker"})
    assert r.status_code == 409
    assert "dup" in r.json()["detail"]
    # Not running anywhere: deleted at once, and the name is free again.
    d = await api.delete(f"/observers/{first['id']}")
    assert d.status_code == 202
    assert d.json()["status"] == "deleted"
    assert (await api.post("/observers", json={"name": "dup", "kind": "ticker"})).status_code == 201


async def test_restart_of_a_non_failed_observer_is_409(api: httpx.AsyncClient) -> None:
    o = (await api.post("/observers", json={"name": "r", "kind": "ticker"})).json()
    r = await api.post(f"/observers/{o['id']}/restart")
    assert r.status_code == 409
    assert "only a failed observer" in r.json()["detail"]


async def test_pause_resume_and_delete_of_an_observer_nobody_runs(api: httpx.AsyncClient) -> None:
    o = (await api.post("/observers", json={"name": "p", "kind": "ticker"})).json()
    paused = await api.post(f"/observers/{o['id']}/pause")
    assert paused.status_code == 202
    assert paused.json()["status"] == "paused", "nothing runs it: paused at once"
    assert (await api.post(f"/observers/{o['id']}/pause")).json()["status"] == "paused"
    resumed = await api.post(f"/observers/{o['id']}/resume")
    assert resumed.status_code == 200
    assert resumed.json()["status"] == "created"
    again = await api.post(f"/observers/{o['id']}/resume")
    assert again.status_code == 409
    assert "only a paused observer" in again.json()["detail"]
    await api.post(f"/observers/{o['id']}/pause")
    assert (await api.delete(f"/observers/{o['id']}")).json()["status"] == "deleted"
    late = await api.post(f"/observers/{o['id']}/pause")
    assert late.status_code == 409
    assert "deleted observer cannot be paused" in late.json()["detail"]
    events = [e["event"] for e in (await api.get(f"/observers/{o['id']}/events")).json()]
    assert events == ["created", "paused", "resumed", "paused", "deleted"]


async def test_cluster_endpoints(api: httpx.AsyncClient) -> None:
    assert (await api.get("/healthz")).json() == {"status": "ok"}
    ready = await api.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["database"] == "ok"
    assert ready.json()["broker"] == "ok"
    assert (await api.get("/services")).json() == []
    kinds = {k["name"] for k in (await api.get("/kinds")).json()}
    assert {"ticker", "http_poll", "recorder"} <= kinds
    leader = (await api.get("/leader")).json()
    assert "this_replica" in leader
    assert (await api.get("/openapi.json")).status_code == 200


async def test_a_dead_leader_loop_stops_the_manager_through_an_event(
    servers: Servers, database_url: str, prefix: str
) -> None:
    """Not by signalling its own pid (in a test, that pid is pytest's)."""
    import asyncio

    from manager.leader import LoopDied
    from manager.runtime import ManagerRuntime

    async def broken() -> None:
        raise RuntimeError("a bug in a leader loop")

    runtime = ManagerRuntime(
        ManagerSettings(
            database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix, auth="disabled"
        )
    )
    runtime.leadership.loops = {"broken": broken}
    await runtime.start()
    try:
        await asyncio.wait_for(runtime.fatal.wait(), 10)
        assert isinstance(runtime.error, LoopDied)
    finally:
        await runtime.stop()


async def test_metrics_show_the_cluster_and_the_requests(api: httpx.AsyncClient) -> None:
    await api.post("/observers", json={"name": "m1", "kind": "ticker"})
    await api.get("/observers/00000000-0000-0000-0000-000000000000")
    text = (await api.get("/metrics")).text
    assert 'orch_observers{kind="ticker",status="created"} 1.0' in text
    assert "orch_outbox_backlog" in text
    assert "orch_leader 1.0" in text or "orch_leader 0.0" in text
    assert (
        'orch_http_request_duration_seconds_count{code="404",method="GET",'
        'route="/observers/{observer_id}"} 1.0'
    ) in text, "labelled by route template, never by the id in the path"
    assert "00000000-0000" not in text
