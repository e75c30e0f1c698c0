"""Migrations: upgrade from empty, downgrade to empty, and the models match the migrations."""

from __future__ import annotations

import asyncio

import asyncpg
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.ext.asyncio import create_async_engine

from contracts.settings import asyncpg_dsn
from contracts.tables import Base
from migrations import alembic_config
from tests.conftest import Servers


async def _tables(dsn: str) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    finally:
        await conn.close()
    return {r[0] for r in rows} - {"alembic_version"}


async def test_upgrade_downgrade_roundtrip(servers: Servers, database_url: str) -> None:
    dsn = asyncpg_dsn(database_url)
    cfg = alembic_config(database_url)
    await asyncio.to_thread(command.downgrade, cfg, "base")
    assert await _tables(dsn) == set()
    await asyncio.to_thread(command.upgrade, cfg, "head")
    assert await _tables(dsn) == set(Base.metadata.tables)


async def test_models_match_migrations(database_url: str) -> None:
    engine = create_async_engine(database_url)
    async with engine.connect() as conn:
        diff = await conn.run_sync(
            lambda sync: compare_metadata(MigrationContext.configure(sync), Base.metadata)
        )
    await engine.dispose()
    assert diff == []
