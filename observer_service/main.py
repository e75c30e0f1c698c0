"""Process entry of an observer service: settings, kinds, checks, signals, run."""

from __future__ import annotations

import asyncio
import logging
import signal

from contracts.kinds import load_kinds
from contracts.preflight import check_servers
from observer_service.service import ObserverService
from observer_service.settings import ServiceSettings


async def serve(settings: ServiceSettings) -> int:
    kinds = load_kinds(settings.kind_module_list)
    await check_servers(settings)
    service = ObserverService(settings, kinds)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.request_stop)
    return await service.run()


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s",
    )
    logging.getLogger("aiormq").setLevel(logging.WARNING)
    logging.getLogger("aio_pika").setLevel(logging.WARNING)
