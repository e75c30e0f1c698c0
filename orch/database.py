"""Creating the database if needed and applying the migrations."""

from __future__ import annotations

import asyncio

import asyncpg
from alembic import command

from contracts.errors import StartupError
from contracts.settings import CommonSettings
from migrations import alembic_config


async def ensure_database(settings: CommonSettings) -> bool:
    """Create the database named in the URL when the server lacks it; True if created."""
    dsn = settings.asyncpg_dsn
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except asyncpg.InvalidCatalogNameError:
        base, _, name = dsn.rpartition("/")
        name = name.split("?")[0]
        try:
            admin = await asyncpg.connect(f"{base}/postgres", timeout=5)
        except Exception as exc:
            raise StartupError(f"cannot reach Postgres to create database {name!r}: {exc}") from exc
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        return True
    except Exception as exc:
        raise StartupError(f"cannot reach Postgres: {exc}") from exc
    await conn.close()
    return False


def migrate(settings: CommonSettings, revision: str = "head") -> bool:
    created = asyncio.run(ensure_database(settings))
    command.upgrade(alembic_config(settings.database_url), revision)
    return created
