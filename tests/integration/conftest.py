"""Fixtures shared by the integration tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import httpx
import pytest
from fastapi import FastAPI

from orch_contracts.settings import CommonSettings, asyncpg_dsn
from orch_manager.app import create_app
from orch_manager.auth import Role, new_token
from orch_manager.settings import ManagerSettings
from orch_manager.store import ManagerStore
from tests.conftest import Servers


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[tuple[asyncpg.Connection, ManagerStore]]:
    """A plain connection to set rows up with, and the store the manager's code runs on."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    store = ManagerStore(CommonSettings(database_url=database_url), pool_size=4)
    await store.open()
    try:
        yield conn, store
    finally:
        await store.close()
        await conn.close()


@dataclass
class AuthApi:
    """The manager's app in process, auth on, with a client for a ``read`` and an ``admin``
    token."""

    app: FastAPI
    read: httpx.AsyncClient
    admin: httpx.AsyncClient


@contextlib.asynccontextmanager
async def auth_api(
    servers: Servers, database_url: str, prefix: str, kind_modules: str
) -> AsyncIterator[AuthApi]:
    read, read_entry = new_token("reader", Role.READ)
    admin, admin_entry = new_token("ops", Role.ADMIN)
    settings = ManagerSettings(
        database_url=database_url,
        amqp_url=servers.amqp_url,
        prefix=prefix,
        kind_modules=kind_modules,
        auth="on",
        api_tokens=f"{read_entry},{admin_entry}",
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

        def client(token: str) -> httpx.AsyncClient:
            return httpx.AsyncClient(
                transport=transport,
                base_url="http://test",
                headers={"Authorization": f"Bearer {token}"},
            )

        async with client(read) as r, client(admin) as a:
            yield AuthApi(app, r, a)
