"""A manager replica served: the API on uvicorn, with the runtime's background loops, until a
signal, a stop asked, or a runtime task that dies."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from orch_contracts.kinds import KindSpec
from orch_manager.app import create_app
from orch_manager.http import guarded_http, room_for
from orch_manager.runtime import ManagerRuntime
from orch_manager.settings import ManagerSettings


class _SignalsAlone(uvicorn.Server):
    """A server that leaves the process's signal handlers as they are."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    settings: ManagerSettings,
    kinds: dict[str, KindSpec],
    replica: str,
    sock: socket.socket | None = None,
    *,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until a signal or ``stop`` (0), or until a task of the runtime dies (1). With
    ``stop`` given, the process's signals are left alone (the tests' in-process tier)."""
    room_for(settings.max_connections)
    runtime = ManagerRuntime(settings, kinds, replica=replica)
    config = uvicorn.Config(
        create_app(settings, runtime=runtime),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        # httptools with bounded request heads (by itself it has no limit on them).
        http=guarded_http(
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            header_timeout=settings.header_timeout,
            send_timeout=settings.send_timeout,
            max_connections=settings.max_connections,
        ),
        timeout_keep_alive=settings.keep_alive_timeout,
        # X-Forwarded-For/-Proto only from the proxies named (uvicorn's default believes any
        # process on loopback, FORWARDED_ALLOW_IPS from the environment aside).
        proxy_headers=bool(settings.forwarded_allow_list),
        forwarded_allow_ips=settings.forwarded_allow_list or [],
    )
    server = uvicorn.Server(config) if stop is None else _SignalsAlone(config)
    serving = asyncio.create_task(server.serve(sockets=None if sock is None else [sock]))
    ending = [asyncio.create_task(runtime.fatal.wait())]
    if stop is not None:
        ending.append(asyncio.create_task(stop.wait()))
    await asyncio.wait([serving, *ending], return_when=asyncio.FIRST_COMPLETED)
    if not serving.done():
        server.should_exit = True
    for task in ending:
        task.cancel()
    await serving
    return 1 if runtime.fatal.is_set() else 0
