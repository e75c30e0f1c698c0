"""Start-up checks both processes run: are the servers there, is the schema migrated, does
the broker take our queues as we declare them?

Each failure is one readable line (StartupError), never a traceback.
"""

from __future__ import annotations

import asyncio

import aio_pika
import asyncpg
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from orch_contracts import pgconnect
from orch_contracts.amqp import connect_first
from orch_contracts.durability import REPLICATION, Replication
from orch_contracts.errors import StartupError
from orch_contracts.settings import CommonSettings, split_urls, where
from orch_contracts.topology import broker_version, declare_topology


class NotYet(StartupError):
    """A server that is not there (yet): waiting for it may help, unlike a refusal."""


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
        raise NotYet(f"cannot reach Postgres at {where(settings.database_url)}: {exc}") from exc
    try:
        if need_schema and await conn.fetchval("SELECT to_regclass('observers')") is None:
            raise NotYet(
                f"the database {where(settings.database_url)} has no schema: run `orch migrate`"
            )
        if settings.require_synchronous_replication:
            Replication.of(await conn.fetchrow(REPLICATION)).require(synchronous=True)
    finally:
        await conn.close()


async def check_broker(settings: CommonSettings, *, declare: bool = True) -> None:
    """Connect; with ``declare``, declare the topology as the processes will, so that a queue
    of other arguments or a missing permission stops the start with its fix, not a retry loop."""
    nodes = ", ".join(where(u) for u in split_urls(settings.amqp_url))
    try:
        conn, _ = await connect_first(settings.amqp_urls, timeout=5)
    except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as exc:
        raise NotYet(f"cannot reach RabbitMQ at {nodes}: {exc}") from exc
    try:
        if declare:
            await declare_topology(
                await conn.channel(publisher_confirms=False),
                settings.topology,
                version=broker_version(conn),
                queue_type=settings.queue_type,
                consumer_timeout_ms=settings.consumer_timeout_ms,
            )
    except (OSError, TimeoutError, aio_pika.exceptions.AMQPError) as exc:
        raise NotYet(f"cannot declare the queues on RabbitMQ at {nodes}: {exc}") from exc
    finally:
        await conn.close()


async def check_servers(
    settings: CommonSettings, *, wait: float = 0.0, need_schema: bool = True, declare: bool = True
) -> None:
    """Check both servers, retrying for up to ``wait`` seconds (for containers starting up);
    a refusal (StartupError, not NotYet) ends the wait at once."""
    async for attempt in AsyncRetrying(
        stop=stop_after_delay(wait),
        wait=wait_fixed(1.0),
        retry=retry_if_exception_type(NotYet),
        reraise=True,
    ):
        with attempt:
            # Both run to their end: a check cancelled half-way by ``asyncio.run``'s clean-up
            # (which cancels the connection's reader along with it) waited forever in
            # ``conn.close()`` for a broker's reply no task was reading any more.
            results = await asyncio.gather(
                check_database(settings, need_schema=need_schema),
                check_broker(settings, declare=declare),
                return_exceptions=True,
            )
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:  # a refusal first: it ends the wait at once, whichever check found it
                raise min(errors, key=lambda e: isinstance(e, NotYet))
