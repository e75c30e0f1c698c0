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


async def test_constraints_are_named_as_the_models_name_them(database_url: str) -> None:
    """Autogenerate does not compare check constraints; a migration that names one twice
    over would go unnoticed until the next migration tries to drop it."""
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        rows = await conn.fetch(
            "SELECT conname FROM pg_constraint WHERE contype = 'c' AND connamespace = "
            "'public'::regnamespace"
        )
    finally:
        await conn.close()
    in_db = {r["conname"] for r in rows}
    in_models = {
        c.name
        for table in Base.metadata.tables.values()
        for c in table.constraints
        if c.__class__.__name__ == "CheckConstraint"
    }
    assert in_db == in_models
