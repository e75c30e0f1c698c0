"""A local cluster whose processes can be put behind proxies, with a database handle to look."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from orch.cluster import LocalCluster, Proc
from orch_verify.proxy import Proxy, via


class FaultCluster(LocalCluster):
    """``LocalCluster`` plus the proxies its processes' links go through (closed with it)."""

    proxies: list[Proxy]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.proxies = []

    async def proxy(self, url: str) -> Proxy:
        """A proxy in front of the server at ``url``, closed after the processes stopped."""
        parts = urlsplit(url)
        proxy = await Proxy(parts.hostname or "127.0.0.1", parts.port or 0).start()
        self.proxies.append(proxy)
        return proxy

    async def stop(self, timeout: float = 20) -> None:
        await super().stop(timeout)
        for proxy in self.proxies:
            await proxy.close()
        self.proxies.clear()

    async def start_behind(
        self, name: str, worker_count: int, db: Proxy, mq: Proxy, **env: Any
    ) -> Proc:
        """A service whose database and broker links go through ``db`` and ``mq``."""
        return await LocalCluster.start_service(
            self,
            name,
            worker_count,
            ORCH_DATABASE_URL=via(self.env["ORCH_DATABASE_URL"], db),
            ORCH_AMQP_URL=via(self.env["ORCH_AMQP_URL"], mq),
            **env,
        )

    async def q(self, sql: str, *args: Any, one: bool = False) -> Any:
        db = await self.connect()
        return await (db.fetchval(sql, *args) if one else db.fetch(sql, *args))
