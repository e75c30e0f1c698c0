"""Leader election over a Postgres lease: exactly one manager runs the background loops.

Acquire takes the row only when it has expired (or is already ours); renew extends it only while
we still hold it. The loops are cancelled the moment the lease is lost or the local deadline
(``orch_contracts.deadline``, on a suspend-aware clock, from when the renewal was sent) passes. A
renewal that fails for want of the database is retried until that deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from orch_contracts.backoff import Backoff
from orch_contracts.clock import Clock
from orch_contracts.deadline import LeaseDeadline, LeaseTimings
from orch_contracts.errors import OrchError, Transient
from orch_contracts.settings import default_host
from orch_manager import repository as repo
from orch_manager.store import ManagerStore

log = logging.getLogger(__name__)

Loop = Callable[[], Coroutine[Any, Any, None]]
#: The lease the managers stand for.
LEADER_NAME = "manager"


class LoopDied(OrchError):
    """A leader loop ended with a bug: the manager stops loudly rather than limp on."""


def new_holder_id() -> str:
    return f"{default_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Leadership:
    def __init__(
        self,
        store: ManagerStore,
        *,
        loops: dict[str, Loop],
        timings: LeaseTimings,
        clock: Clock,
        name: str = LEADER_NAME,
        holder: str | None = None,
    ) -> None:
        self.store = store
        self.loops = loops
        self.timings = timings
        self.deadline = LeaseDeadline(clock, timings)
        self.clock = clock
        self.name = name
        self.holder = holder or new_holder_id()
        self.is_leader = False

    async def _claim(self, *, renew: bool) -> bool:
        # One statement, without BEGIN and COMMIT: a takeover's lock is held no longer than
        # the statement (the loops' fences and the holder's renewal wait for it).
        async with self.store.autocommit() as tx:
            return await repo.leader_claim(
                tx, renew=renew, name=self.name, holder=self.holder, ttl=self.timings.ttl
            )

    async def run(self) -> None:
        """Stand for election for ever; lead while elected. Raises LoopDied."""
        while True:
            sent = self.clock.now()
            try:
                won = await asyncio.wait_for(self._claim(renew=False), self.timings.ttl / 2)
            except (Transient, TimeoutError) as exc:
                log.warning("leader election failed: %s", exc or type(exc).__name__)
                won = False
            if won:
                self.deadline.renewed(sent)
                await self._lead()
            await asyncio.sleep(self.timings.renew_interval)

    async def _lead(self) -> None:
        self.is_leader = True
        log.info("%s leads (%s)", self.holder, ", ".join(self.loops))
        tasks = [asyncio.create_task(fn(), name=f"leader:{n}") for n, fn in self.loops.items()]
        try:
            while await self._renewed(tasks):
                pass
            log.warning("%s lost the leadership; stopping the background loops", self.holder)
        finally:
            self.is_leader = False
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _renewed(self, tasks: list[asyncio.Task[None]]) -> bool:
        """Wait for the next renewal and make it; False once the lease is lost."""
        due = self.timings.renew_interval - (self.clock.now() - self.deadline.confirmed)
        done, _ = await asyncio.wait(tasks, timeout=max(0.0, min(due, self.deadline.remaining())))
        for t in done:
            cause = None if t.cancelled() else t.exception()  # a loop's cancel is not ours
            raise LoopDied(f"leader loop {t.get_name()} died ({cause!r})") from cause
        backoff = Backoff(0.02, 0.25)
        while self.deadline.valid():
            sent = self.clock.now()
            try:
                ok = await asyncio.wait_for(
                    self._claim(renew=True), max(0.05, self.deadline.remaining())
                )
            except (Transient, TimeoutError) as exc:
                log.warning("leader renewal failed (%s); retrying", exc or type(exc).__name__)
                await asyncio.sleep(backoff.next())
                continue
            if not ok or not self.deadline.valid():
                return False
            self.deadline.renewed(sent)
            return True
        return False

    async def release(self) -> None:
        try:
            async with self.store.transaction() as tx:
                await repo.leader_release(tx, name=self.name, holder=self.holder)
        except Transient as exc:
            log.warning("could not release the leadership: %s", exc)


async def current_leader(store: ManagerStore, name: str = LEADER_NAME) -> dict[str, Any] | None:
    async with store.autocommit() as tx:
        return await repo.current_leader(tx, name)
