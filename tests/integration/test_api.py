"""The HTTP API in process, on a real database and broker: every 4xx has a message, no 500."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from orch.cluster import wait_for
from orch_contracts.durability import REPLICATION, Replication
from orch_contracts.settings import asyncpg_dsn
from orch_manager.app import create_app
from orch_manager.settings import ManagerSettings
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
        max_batch_body_bytes=32768,
        max_params_bytes=512,
        metrics_refresh=1,
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


async def test_a_history_names_the_service_an_observer_was_taken_from(
    api: httpx.AsyncClient, database_url: str
) -> None:
    """A take's detail read "from 6f1c…-…" (a raw id) in the console and the CLI."""
    body = (await api.post("/observers", json={"name": "a", "kind": "ticker"})).json()
    gone, unknown = uuid.uuid4(), uuid.uuid4()
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await conn.execute(
            "INSERT INTO services (id, name, worker_count, lock_key, lease_expires_at, "
            "is_deleted) VALUES ($1, 'alpha', 1, 1, now(), true)",
            gone,
        )
        await conn.executemany(
            "INSERT INTO observer_events (observer_id, event, detail) VALUES ($1, 'taken', $2)",
            [(uuid.UUID(body["id"]), f"from {gone}"), (uuid.UUID(body["id"]), f"from {unknown}")],
        )
    finally:
        await conn.close()
    events = (await api.get(f"/observers/{body['id']}/events")).json()
    assert [e["detail"] for e in events][1:] == [f"from alpha ({str(gone)[:8]})", f"from {unknown}"]


@pytest.mark.parametrize(
    ("payload", "code", "needle"),
    [
        ({"name": "x", "kind": "nope"}, 422, "unknown kind; known kinds:"),
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


async def test_restart_of_an_observer_not_started_yet_is_409(api: httpx.AsyncClient) -> None:
    o = (await api.post("/observers", json={"name": "r", "kind": "ticker"})).json()
    r = await api.post(f"/observers/{o['id']}/restart")
    assert r.status_code == 409
    detail = r.json()["detail"]
    assert "only a failed or running observer can be restarted; this one is created" in detail


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
    assert (await api.get("/healthz")).json()["status"] == "ok"
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

    from orch_manager.leader import LoopDied
    from orch_manager.runtime import ManagerRuntime

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
    assert 'orch_observers{kind="ticker",pool="default",status="created"} 1.0' in text
    assert "orch_outbox_backlog" in text
    assert re.search(r'^orch_work_queue_ready\{pool="default"\} \d', text, re.MULTILINE), (
        "the queue's depth"
    )
    assert "orch_leader 1.0" in text or "orch_leader 0.0" in text
    assert (
        'orch_http_request_duration_seconds_count{code="404",method="GET",'
        'route="/observers/{observer_id}"} 1.0'
    ) in text, "labelled by route template, never by the id in the path"
    assert "00000000-0000" not in text


async def test_a_scrape_waits_on_the_database_only_when_it_is_the_first(
    api: httpx.AsyncClient, database_url: str
) -> None:
    """/metrics renders what its own task read last. With the observers table locked from
    outside, so that no read of the cluster's state can end, a scrape still answers at once;
    once the lock goes, the figures catch up without a scrape waiting for them."""
    import asyncio
    import time

    import asyncpg

    from orch.cluster import wait_for
    from orch_contracts.settings import asyncpg_dsn

    created = 'orch_observers{kind="ticker",pool="default",status="created"}'
    await api.post("/observers", json={"name": "s1", "kind": "ticker"})
    assert f"{created} 1.0" in (await api.get("/metrics")).text  # the first: it waited
    scraped = time.monotonic()
    outsider = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        tx = outsider.transaction()
        await tx.start()
        await outsider.execute("LOCK TABLE observers IN ACCESS EXCLUSIVE MODE")

        # Past the refresh (1 s), with the manager's reads waiting on the lock: a scrape that
        # read in line, as they did, would wait with them.
        async def reads_wait() -> bool:
            waiting = await outsider.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
            return bool(waiting) and time.monotonic() - scraped > 1.5

        await wait_for(reads_wait, timeout=10, what="reads behind the lock, past the refresh")
        r = await asyncio.wait_for(api.get("/metrics"), 2)
        assert r.status_code == 200
        assert f"{created} 1.0" in r.text, "what was read last"
        await tx.rollback()
    finally:
        await outsider.close()
    await api.post("/observers", json={"name": "s2", "kind": "ticker"})

    async def caught_up() -> bool:
        return f"{created} 2.0" in (await api.get("/metrics")).text

    await wait_for(caught_up, timeout=10, what="the metrics to show the second create")


async def test_every_create_is_published_once(
    servers: Servers, database_url: str, prefix: str
) -> None:
    """Regression: a confirm that finished while the cleanup swapped its list of published
    rows was forgotten, and the relay published that start a second time."""
    import asyncio

    import aio_pika

    from orch.cluster import quiet, wait_for
    from orch_contracts.topology import Topology

    settings = ManagerSettings(
        database_url=database_url,
        amqp_url=servers.amqp_url,
        prefix=prefix,
        auth="disabled",
        relay_grace=0.2,
        relay_interval=0.05,
    )
    app = create_app(settings)
    n = 300
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            todo = iter(range(n))

            async def creator() -> None:
                for i in todo:
                    r = await client.post("/observers", json={"name": f"p{i}", "kind": "ticker"})
                    assert r.status_code == 201, r.text

            await asyncio.gather(*(creator() for _ in range(32)))
            await quiet(1.0, "give the relay time to publish anything left behind")
        connection = await aio_pika.connect(servers.amqp_url)
        async with connection:
            channel = await connection.channel()

            async def counted() -> int:
                queue = await channel.declare_queue(Topology(prefix).work_queue, passive=True)
                return int(queue.declaration_result.message_count or 0)

            await wait_for(counted, timeout=10, what="the starts on the broker")
            assert await counted() == n, "each start message published exactly once"


async def test_a_bulk_create_fails_only_its_bad_items(api: httpx.AsyncClient) -> None:
    await api.post("/observers", json={"name": "taken", "kind": "ticker"})
    batch = [
        {"name": "ok-1", "kind": "ticker", "params": {"interval": 2}},
        {"name": "bad-kind", "kind": "nope"},
        {"name": "bad-params", "kind": "ticker", "params": {"interval": "often"}},
        {"name": "ok-1", "kind": "ticker"},  # twice in this batch
        {"name": "taken", "kind": "ticker"},  # a live observer has it
        ["not", "an", "object"],
        {"name": "big", "kind": "recorder", "params": {"dir": "x" * 600}},
        {"name": "ok-2", "kind": "ticker"},
    ]
    r = await api.post("/observers/batch", json={"observers": batch})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [i["status"] for i in body["items"]] == [201, 422, 422, 409, 409, 422, 413, 201]
    assert (body["created"], body["failed"]) == (2, 6)
    assert [i["index"] for i in body["items"]] == list(range(len(batch)))
    for item in body["items"]:
        if item["status"] == 201:
            assert item["observer"]["status"] == "created"
            got = await api.get(f"/observers/{item['observer']['id']}")
            assert got.json()["name"] == item["observer"]["name"]
        else:
            problem = item["problem"]
            assert problem["status"] == item["status"]
            assert problem["title"]
            assert problem["detail"]
    invalid = body["items"][2]["problem"]
    assert invalid["detail"]
    non_object = body["items"][5]["problem"]
    assert non_object["errors"][0]["loc"][:3] == ["body", "observers", 5]
    assert "taken" in body["items"][4]["problem"]["detail"]


async def test_a_bulk_create_is_bounded(api: httpx.AsyncClient) -> None:
    many = [{"name": f"n{i}", "kind": "ticker"} for i in range(1001)]
    r = await api.post("/observers/batch", json={"observers": many})
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert (await api.post("/observers/batch", json={"observers": []})).status_code == 422
    # Its own body limit: larger than a single create may send, up to the batch's.
    pad = [{"name": f"p{i}", "kind": "recorder", "params": {"dir": "x" * 400}} for i in range(20)]
    assert (await api.post("/observers", json={"pad": pad})).status_code == 413
    r = await api.post("/observers/batch", json={"observers": pad})
    assert r.status_code == 200, r.text
    assert r.json()["created"] == 20
    huge = "x" * (64 << 10)
    r = await api.post("/observers/batch", content=b'{"observers": ["' + huge.encode() + b'"]}')
    assert r.status_code == 413


async def test_a_bulk_create_publishes_each_start_once(
    servers: Servers, database_url: str, prefix: str
) -> None:
    import aio_pika

    from orch_contracts.topology import Topology

    settings = ManagerSettings(
        database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix, auth="disabled"
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            batch = [{"name": f"b{i}", "kind": "ticker"} for i in range(1000)]
            r = await client.post("/observers/batch", json={"observers": batch})
            assert r.json()["created"] == 1000
    connection = await aio_pika.connect(servers.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(Topology(prefix).work_queue, passive=True)
        assert queue.declaration_result.message_count == 1000


async def test_one_action_on_every_observer_a_selector_takes(api: httpx.AsyncClient) -> None:
    """Nobody runs these observers: a pause is done at once, each on its own; one that cannot
    be done fails alone with its problem; ids that do not match are named."""
    made = await api.post(
        "/observers/batch",
        json={"observers": [{"name": f"act-{i}", "kind": "ticker"} for i in range(5)]},
    )
    ids = [item["observer"]["id"] for item in made.json()["items"]]
    await api.post("/observers", json={"name": "other", "kind": "ticker"})
    body = {"action": "pause", "selector": {"name_prefix": "act-"}}
    paused = (await api.post("/observers/actions", json=body)).json()
    assert (paused["matched"], paused["done"], paused["failed"], paused["more"]) == (5, 5, 0, False)
    assert sorted(i["id"] for i in paused["items"]) == sorted(ids)
    assert {i["observer"]["status"] for i in paused["items"]} == {"paused"}
    # One of them runs again: a resume of it fails alone (409), the paused ones resume.
    await api.post(f"/observers/{ids[0]}/resume")
    three = {"action": "resume", "selector": {"ids": ids[:3]}}
    resumed = (await api.post("/observers/actions", json=three)).json()
    assert (resumed["matched"], resumed["done"], resumed["failed"]) == (3, 2, 1)
    by_id = {i["id"]: i for i in resumed["items"]}
    assert by_id[ids[0]]["status"] == 409
    assert "only a paused observer" in by_id[ids[0]]["problem"]["detail"]
    assert by_id[ids[1]]["observer"]["status"] == by_id[ids[2]]["observer"]["status"] == "created"
    # A limit takes the oldest and says that more match.
    two = {"action": "pause", "selector": {"name_prefix": "act-"}, "limit": 2}
    limited = (await api.post("/observers/actions", json=two)).json()
    assert (limited["matched"], limited["more"]) == (2, True)
    # By ids, with one that is not there: a 404 item, the others deleted.
    nobody = "00000000-0000-0000-0000-000000000000"
    by_ids = {"action": "delete", "selector": {"ids": [ids[3], nobody]}}
    deleted = (await api.post("/observers/actions", json=by_ids)).json()
    assert [(i["id"], i["status"]) for i in deleted["items"]] == [(ids[3], 200), (nobody, 404)]
    assert deleted["items"][0]["observer"]["status"] == "deleted"
    # Deleted ones are never taken again, and "other" was never touched.
    again = (await api.post("/observers/actions", json=by_ids)).json()
    assert again["matched"] == 0
    listed = (await api.get("/observers", params={"name": "other"})).json()["items"]
    assert [o["status"] for o in listed] == ["created"]


async def test_an_action_names_what_it_acts_on(api: httpx.AsyncClient) -> None:
    empty = await api.post("/observers/actions", json={"action": "pause", "selector": {}})
    assert empty.status_code == 422
    assert "name the observers to act on" in empty.text
    unknown = await api.post(
        "/observers/actions", json={"action": "explode", "selector": {"kind": "ticker"}}
    )
    assert unknown.status_code == 422
    assert (await api.get("/observers/actions")).status_code == 405


async def test_a_connection_never_given_back_does_not_hang_the_managers_shutdown(
    servers: Servers, database_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shutdown is bounded: a task outside the runtime that holds a pooled connection for
    ever (asyncpg's close waits for every connection to come back) costs the wait, then the
    connection is dropped. A CI run once hung five minutes in a manager's shutdown."""
    import asyncio

    from orch_contracts import pgconnect
    from orch_manager.runtime import ManagerRuntime

    monkeypatch.setattr(pgconnect, "CLOSE_TIMEOUT", 0.5)
    runtime = ManagerRuntime(
        ManagerSettings(
            database_url=database_url, amqp_url=servers.amqp_url, prefix=prefix, auth="disabled"
        )
    )
    await runtime.start()
    holding = asyncio.Event()

    async def hold() -> None:
        async with runtime.store.transaction():
            holding.set()
            await asyncio.Event().wait()

    holder = asyncio.create_task(hold())
    try:
        await asyncio.wait_for(holding.wait(), 10)
        await asyncio.wait_for(runtime.stop(), 20)
    finally:
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)


async def test_healthz_says_what_the_database_server_risks_autovacuum_and_replication(
    api: httpx.AsyncClient, database_url: str
) -> None:
    """A server with autovacuum off (some images ship so) lets the orchestrator's tables grow:
    /healthz shows the setting as read, and a warning when it is off."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        expected = await conn.fetchval("SHOW autovacuum")
        replication = Replication.of(await conn.fetchrow(REPLICATION))
    finally:
        await conn.close()

    async def read() -> dict[str, Any] | None:
        body: dict[str, Any] = (await api.get("/healthz")).json()
        return body if body["database"]["autovacuum"] is not None else None

    body = await wait_for(read, timeout=10, what="the database's settings read")
    assert body["status"] == "ok"
    assert body["database"]["autovacuum"] == expected
    assert body["database"]["durability"] == replication.durability
    assert body["database"]["timeline"] == replication.timeline
    assert bool(body["warnings"]) == (expected == "off" or bool(replication.warnings()))
