"""Process entry of an observer service: build the real parts from settings, run, exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg

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
from orch_contracts import __version__, logs, pgconnect
from orch_contracts.backoff import Backoff
from orch_contracts.clock import Clock, process_age
from orch_contracts.durability import REPLICATION, Replication
from orch_contracts.errors import DatabaseUnavailable, StartupError, database_errors, timed_out
from orch_contracts.kinds import KindSpec
from orch_contracts.settings import default_host, where
from orch_contracts.witness import Witness

log = logging.getLogger(__name__)
#: The longest a first connection is given, seconds, after tries that took too long.
CONNECT_CAP = 60.0


async def _open_pool(
    settings: ServiceSettings, size: int, ttl: float, until: float
) -> asyncpg.Pool:
    """The service's pool, with one connection open. The start-up check found the server; one
    that is slow (a congested or distant link) is tried again, each try given twice as long,
    for as long as it takes: exiting would only make a supervisor start the process again,
    and until the pool opens the service has not joined, so it takes no work. One that
    refuses (at its connection limit) is tried again until ``until``, then StartupError. A line
    in the log for each try."""
    usual = timeout = max(2.0, ttl)
    backoff = Backoff(1.0, 30.0, jitter=0.2)
    # The longer time for a connection is the first one's only: once the pool is open, a
    # connection (or a query) as slow as that would guard nothing (a switchover to a dead
    # host would stall each new connection a minute).
    times = {"timeout": timeout}

    async def connect(dsn: str | None = None, **kwargs: Any) -> asyncpg.Connection:
        kwargs["timeout"] = times["timeout"]
        kwargs["command_timeout"] = max(5.0, 2 * ttl, times["timeout"])
        return await pgconnect.connect(dsn, **kwargs)  # several hosts: each in turn

    while True:
        times["timeout"] = timeout
        try:
            with database_errors():
                pool = await asyncpg.create_pool(
                    settings.asyncpg_dsn,
                    connect=connect,
                    min_size=1,
                    max_size=size,
                    max_inactive_connection_lifetime=0,
                    reset=keep_session,
                    server_settings=SERVER_SETTINGS,
                )
            times["timeout"] = usual
            return pool
        except DatabaseUnavailable as exc:
            if not timed_out(exc) and time.monotonic() >= until:
                raise StartupError(
                    f"cannot open connections to Postgres at {where(settings.database_url)}: {exc}"
                ) from exc
            delay = backoff.next()
            log.warning(
                "cannot open connections to Postgres at %s yet (%s); trying again in %.1f s "
                "with %.0f s for a connection",
                where(settings.database_url),
                exc,
                delay,
                min(CONNECT_CAP, 2 * timeout),
            )
            timeout = min(CONNECT_CAP, 2 * timeout)
            await asyncio.sleep(delay)


async def _durability(pool: asyncpg.Pool, require_synchronous: bool) -> None:
    """Say what a failover of the database can lose (``contracts/durability.py``); refuse to
    start on less than synchronous replication where it is required."""
    with database_errors():
        replication = Replication.of(await pool.fetchrow(REPLICATION))
    for warning in replication.warnings():
        log.warning("%s", warning)
    replication.require(synchronous=require_synchronous)


async def _warm(pool: asyncpg.Pool, n: int) -> None:
    """Open ``n`` connections and prepare the statements of a takeover on each, in the
    background: a takeover after a crash finds them ready, and the start does not wait for
    them (on a link that delays each chunk 200-800 ms, preparing one connection took 20 s)."""
    held: list[asyncpg.Connection] = []
    try:
        with contextlib.suppress(DatabaseUnavailable), database_errors():
            for _ in range(n):
                held.append(await pool.acquire())
            await asyncio.gather(*(prepare_connection(conn) for conn in held))
    finally:
        for conn in held:
            await pool.release(conn)


@contextlib.asynccontextmanager
async def assembled(
    settings: ServiceSettings,
    kinds: dict[str, KindSpec],
    *,
    service_id: uuid.UUID,
    wait_until: float = 0.0,
    started: float | None = None,
    witness: Witness | None = None,
) -> AsyncIterator[ObserverService]:
    """The service built from settings, its database pool open and its metrics served; the
    pool is closed on the way out (``serve`` runs it in a process; the tests' in-process tier
    runs several in one event loop). ``wait_until`` as ``serve``'s; ``started``, the
    process's start (``time.monotonic()``), for the start-up lines."""
    timings = settings.lease_timings
    # A query slower than a lease is useless: whatever it guarded has been fenced by then.
    # Connections stay open and prepared (``prepare_connection``): a takeover after a crash
    # finds them ready. Four cover the batchers (takes, checkpoints, releases) and one more.
    size = settings.db_pool_max or min(20, 2 + settings.worker_count)
    pool = await _open_pool(settings, size, timings.ttl, wait_until)
    warming: asyncio.Task[None] | None = None
    try:
        await _durability(pool, settings.require_synchronous_replication)
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
            directed_after=timings.renew_interval,
        )
        # Never the whole pool: takes arriving meanwhile find a connection.
        warming = asyncio.create_task(_warm(pool, min(4, size - 2)), name="warm-pool")
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
                process_started=started,
            ),
            kinds=kinds,
            store=PgStore(pool, service_id),
            broker=AmqpBroker(settings, settings.pool),
            lease_database=lease_database,
            timings=timings,
            clock=Clock(settings.clock_hook),
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
                raise StartupError(
                    f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port} "
                    f"(ORCH_METRICS_HOST, ORCH_METRICS_PORT): {exc}"
                ) from exc
        yield service
    finally:
        if warming is not None:
            warming.cancel()
            await asyncio.gather(warming, return_exceptions=True)
        await pgconnect.close_pool(pool)


async def run(service: ObserverService, *, wait_until: float = 0.0) -> int:
    """Run an assembled service until a stop is asked; its exit code."""
    try:
        return await service.run(join_until=wait_until)
    except DatabaseUnavailable as exc:
        raise StartupError(f"cannot register the service: {exc}") from exc


async def serve(
    settings: ServiceSettings, kinds: dict[str, KindSpec], *, wait_until: float = 0.0
) -> int:
    """Run one service until SIGTERM/SIGINT; returns the exit code. Its first connections are
    tried again while the database is slow to answer, and while it refuses them until
    ``wait_until`` (``time.monotonic()``; ``_open_pool``, ``LeaseKeeper.start``).

    If a graceful stop leaves copies running (a kind that does not stop in time), the process
    exits at once instead of returning: the copies must end with it."""
    age = process_age()
    started = None if age is None else time.monotonic() - age
    service_id = uuid.uuid4()
    logs.configure(
        settings.log_level, settings.log_format, service=settings.name, service_id=service_id
    )
    witness = None
    if settings.witness_dir is not None:
        if settings.witness_memory:
            start_tracing()
        witness = Witness(settings.witness_dir, service_id)
    async with assembled(
        settings,
        kinds,
        service_id=service_id,
        wait_until=wait_until,
        started=started,
        witness=witness,
    ) as service:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.request_stop)
        code = await run(service, wait_until=wait_until)
        # Leaving here would close the pool; copies still running must end with the process.
        if not service.clean:
            logging.shutdown()
            os._exit(code or 1)
        if guard.abandoned():  # collecting their coroutines would run their cleanup: never
            logging.shutdown()
            os._exit(code)
    return code
