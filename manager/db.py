"""The manager's database engine."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from contracts.settings import CommonSettings


def make_engine(settings: CommonSettings, *, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        settings.database_url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args={"timeout": 5, "command_timeout": 30},
    )
