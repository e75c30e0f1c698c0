"""Creating the database if needed and applying the migrations."""

from __future__ import annotations

import asyncio

import asyncpg
from alembic import command

from contracts.errors import StartupError
from contracts.settings import CommonSettings, where
from migrations import alembic_config

_UNREACHABLE = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


async def ensure_database(settings: CommonSettings) -> bool:
    """Create the database named in the URL when the server lacks it; True if created."""
    try:
        conn = await asyncpg.connect(settings.asyncpg_dsn, timeout=5)
    except asyncpg.InvalidCatalogNameError:
        url = settings.url.set(drivername="postgresql")
        name = url.database
        admin_dsn = url.set(database="postgres").render_as_string(hide_password=False)
        try:
            admin = await asyncpg.connect(admin_dsn, timeout=5)
        except _UNREACHABLE as exc:
            raise StartupError(f"cannot reach Postgres to create database {name!r}: {exc}") from exc
        try:
            quoted = (name or "").replace('"', '""')
            await admin.execute(f'CREATE DATABASE "{quoted}"')
        finally:
            await admin.close()
        return True
    except _UNREACHABLE as exc:
        where_to = where(settings.database_url)
        raise StartupError(f"cannot reach Postgres at {where_to}: {exc}") from exc
    await conn.close()
    return False


def migrate(settings: CommonSettings, revision: str = "head") -> bool:
    created = asyncio.run(ensure_database(settings))
    command.upgrade(alembic_config(settings.database_url), revision)
    return created
