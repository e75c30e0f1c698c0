"""Process entry of an observer service: build the real parts from settings, run, exit."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid

import asyncpg
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_fixed

from contracts import __version__, logs, pgconnect
from contracts.clock import Clock
from contracts.errors import DatabaseUnavailable, StartupError, database_errors
from contracts.kinds import KindSpec
from contracts.settings import default_host, where
from contracts.witness import Witness
from observer_service import guard
from observer_service.broker import AmqpBroker
from observer_service.service import ObserverService, ServiceConfig
from observer_service.settings import ServiceSettings
from observer_service.store import (
    SERVER_SETTINGS,
    PgLeaseDatabase,
    PgStore,
    ThreadWrites,
    keep_session,
    prepare_connection,
)
from observer_service.witnessing import start_tracing

log = logging.getLogger(__name__)


async def serve(
    settings: ServiceSettings, kinds: dict[str, KindSpec], *, wait_until: float = 0.0
) -> int:
    """Run one service until SIGTERM/SIGINT; returns the exit code. While the database is
    unavailable its connections are tried again until ``wait_until`` (``time.monotonic()``).

    If a graceful stop leaves copies running (a kind that does not stop in time), the process
    exits at once instead of returning: the copies must end with it."""
    service_id = uuid.uuid4()
    logs.configure(
        settings.log_level, settings.log_format, service=settings.name, service_id=service_id
    )
    witness = None
    if settings.witness_dir is not None:
        start_tracing()
        witness = Witness(settings.witness_dir, service_id)
    clock = Clock(settings.clock_hook)
    timings = settings.lease_timings
    # A query slower than a lease is useless: whatever it guarded has been fenced by then.
    # Connections stay open and prepared (``prepare_connection``): a takeover after a crash
    # finds them ready. Four cover the batchers (takes, checkpoints, releases) and one more.
    size = settings.db_pool_max or min(20, 2 + settings.worker_count)

    async def open_pool() -> asyncpg.Pool:
        with database_errors():
            return await asyncpg.create_pool(
                settings.asyncpg_dsn,
                connect=pgconnect.connect,  # several hosts: each in turn, as libpq tries them
                min_size=min(4, size),
                max_size=size,
                max_inactive_connection_lifetime=0,
                init=prepare_connection,
                reset=keep_session,
                server_settings=SERVER_SETTINGS,
                timeout=max(2.0, timings.ttl),
                command_timeout=max(5.0, 2 * timings.ttl),
            )

    # The start-up check took one connection; a server at its connection limit may refuse the
    # pool's several: that is a server not there yet, waited for like one that is down.
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_delay(max(0.0, wait_until - time.monotonic())),
            wait=wait_fixed(1.0),
            retry=retry_if_exception_type(DatabaseUnavailable),
            reraise=True,
        ):
            with attempt:
                pool = await open_pool()
    except DatabaseUnavailable as exc:
        raise StartupError(
            f"cannot open connections to Postgres at {where(settings.database_url)}: {exc}"
        ) from exc
    lease_database = PgLeaseDatabase(
        settings.asyncpg_dsn,
        service_id=service_id,
        name=settings.name,
        worker_count=settings.worker_count,
        host=default_host(),
        version=__version__,
        connect_timeout=max(1.0, timings.ttl / 2),
        kinds={name: spec.advert() for name, spec in kinds.items()},
        pool=settings.pool,
    )
    service = ObserverService(
        service_id=service_id,
        config=ServiceConfig(
            name=settings.name,
            worker_count=settings.worker_count,
            shutdown_timeout=settings.shutdown_timeout,
            check_every=settings.check_every,
            loop_stall=settings.loop_stall,
            output_buffer_bytes=settings.output_buffer_bytes,
            broker_advice=settings.broker_advice,
            pool=settings.pool,
        ),
        kinds=kinds,
        store=PgStore(pool, service_id),
        broker=AmqpBroker(settings, settings.pool),
        lease_database=lease_database,
        timings=timings,
        clock=clock,
        thread_writes=ThreadWrites(settings.asyncpg_dsn, service_id),
        witness=witness,
    )
    if settings.metrics_port is not None:
        try:
            service.metrics.serve(
                settings.metrics_port,
                settings.metrics_host,
                timeout=settings.metrics_timeout,
                max_connections=settings.metrics_max_connections,
            )
        except OSError as exc:
            await pgconnect.close_pool(pool)
            raise StartupError(
                f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port} "
                f"(ORCH_METRICS_HOST, ORCH_METRICS_PORT): {exc}"
            ) from exc
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.request_stop)
    try:
        code = await service.run()
    except DatabaseUnavailable as exc:
        await pgconnect.close_pool(pool)
        raise StartupError(f"cannot register the service: {exc}") from exc
    if not service.clean:
        logging.shutdown()
        os._exit(code or 1)
    if guard.abandoned():  # collecting their coroutines would run their cleanup: never
        logging.shutdown()
        os._exit(code)
    await pgconnect.close_pool(pool)
    return code
