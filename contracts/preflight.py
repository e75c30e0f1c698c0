"""Start-up checks both processes run: are the servers there, is the schema migrated?

Each failure is one readable line (StartupError), never a traceback.
"""

from __future__ import annotations

import asyncio

import aio_pika
import asyncpg
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from contracts import pgconnect
from contracts.amqp import connect_first
from contracts.errors import StartupError
from contracts.settings import CommonSettings, split_urls, where


async def check_database(settings: CommonSettings, *, need_schema: bool = True) -> None:
    try:
        conn = await pgconnect.connect(settings.asyncpg_dsn, timeout=5)
    except (
        OSError,
        TimeoutError,
        asyncpg.PostgresError,
        asyncpg.InterfaceError,
        asyncpg.exceptions.InternalClientError,  # several hosts, none writable
    ) as exc:
        raise StartupError(
            f"cannot reach Postgres at {where(settings.database_url)}: {exc}"
        ) from exc
    try:
        if need_schema and await conn.fetchval("SELECT to_regclass('observers')") is None:
            raise StartupError(
                f"the database {where(settings.database_url)} has no schema: run `orch migrate`"
            )
    finally:
        await conn.close()


async def check_broker(settings: CommonSettings) -> None:
    try:
        conn, _ = await connect_first(settings.amqp_urls, timeout=5)
    except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as exc:
        nodes = ", ".join(where(u) for u in split_urls(settings.amqp_url))
        raise StartupError(f"cannot reach RabbitMQ at {nodes}: {exc}") from exc
    await conn.close()


async def check_servers(
    settings: CommonSettings, *, wait: float = 0.0, need_schema: bool = True
) -> None:
    """Check both servers, retrying for up to ``wait`` seconds (for containers starting up)."""
    async for attempt in AsyncRetrying(
        stop=stop_after_delay(wait),
        wait=wait_fixed(1.0),
        retry=retry_if_exception_type(StartupError),
        reraise=True,
    ):
        with attempt:
            await asyncio.gather(
                check_database(settings, need_schema=need_schema), check_broker(settings)
            )
