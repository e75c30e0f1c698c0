"""Migrations: upgrade from empty, downgrade to empty, and the models match the migrations."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.ext.asyncio import create_async_engine

from orch_contracts.settings import asyncpg_dsn
from orch_contracts.tables import Base
from orch_migrations import alembic_config
from tests.conftest import COUNTS_WRONG, Servers


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


async def test_0007_keys_existing_names_and_keeps_look_alikes_that_lived_before(
    database_url: str,
) -> None:
    """Observers whose names look alike were allowed before 0007: the migration keeps them all
    (the oldest holds the key) instead of failing; a new look-alike is refused after it."""
    dsn = asyncpg_dsn(database_url)
    cfg = alembic_config(database_url)
    await asyncio.to_thread(command.downgrade, cfg, "0006")
    conn = await asyncpg.connect(dsn)
    try:
        insert = (
            "INSERT INTO observers (id, name, kind, status, dispatch_id, created_at) "
            "VALUES ($1, $2, 'ticker', $3, $1, now() + $4 * interval '1 second')"
        )
        ids = [uuid.uuid4() for _ in range(4)]
        await conn.execute(insert, ids[0], "paypal", "created", 0)
        await conn.execute(insert, ids[1], "PayPal", "processing", 1)  # a look-alike, live
        await conn.execute(insert, ids[2], "PAYPAL", "deleted", 2)
        await conn.execute(insert, ids[3], "other", "created", 3)
        await asyncio.to_thread(command.upgrade, cfg, "head")
        keys = {
            r["id"]: r["name_key"] for r in await conn.fetch("SELECT id, name_key FROM observers")
        }
        assert keys == {ids[0]: "paypal", ids[1]: None, ids[2]: "paypal", ids[3]: "other"}
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.execute(
                "INSERT INTO observers (id, name, name_key, kind, status, dispatch_id) "
                "VALUES ($1, 'pAypal', 'paypal', 'ticker', 'created', $1)",
                uuid.uuid4(),
            )
        await asyncio.to_thread(command.downgrade, cfg, "0006")
        await asyncio.to_thread(command.upgrade, cfg, "head")
    finally:
        await conn.close()


async def test_0015_counts_the_observers_there_already_are(database_url: str) -> None:
    """The counts start from the observers the upgrade finds, and the triggers follow on."""
    dsn = asyncpg_dsn(database_url)
    cfg = alembic_config(database_url)
    await asyncio.to_thread(command.downgrade, cfg, "0014")
    conn = await asyncpg.connect(dsn)
    try:
        insert = (
            "INSERT INTO observers (id, name, kind, status, dispatch_id) "
            "VALUES ($1, $2, $3, $4, $1)"
        )
        for i, (kind, status) in enumerate(
            [("ticker", "created"), ("ticker", "created"), ("recorder", "deleted")]
        ):
            await conn.execute(insert, uuid.uuid4(), f"o{i}", kind, status)
        await asyncio.to_thread(command.upgrade, cfg, "head")
        counts = {
            (r["kind"], r["status"]): r["n"]
            for r in await conn.fetch("SELECT kind, status, n FROM observer_counts")
        }
        assert counts == {("ticker", "created"): 2, ("recorder", "deleted"): 1}
        await conn.execute("UPDATE observers SET status = 'deleted' WHERE name = 'o0'")
        assert not await conn.fetch(COUNTS_WRONG)
    finally:
        await conn.close()
