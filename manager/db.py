"""The manager's database engine and its one JSON encoder."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import AsyncIterator

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from contracts import pgconnect
from contracts.errors import database_errors
from contracts.settings import CommonSettings

#: The one way the manager turns data into JSON for the database.
to_json = functools.partial(json.dumps, separators=(",", ":"), default=str)


def make_engine(settings: CommonSettings, *, pool_size: int = 20) -> AsyncEngine:
    # No overflow: a connection opened for a burst and closed after it costs more than waiting.
    return pgconnect.create_engine(
        settings.database_url,  # several hosts: each in turn (``contracts.pgconnect``)
        pool_size=pool_size,
        max_overflow=0,
        # No pre-ping (three round trips per request); a dead connection fails one request
        # with 503 and is replaced.
        pool_recycle=3600,
        connect_args={"timeout": 5, "command_timeout": 30},
    )


@contextlib.asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A transaction; driver errors inside become the orchestrator's own."""
    with database_errors():
        async with engine.begin() as conn:
            yield conn


@contextlib.asynccontextmanager
async def autocommit(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection without BEGIN/COMMIT round trips, for work done in one (atomic) statement."""
    with database_errors():
        async with engine.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")
