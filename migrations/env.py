"""Alembic environment: the same tables as the code, the same settings as the processes."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection

from orch_contracts.database_url import normalize
from orch_contracts.pgconnect import create_engine
from orch_contracts.settings import CommonSettings
from orch_contracts.tables import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    """The canonical form (``orch_contracts.database_url``): libpq's multi-host list is read too."""
    url = config.get_main_option("sqlalchemy.url")
    return normalize(url) if url else CommonSettings().database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    # A transaction per revision, so that an upgrade under a running cluster never holds one
    # revision's locks while it waits for the next one's: holding the lock a trigger took on a
    # table while asking for the lock an added column needs deadlocked with the running
    # services' writes to that table.
    context.configure(
        connection=connection, target_metadata=target_metadata, transaction_per_migration=True
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_online() -> None:
    engine = create_engine(_url())  # several hosts: each in turn, as libpq tries them
    async with engine.connect() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
