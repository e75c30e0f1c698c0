"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from contracts.settings import CommonSettings, asyncpg_dsn
from manager.store import ManagerStore


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
