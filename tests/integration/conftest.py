"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from contracts.settings import asyncpg_dsn


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[tuple[asyncpg.Connection, AsyncEngine]]:
    """A plain connection to set rows up with, and the engine the manager's code runs on."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    engine = create_async_engine(database_url)
    try:
        yield conn, engine
    finally:
        await engine.dispose()
        await conn.close()
