"""Creating the database if needed and applying the migrations."""

from __future__ import annotations

import asyncio

import asyncpg
from alembic import command

from orch_contracts import pgconnect
from orch_contracts.errors import StartupError
from orch_contracts.settings import CommonSettings, asyncpg_dsn, on_database, where
from orch_migrations import alembic_config

_UNREACHABLE = (
    OSError,
    TimeoutError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,  # several hosts, none writable
)


async def ensure_database(settings: CommonSettings) -> bool:
    """Create the database named in the URL when the server lacks it; True if created."""
    try:
        conn = await pgconnect.connect(settings.asyncpg_dsn, timeout=5)
    except asyncpg.InvalidCatalogNameError:
        name = settings.url.database
        admin_dsn = asyncpg_dsn(on_database(settings.database_url, "postgres"))
        try:
            admin = await pgconnect.connect(admin_dsn, timeout=5)
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
