"""The service's registration and lease: one row, renewed by one UPDATE for all its observers.

The lease is valid locally until ``sent + ttl - margin`` of the last renewal that succeeded,
where ``sent`` is the monotonic time the renewal was *sent*: Postgres sets the expiry from its own
clock at commit, which is later, so the local deadline always falls before the one others see.
The dedicated connection also holds a session-level advisory lock: while this process lives, its
session lives, and takers can tell a dead holder from a slow one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable

import asyncpg

log = logging.getLogger(__name__)

_RENEW_SQL = """
UPDATE services
   SET lease_expires_at = clock_timestamp() + make_interval(secs => $2),
       last_heartbeat_at = clock_timestamp(), modified_at = now(), is_deleted = false
 WHERE id = $1
RETURNING ARRAY(SELECT id FROM observers WHERE service_id = $1 AND status = 'on_deleting'),
          draining
"""


class LeaseKeeper:
    def __init__(
        self,
        *,
        dsn: str,
        service_id: uuid.UUID,
        name: str,
        worker_count: int,
        host: str,
        version: str,
        ttl: float,
        renew_interval: float,
        margin: float,
        on_lost: Callable[[str], None],
        on_renewed: Callable[[list[uuid.UUID], bool, bool], Awaitable[None]],
    ) -> None:
        self.dsn = dsn
        self.service_id = service_id
        self.lock_key = secrets.randbits(63)
        self._row = (name, worker_count, host, version)
        self.ttl = ttl
        self.renew_interval = renew_interval
        self.margin = margin
        self._on_lost = on_lost
        self._on_renewed = on_renewed
        self._conn: asyncpg.Connection | None = None
        self.valid_until = 0.0  # monotonic
        self._fenced = True  # nothing runs before the first renewal
        self._closing = False

    def valid(self) -> bool:
        """True while this service surely holds its lease; fences everything the moment not."""
        if time.monotonic() < self.valid_until:
            return True
        self._fence("lease deadline passed")
        return False

    def _fence(self, reason: str) -> None:
        if not self._fenced:
            self._fenced = True
            log.warning("lease lost (%s): stopping every observer of this service", reason)
            self._on_lost(reason)

    async def _connect(self) -> asyncpg.Connection:
        conn = await asyncpg.connect(self.dsn, timeout=max(1.0, self.ttl / 2))
        await conn.execute("SELECT pg_advisory_lock($1)", self.lock_key)
        conn.add_termination_listener(
            lambda _c: None if self._closing else log.warning("lease connection lost")
        )
        return conn

    async def register(self) -> None:
        """Insert the service row with a fresh lease; the first renewal happens here."""
        self._conn = await self._connect()
        name, worker_count, host, version = self._row
        sent = time.monotonic()
        await self._conn.execute(
            "INSERT INTO services (id, name, worker_count, host, pid, version, lock_key, "
            "lease_expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, "
            "clock_timestamp() + make_interval(secs => $8))",
            self.service_id,
            name,
            worker_count,
            host,
            os.getpid(),
            version,
            self.lock_key,
            self.ttl,
        )
        self.valid_until = sent + self.ttl - self.margin
        self._fenced = False

    async def run(self) -> None:
        """Renew forever; fence when the deadline passes before a renewal succeeds."""
        while True:
            await asyncio.sleep(
                max(0.0, min(self.renew_interval, self.valid_until - time.monotonic()))
            )
            self.valid()
            sent = time.monotonic()
            try:
                renewed = await self._renew(max(0.2, self.valid_until - sent))
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                log.warning("lease renewal failed: %s", exc)
                await self._drop_connection()
                self.valid()
                await asyncio.sleep(min(0.5, self.renew_interval))
                continue
            if renewed is None:
                log.error("service row is gone; fencing")
                self._fence("service row missing")
                continue
            self.valid()  # a deadline that passed while we waited still fences
            was_fenced = self._fenced
            self.valid_until = sent + self.ttl - self.margin
            self._fenced = False
            deleting, draining = renewed
            await self._on_renewed(deleting, was_fenced, draining)

    async def _renew(self, limit: float) -> tuple[list[uuid.UUID], bool] | None:
        """Extend the lease; returns (own observers being deleted, draining?)."""
        conn = self._conn
        if conn is None or conn.is_closed():
            conn = self._conn = await asyncio.wait_for(self._connect(), limit)
        assert conn is not None
        row = await conn.fetchrow(_RENEW_SQL, self.service_id, self.ttl, timeout=limit)
        return None if row is None else (list(row[0]), bool(row[1]))

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.terminate()

    async def close(self, *, deleted: bool) -> None:
        """Mark the service deleted (graceful stop) and end the session, freeing the lock."""
        self._closing = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if deleted:
                await conn.execute(
                    "UPDATE services SET is_deleted = true, lease_expires_at = clock_timestamp(), "
                    "modified_at = now() WHERE id = $1",
                    self.service_id,
                    timeout=5,
                )
            await conn.close(timeout=5)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            log.warning("could not close the lease cleanly: %s", exc)
            conn.terminate()
