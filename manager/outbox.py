"""Transactional outbox: a message is written with the change that needs it, then published.

The API publishes its own rows right after commit (fast path) and deletes them; the leader's
relay publishes rows that stayed behind (the manager crashed or the broker was down).
A row is deleted only after the broker confirmed it, so a crash can duplicate a message but
never lose one; consumers drop duplicates by dispatch id.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from orch_contracts import tracing
from orch_contracts.errors import Transient
from orch_manager import repository as repo
from orch_manager.publisher import Publisher
from orch_manager.repository import Pending
from orch_manager.store import ManagerStore

log = logging.getLogger(__name__)

__all__ = ["Outbox", "Pending"]


class Outbox:
    def __init__(self, store: ManagerStore, publisher: Publisher) -> None:
        self.store = store
        self.publisher = publisher
        self._published: list[int] = []  # confirmed, to be deleted by delete_published
        self._in_flight: set[int] = set()  # being published here, not yet confirmed
        self._soon: set[asyncio.Task[None]] = set()  # publish_soon's

    async def _publish(self, rows: Sequence[Pending]) -> list[int]:
        results = await asyncio.gather(*map(self._deliver, rows), return_exceptions=True)
        done = [r.id for r, res in zip(rows, results, strict=True) if res is None]
        failed = [res for res in results if res is not None]
        for res in failed:
            if not isinstance(res, Transient):
                raise res  # a bug, not a broker outage
        if failed:
            log.warning(
                "%d outbox messages not published yet (the relay retries): %s",
                len(failed),
                failed[0],
            )
        return done

    async def _deliver(self, row: Pending) -> None:
        """One message, in a span of the trace it was written in (its headers carry that
        span on: the take is its child)."""
        with tracing.span(
            "publish", parent=row.trace, kind="producer", attributes=lambda: _attributes(row)
        ):
            await self.publisher.deliver(row.to, row.message)

    async def publish_now(self, rows: Sequence[Pending]) -> None:
        """Publish rows just committed; whatever fails stays for the relay. Never raises for an
        unavailable broker.

        Published rows are deleted in batches by ``delete_published`` (every manager runs it):
        a crash before that only makes the relay publish them again, a harmless duplicate.
        """
        if not rows:
            return
        ids = {r.id for r in rows}
        self._in_flight |= ids  # a confirm can take longer than the relay's grace (fsync)
        try:
            done = await self._publish(rows)
            self._published.extend(done)  # the list as it is now: a cleanup may have replaced it
        finally:
            self._in_flight -= ids

    def publish_soon(self, rows: Sequence[Pending]) -> None:
        """``publish_now`` in a task of its own: a leader loop goes on with its next round while
        the broker confirms (a confirm held by an alarm would hold the loop; whatever is not
        confirmed stays for the relay, and the services read their directed starts from the
        outbox meanwhile)."""
        if not rows:
            return
        task = asyncio.get_running_loop().create_task(self.publish_now(rows), name="publish")
        self._soon.add(task)
        task.add_done_callback(self._published_soon)

    def _published_soon(self, task: asyncio.Task[None]) -> None:
        self._soon.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("publishing outbox records failed (the relay retries them): %r", exc)

    async def stop(self) -> None:
        """Cancel the publishes still under way (their records stay for the relay)."""
        for task in list(self._soon):
            task.cancel()
        await asyncio.gather(*self._soon, return_exceptions=True)

    async def delete_published(self) -> int:
        """Delete confirmed rows; they stay in the relay's skip list until the delete commits."""
        ids = list(self._published)
        if ids:
            async with self.store.transaction() as tx:
                await repo.delete_outbox(tx, ids)
            done = set(ids)
            self._published = [i for i in self._published if i not in done]
        return len(ids)

    async def relay_once(self, *, grace: float, limit: int = 500) -> int:
        """Publish rows older than ``grace`` seconds; returns how many were published. The
        publish runs between two transactions: a blocked broker (an alarm) holds no
        transaction open."""
        async with self.store.transaction() as tx:
            skip = [*self._published, *self._in_flight]
            pending = await repo.outbox_due(tx, grace=grace, limit=limit, skip=skip)
        if not pending:
            return 0
        ids = {r.id for r in pending}
        self._in_flight |= ids
        try:
            done = await self._publish(pending)
            if done:
                async with self.store.transaction() as tx:
                    await repo.delete_outbox(tx, done)
        finally:
            self._in_flight -= ids
        return len(done)


def _attributes(row: Pending) -> dict[str, str]:
    observer = getattr(row.message, "observer_id", None)
    out = {
        "messaging.system": "rabbitmq",
        "orch.route": row.to.route.value,
        "orch.pool": row.to.pool,
    }
    if observer is not None:
        out["orch.observer_id"] = str(observer)
    return out
