"""Editing params: ``PATCH /observers/{id}`` merges new params into a paused or failed
observer's own (a JSON merge patch), validated by its kind as a create's are; a running one is
refused with what to do, and the history names the keys that changed and who changed them.
Real PostgreSQL and RabbitMQ; the manager app in this process (what a resumed copy runs with
is judged from a real service in ``tests/acceptance/test_edit_params.py``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from tests.conftest import Servers
from tests.integration.conftest import AuthApi, auth_api


@pytest.fixture
async def clients(servers: Servers, database_url: str, prefix: str) -> AsyncIterator[AuthApi]:
    async with auth_api(servers, database_url, prefix, "observer_service.kinds") as a:
        yield a


async def test_a_paused_observers_params_are_edited_and_checked_by_its_kind(
    clients: AuthApi,
) -> None:
    made = await clients.admin.post(
        "/observers", json={"name": "t", "kind": "ticker", "params": {"interval": 30}}
    )
    assert made.status_code == 201, made.text
    oid = made.json()["id"]

    running = await clients.admin.patch(f"/observers/{oid}", json={"params": {"interval": 5}})
    assert running.status_code == 409, running.text
    assert "pause it" in running.json()["detail"]

    paused = await clients.admin.post(f"/observers/{oid}/pause")
    assert paused.json()["status"] == "paused", paused.text
    edited = await clients.admin.patch(f"/observers/{oid}", json={"params": {"interval": 5}})
    assert edited.status_code == 200, edited.text
    assert edited.json()["params"] == {"interval": 5}
    assert edited.json()["status"] == "paused"

    # Checked by the kind as a create is: out of range, or a key it does not take.
    for bad in ({"interval": -1}, {"every": 3}, {"interval": "soon"}):
        wrong = await clients.admin.patch(f"/observers/{oid}", json={"params": bad})
        assert wrong.status_code == 422, (bad, wrong.text)
    # A key given as null is removed: the kind's default holds again.
    unset = await clients.admin.patch(f"/observers/{oid}", json={"params": {"interval": None}})
    assert unset.status_code == 200, unset.text
    assert unset.json()["params"] == {"interval": 1.0}

    events = (await clients.admin.get(f"/observers/{oid}/events")).json()
    edits = [(e["detail"], e["actor"]) for e in events if e["event"] == "params edited"]
    assert edits == [("interval", "ops"), ("interval", "ops")], events

    refused = await clients.read.patch(f"/observers/{oid}", json={"params": {"interval": 2}})
    assert refused.status_code == 403, refused.text
    missing = await clients.admin.patch(
        f"/observers/{uuid.uuid4()}", json={"params": {"interval": 2}}
    )
    assert missing.status_code == 404, missing.text
    resumed = await clients.admin.post(f"/observers/{oid}/resume")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["params"] == {"interval": 1.0}
